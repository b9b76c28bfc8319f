"""Mixed-precision AdamW, loss scaling, clipping, NaN handling, state dicts (optim/optimizer.py)."""

import contextlib
import copy

import pytest
import torch

from meshlm.optim.distributed import build_optimizer
from meshlm.parallel.data import DistributedDataParallel
from meshlm.parallel.mesh import ParallelState
from test_ddp import Toy, batch, make_cfg


def setup(dtype=torch.float64, clip=0.0, wd=0.1, lr=1e-2, moments=("fp32", "fp32"), **training):
    cfg = make_cfg(ddp_bucket_size=300)
    o = cfg.optimizer
    o.clip_grad, o.weight_decay, o.lr, o.lr_warmup_iters = clip, wd, lr, 0
    o.use_precision_aware_optimizer = moments != ("fp32", "fp32")
    o.exp_avg_dtype, o.exp_avg_sq_dtype = moments
    o.lr_decay_style = "constant"
    for k, v in training.items():
        setattr(cfg.training, k, v)
    cfg.training.bf16 = dtype == torch.bfloat16
    cfg.training.fp16 = dtype == torch.float16
    model = Toy(dtype=dtype)
    ps = ParallelState.single()
    ddp = DistributedDataParallel([model], ps, cfg)
    return model, ddp, build_optimizer(cfg, ps, [model], ddp)


def train_step(model, ddp, opt, seed):
    tokens, labels = batch(4, seed)
    ddp.zero_grad()
    loss = model(tokens, labels)
    (loss * opt.loss_scale).backward()
    ddp.finish_grad_sync()
    return float(loss.detach()), opt.step()


def test_adamw_matches_torch_adamw_with_no_decay_on_biases_and_norms():
    model, ddp, opt = setup(wd=0.1)
    ref = Toy(dtype=torch.float64)
    groups = [{"params": [p for n, p in ref.named_parameters() if not getattr(p, "no_weight_decay", False)]},
              {"params": [p for n, p in ref.named_parameters() if getattr(p, "no_weight_decay", False)],
               "weight_decay": 0.0}]
    torch_opt = torch.optim.AdamW(groups, lr=1e-2, betas=opt.betas, eps=opt.eps, weight_decay=0.1, foreach=False)
    for step in range(3):
        train_step(model, ddp, opt, seed=step)
        torch_opt.zero_grad()
        ref(*batch(4, step)).backward()
        torch_opt.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15, msg=n)


def test_weight_decay_skips_no_weight_decay_params():
    model, ddp, opt = setup(wd=0.5, lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp.zero_grad()
    ddp.finish_grad_sync()  # no backward: zero gradients, only weight decay moves the params
    assert opt.step().ok
    for n, p in model.named_parameters():
        factor = 1.0 if getattr(p, "no_weight_decay", False) else 1 - 0.1 * 0.5
        torch.testing.assert_close(p, before[n] * factor, msg=n)


def test_clipping_matches_torch_clip_grad_norm():
    model, ddp, opt = setup(clip=0.05, wd=0.0, lr=0.0)
    ref = Toy(dtype=torch.float64)
    ref(*batch(4, 0)).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    _, res = train_step(model, ddp, opt, seed=0)
    assert res.grad_norm == pytest.approx(float(want), rel=1e-12)
    assert res.grad_norm > 0.05, "the test must clip"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-12, atol=1e-15)


def test_fp16_overflow_skips_exactly_that_step_and_halves_the_scale():
    model, ddp, opt = setup(torch.float16, initial_loss_scale=1024.0, hysteresis=1, loss_scale_window=100)
    _, first = train_step(model, ddp, opt, seed=0)
    assert first.ok and not first.skipped and first.loss_scale == 1024.0
    before = [p.detach().clone() for p in model.parameters()]
    master_before = [s.master.clone() for s in opt.shards]
    ddp.zero_grad()
    (model(*batch(4, 1)) * opt.loss_scale).backward()
    ddp.finish_grad_sync()
    model.fc1.weight.main_grad[0, 0] = float("inf")  # forced overflow
    res = opt.step()
    assert res.skipped and res.found_inf and res.ok and res.loss_scale == 1024.0
    assert opt.loss_scale == 512.0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(s.master, m) for s, m in zip(opt.shards, master_before))
    _, third = train_step(model, ddp, opt, seed=2)
    assert not third.skipped and third.loss_scale == 512.0


def test_fp16_hysteresis_and_growth_window():
    model, ddp, opt = setup(torch.float16, initial_loss_scale=64.0, hysteresis=2, loss_scale_window=2)
    for expected_scale in (64.0, 64.0):  # two overflows: the first is tolerated, the second halves
        ddp.zero_grad()
        ddp.finish_grad_sync()
        model.out.weight.main_grad.fill_(float("nan"))
        assert opt.step().skipped
    assert opt.loss_scale == 32.0
    train_step(model, ddp, opt, seed=0)
    train_step(model, ddp, opt, seed=1)
    assert opt.loss_scale == 64.0


def test_fp16_unscales_gradients_before_the_update():
    model, ddp, opt = setup(torch.float16, initial_loss_scale=256.0, clip=0.0)
    ref = Toy(dtype=torch.float64)
    ref(*batch(4, 0)).backward()
    _, res = train_step(model, ddp, opt, seed=0)
    assert res.ok and not res.skipped
    want = torch.sqrt(sum(q.grad.float().pow(2).sum() for q in ref.parameters()))
    assert res.grad_norm == pytest.approx(float(want), rel=2e-2)  # fp16 forward vs fp32 reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_gradient_in_bf16_or_fp32_is_reported_not_trained_on(dtype):
    model, ddp, opt = setup(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    ddp.zero_grad()
    ddp.finish_grad_sync()
    assert ddp.lazy_check and ddp.local_grads_finite() is True  # one process: summed when asked
    model.norm.weight.main_grad[0] = float("nan")
    res = opt.step()
    assert not res.ok and res.skipped and res.found_inf
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert ddp.local_grads_finite() is False and not ddp._checked_sums  # no per-step sums taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_resumes_identically(dtype):
    model, ddp, opt = setup(dtype, clip=1.0)
    for s in range(2):
        train_step(model, ddp, opt, seed=s)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())  # the scalars; the tensors are state_pieces
    saved_pieces = [{k: v.clone() for k, v in st.items()} for _, _, st in opt.state_pieces()]
    assert all(isinstance(v, (int, float)) for v in saved_opt["loss_scaler"].values())
    for s in range(2, 4):
        train_step(model, ddp, opt, seed=s)

    model2, ddp2, opt2 = setup(dtype, clip=1.0)
    model2.load_state_dict(saved_model)
    for (_, _, st), saved in zip(opt2.state_pieces(), saved_pieces):
        for k, v in st.items():
            v.copy_(saved[k])
    opt2.load_state_dict(saved_opt)
    for s in range(2, 4):
        train_step(model2, ddp2, opt2, seed=s)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert opt2.step_count == opt.step_count == 4


def test_bf16_loss_curve_tracks_fp32():
    curves = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, ddp, opt = setup(dtype, clip=1.0, lr=3e-3)
        curves[dtype] = [train_step(model, ddp, opt, seed=s % 2)[0] for s in range(12)]
    fp32, bf16 = curves[torch.float32], curves[torch.bfloat16]
    assert fp32[-1] < fp32[0] - 0.1, "the test must train"
    for a, b in zip(fp32, bf16):
        assert abs(a - b) / a < 1e-2


def test_memory_report_counts_bytes_per_parameter():
    for dtype, weights, optim in ((torch.bfloat16, 2, 12), (torch.float32, 4, 8)):
        model, ddp, opt = setup(dtype)
        rep = opt.memory_report()
        n = sum(p.numel() for p in model.parameters())
        assert rep["num_params"] == n
        assert rep["bytes_per_param"] == {"weights": weights, "grads": 4, "optimizer": optim,
                                          "total": weights + 4 + optim}
        assert rep["total_bytes"] == n * (weights + 4 + optim)


def _flat(opt, monkeypatch, min_elements):
    """opt on the flat update (the CUDA fast path's), its kernel eager; runs of at least
    ``min_elements`` go to the kernel, the rest to the multi-tensor kernel."""
    import meshlm.optim.optimizer as optimizer
    from meshlm.optim.adamw import flat_steps
    monkeypatch.setattr(optimizer, "FLAT_MIN", min_elements)
    opt.flat, opt.fused, opt._kernel, opt._runs = True, True, flat_steps, opt._flat_runs()
    return opt


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_flat_update_matches_the_foreach_adamw_in_float64(monkeypatch, clip):
    """The flat runs (optim/adamw.py flat_adamw_, both sizes of run) give the foreach update:
    weight decay per run, clipping, the step's bias corrections."""
    a, ddp_a, opt_a = setup(wd=0.1, clip=clip)
    b, ddp_b, opt_b = setup(wd=0.1, clip=clip)
    _flat(opt_b, monkeypatch, 100)
    kinds = {r.master.numel() >= 100 for r, *_ in opt_b._runs}
    assert kinds == {True, False} and any(not r.decay for r, *_ in opt_b._runs)
    for step in range(3):
        _, res = train_step(a, ddp_a, opt_a, seed=step)
        train_step(b, ddp_b, opt_b, seed=step)
    assert clip == 0 or res.grad_norm > clip, "the test must clip"
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-15, msg=n)


def test_flat_kernel_takes_the_grad_scale_as_the_fused_kernel_does():
    """flat_adamw_ with grad_scale s on grads g equals the update on g / s (float64), and leaves g."""
    from meshlm.optim.adamw import Group, Run, adamw_, flat_adamw_
    torch.manual_seed(0)
    p, g, m = (torch.randn(50, dtype=torch.float64) for _ in range(3))
    v = torch.rand(50, dtype=torch.float64)
    ref = [t.clone() for t in (p, g, m, v)]
    ref[1] /= 1.7
    kw = dict(step=4, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    adamw_([Group([ref[0]], [ref[1]], [ref[2]], [ref[3]], True)], fused=False, **kw)
    g0 = g.clone()
    flat_adamw_([Run(p, g, m, v, None, True)], grad_scale=1.7, **kw)
    for x, y in zip((p, m, v), (ref[0], ref[2], ref[3])):
        torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-16)
    assert torch.equal(g, g0)


def test_flat_update_publishes_the_bf16_params(monkeypatch):
    """bf16 params, fp32 masters: the flat update writes each run's new master into the params
    (no separate publish), and the masters follow the foreach update at fp32 rounding."""
    a, ddp_a, opt_a = setup(dtype=torch.bfloat16, wd=0.1)
    b, ddp_b, opt_b = setup(dtype=torch.bfloat16, wd=0.1)
    _flat(opt_b, monkeypatch, 100)
    opt_b._publish = lambda: None  # the params can change only through the flat update's writes
    for step in range(2):
        train_step(a, ddp_a, opt_a, seed=step)
        train_step(b, ddp_b, opt_b, seed=step)
    for sa, sb in zip(opt_a.shards, opt_b.shards):
        torch.testing.assert_close(sb.master, sa.master, rtol=1e-6, atol=1e-7)
        assert torch.equal(sb.param, sb.master.to(torch.bfloat16))


def test_flat_update_skips_a_nan_step_and_keeps_no_grad(monkeypatch):
    """A NaN gradient on the flat path: nothing updated, and no run holds a view of the step's
    grads afterwards (they would keep the gradient buckets alive into the next step)."""
    model, ddp, opt = setup(torch.bfloat16)
    _flat(opt, monkeypatch, 100)
    before = [p.detach().clone() for p in model.parameters()]
    ddp.zero_grad()
    ddp.finish_grad_sync()
    model.norm.weight.main_grad[0] = float("nan")
    assert opt.step().skipped
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(r.grad is None for r, *_ in opt._runs) and opt._small == []
    train_step(model, ddp, opt, seed=0)
    assert all(r.grad is None for r, *_ in opt._runs) and opt._small == []


def test_bf16_grad_buckets_give_the_fp32_buckets_update_and_take_one_backward(monkeypatch):
    """config.half_grads (forced here; it needs the CUDA fast path): bf16 params' buckets hold their
    bf16 grads as they are, the flat update and grad norm widen them as they read: the same masters
    and norms as fp32 buckets (clipping on), 2 bytes a gradient, and a second backward refused."""
    import meshlm.parallel.data as data
    a, ddp_a, opt_a = setup(dtype=torch.bfloat16, wd=0.1, clip=0.05)
    monkeypatch.setattr(data, "half_grads", lambda *args: True)
    b, ddp_b, opt_b = setup(dtype=torch.bfloat16, wd=0.1, clip=0.05)
    assert {buf.grad_dtype for buf in ddp_a.buffers} == {torch.float32}
    assert {buf.grad_dtype for buf in ddp_b.buffers} == {torch.bfloat16}
    for opt in (opt_a, opt_b):
        _flat(opt, monkeypatch, 100)
    for step in range(3):
        _, res_a = train_step(a, ddp_a, opt_a, seed=step)
        _, res_b = train_step(b, ddp_b, opt_b, seed=step)
        assert res_a.grad_norm > 0.05 and res_b.grad_norm == pytest.approx(res_a.grad_norm, rel=1e-6)
    for sa, sb in zip(opt_a.shards, opt_b.shards):
        torch.testing.assert_close(sb.master, sa.master, rtol=1e-6, atol=1e-7)
    assert opt_b.memory_report()["bytes_per_param"]["grads"] == 2
    ddp_b.zero_grad()
    b(*batch(4, 0)).backward()
    with pytest.raises(RuntimeError, match="one micro-batch"):
        b(*batch(4, 1)).backward()


def test_half_grads_only_where_one_backward_is_all_a_bucket_gets():
    from meshlm.config import Config, half_grads
    def cfg(**kw):
        c = Config()
        c.training.bf16 = True
        for k, v in kw.items():
            obj = c.training if hasattr(c.training, k) else c.parallel if hasattr(c.parallel, k) else c.optimizer
            setattr(obj, k, v)
        return c
    assert half_grads(cfg(), 1) and not half_grads(cfg(), 1, cuda=False)
    assert not half_grads(cfg(), 2)  # DP 2 reduces
    assert not half_grads(cfg(global_batch_size=2), 1)  # two micro-batches sum
    assert not half_grads(cfg(bf16=False), 1) and not half_grads(cfg(fast_path="off"), 1)
    assert not half_grads(cfg(overlap_grad_reduce=True), 1) and not half_grads(cfg(optimizer_cpu_offload=True), 1)
    assert not half_grads(cfg(tensor_model_parallel_size=2, sequence_parallel=True), 2)


def test_one_rank_takes_one_bucket_and_the_norm_of_whole_shards():
    """DP × CP 1: one bucket a buffer by default (parallel/data.py ONE_RANK_BUCKET), and the grad
    norm over whole shards equals the norm over their fragments (float64)."""
    cfg = make_cfg()
    model, ps = Toy(), ParallelState.single()
    ddp = DistributedDataParallel([model], ps, cfg)
    opt = build_optimizer(cfg, ps, [model], ddp)
    assert [len(buf.buckets) for buf in ddp.buffers] == [1] and all(s.whole_norm for s in opt.shards)
    ddp.zero_grad()
    model(*batch(4, 0)).backward()
    ddp.finish_grad_sync()
    grads = [s.grad for s in opt.shards]
    whole = opt.grad_norm(grads)
    for s in opt.shards:
        s.whole_norm = False
    assert whole == pytest.approx(opt.grad_norm(grads), rel=1e-13) and whole > 0


@pytest.mark.parametrize("path", ["foreach", "flat"])
def test_bf16_moments_are_adamw_with_its_moments_rounded_each_step(monkeypatch, path):
    """--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16: float64 masters,
    the moments stored in bf16; each step is AdamW in float64 on the widened moments (the new
    params from the unrounded ones), the moments then rounded to nearest, by hand; clipping on.
    Both the foreach update and the flat runs (large and small). It differs from fp32 moments."""
    model, ddp, opt = setup(wd=0.1, clip=0.05, moments=("bf16", "bf16"))
    full, ddp_f, opt_f = setup(wd=0.1, clip=0.05)
    if path == "flat":
        _flat(opt, monkeypatch, 100)
        assert {r.master.numel() >= 100 for r, *_ in opt._runs} == {True, False}
    assert {s.exp_avg.dtype for s in opt.shards} == {s.exp_avg_sq.dtype for s in opt.shards} == {torch.bfloat16}
    ref = Toy(dtype=torch.float64)
    state = {q: (torch.zeros_like(q, dtype=torch.bfloat16), torch.zeros_like(q, dtype=torch.bfloat16))
             for q in ref.parameters()}
    b1, b2 = opt.betas
    for step in range(1, 4):
        _, res = train_step(model, ddp, opt, seed=step)
        train_step(full, ddp_f, opt_f, seed=step)
        ref.zero_grad()
        ref(*batch(4, step)).backward()
        norm = torch.sqrt(sum(q.grad.square().sum() for q in ref.parameters()))
        assert norm > 0.05 and float(norm) == pytest.approx(res.grad_norm, rel=1e-12)
        with torch.no_grad():
            for q in ref.parameters():
                g = q.grad * min(1.0, 0.05 / (float(norm) + 1e-6))
                if not getattr(q, "no_weight_decay", False):
                    q.mul_(1 - 1e-2 * 0.1)
                m, v = state[q]
                m_new = b1 * m.double() + (1 - b1) * g
                v_new = b2 * v.double() + (1 - b2) * g * g
                q.sub_(1e-2 / (1 - b1 ** step) * m_new / (v_new.sqrt() / (1 - b2 ** step) ** 0.5 + opt.eps))
                m.copy_(m_new), v.copy_(v_new)
    for (n, p), q, f in zip(model.named_parameters(), ref.parameters(), full.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-13, msg=n)
    assert max(float((p - f).detach().abs().max()) for p, f in zip(model.parameters(), full.parameters())) > 1e-7


def test_moment_dtypes_are_validated_as_megatron_does():
    """Non-fp32 moments need --use-precision-aware-optimizer; fp16/fp8 and offloaded shards are
    refused in one line naming the flag."""
    from meshlm.validate import _moment_dtype_problems
    o = make_cfg().optimizer
    o.exp_avg_dtype = "bf16"
    assert _moment_dtype_problems(o) == ["--exp-avg-dtype bf16 needs --use-precision-aware-optimizer (as in "
                                         "Megatron-LM); add it or drop --exp-avg-dtype"]
    o.use_precision_aware_optimizer = True
    assert _moment_dtype_problems(o) == []
    o.exp_avg_sq_dtype = "fp16"
    assert ["--exp-avg-sq-dtype fp16" in line and "bf16" in line for line in _moment_dtype_problems(o)] == [True]
    o.exp_avg_sq_dtype, o.optimizer_cpu_offload = "fp32", True
    assert ["--optimizer-cpu-offload" in line for line in _moment_dtype_problems(o)] == [True]


def test_grad_reduce_in_bf16_accumulates_the_micro_batches_in_bf16():
    """--grad-reduce-in-bf16 (Megatron's): bf16 params' buckets are bf16 and the micro-batches'
    gradients add in bf16 (each backward's bf16 grad into the bf16 main_grad, in order); without it
    they are fp32 and the sum is fp32's. Two micro-batches, compared with the sums by hand."""
    def grads(reduce_in_bf16):
        cfg = make_cfg(ddp_bucket_size=300, grad_reduce_in_bf16=reduce_in_bf16)
        cfg.training.bf16 = True
        model = Toy(dtype=torch.bfloat16)
        ref = copy.deepcopy(model)  # before DDP's hooks
        ddp = DistributedDataParallel([model], ParallelState.single(), cfg)
        ddp.zero_grad()
        for seed in range(2):
            with ddp.no_sync() if seed == 0 else contextlib.nullcontext():
                model(*batch(4, seed)).backward()
        ddp.finish_grad_sync()
        each = []
        for seed in range(2):
            ref.zero_grad()
            ref(*batch(4, seed)).backward()
            each.append([q.grad.clone() for q in ref.parameters()])
        return {b.grad_dtype for b in ddp.buffers}, [p.main_grad for p in model.parameters()], each

    dtypes, got, (g0, g1) = grads(True)
    assert dtypes == {torch.bfloat16}
    for have, a, b in zip(got, g0, g1):
        torch.testing.assert_close(have, a + b, rtol=0, atol=0)  # bf16 + bf16, rounded to bf16
    dtypes, got, (g0, g1) = grads(False)
    assert dtypes == {torch.float32}
    for have, a, b in zip(got, g0, g1):
        torch.testing.assert_close(have, a.float() + b.float(), rtol=0, atol=0)


@pytest.mark.parametrize("flat", [False, True])
def test_decoupled_lr_gives_the_embedding_and_output_layer_their_own_schedule(monkeypatch, flat):
    """--decoupled-lr / --decoupled-min-lr (Megatron's): the word embedding and the output layer
    (``embedding_or_output``) step at the decoupled LR, on the same warm-up and decay as --lr's with
    their own peak and floor; the rest at --lr. float64 against torch's AdamW with those two groups'
    LRs set each step from the schedule by hand (linear warm-up 2 steps, then linear decay)."""
    from meshlm.optim.schedule import LRScheduler
    cfg = make_cfg(ddp_bucket_size=300)
    o = cfg.optimizer
    o.clip_grad, o.weight_decay, o.lr, o.min_lr, o.lr_warmup_iters = 0.0, 0.1, 1e-2, 1e-3, 2
    o.decoupled_lr, o.decoupled_min_lr, o.lr_decay_style, o.lr_decay_iters = 4e-2, 2e-3, "linear", 5
    model, ref = Toy(), Toy()
    for m in (model, ref):
        m.emb.weight.embedding_or_output = m.out.weight.embedding_or_output = True
    ddp = DistributedDataParallel([model], ParallelState.single(), cfg)
    opt = build_optimizer(cfg, ParallelState.single(), [model], ddp)
    if flat:
        _flat(opt, monkeypatch, 100)
    sched = LRScheduler(o, train_iters=5)
    decoupled = [ref.emb.weight, ref.out.weight]
    rest = [p for p in ref.parameters() if all(p is not q for q in decoupled)]
    groups = [{"params": decoupled, "weight_decay": 0.1, "mine": True},
              {"params": [p for p in rest if not getattr(p, "no_weight_decay", False)], "weight_decay": 0.1},
              {"params": [p for p in rest if getattr(p, "no_weight_decay", False)], "weight_decay": 0.0}]
    torch_opt = torch.optim.AdamW(groups, lr=1.0, betas=opt.betas, eps=opt.eps, foreach=False)
    lrs = []
    for step in range(4):
        for g in torch_opt.param_groups:
            g["lr"] = sched.decoupled_lr if g.get("mine") else sched.lr
        lrs.append((sched.lr, sched.decoupled_lr))
        train_step(model, ddp, opt, seed=step)
        torch_opt.zero_grad()
        ref(*batch(4, step)).backward()
        torch_opt.step()
        sched.step(opt)
    assert lrs[1] == (5e-3, 2e-2) and lrs[3][1] == pytest.approx(2e-3 + (4e-2 - 2e-3) * 2 / 3, rel=1e-12)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15, msg=n)


def test_flat_steps_is_one_graph_for_every_run_and_step():
    """The flat update is one compiled call a step for all runs (optim/adamw.py ``flat_steps``): under
    torch.compile (dynamo, dynamic sizes) the runs' floats are graph inputs, so changing LR, bias
    corrections and grad scale recompile nothing, and it equals the eager per-run kernel exactly."""
    from torch._dynamo.utils import counters

    from meshlm.optim.adamw import Run, flat_adamw_, flat_step, flat_steps
    gen = torch.Generator().manual_seed(0)

    def runs():
        out = []
        for i, n in enumerate((300, 1000, 77)):
            t = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(4)]
            out.append(Run(t[0], t[1], t[2] * 1e-2, t[3].abs() * 1e-4, torch.empty(n, dtype=torch.bfloat16)
                           if i != 1 else None, decay=i != 2, lr_mult=(1.0, 0.5, 2.0)[i]))
        return out
    got = runs()
    want = [Run(*(x.clone() if isinstance(x, torch.Tensor) else x for x in vars(r).values())) for r in got]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(flat_steps, dynamic=True, backend="aot_eager")
    kw = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(1, 5):
        flat_adamw_(got, step=step, lr=1e-3 * step, grad_scale=1.0 + step, kernel=compiled, **kw)
        for r in want:  # the per-run kernel with the same floats
            lr_r = 1e-3 * step * r.lr_mult
            flat_step(r.master, r.grad, r.exp_avg, r.exp_avg_sq, r.out, lr_r * (0.1 if r.decay else 0.0), 0.9, 0.95,
                      lr_r / (1 - 0.9 ** step), (1 - 0.95 ** step) ** 0.5, 1e-8, 1.0 + step)
    assert counters["stats"]["unique_graphs"] == 1
    for a, b in zip(got, want):
        assert torch.equal(a.master, b.master) and torch.equal(a.exp_avg_sq, b.exp_avg_sq)
        assert a.out is None or torch.equal(a.out, b.out)
