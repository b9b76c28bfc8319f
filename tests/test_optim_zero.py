"""ZeRO-1 distributed optimizer and the global grad norm across TP, PP and DP (optim/distributed.py)."""

import pytest
import torch
import torch.nn as nn

from distributed import run_distributed
from meshlm.optim.distributed import DistributedOptimizer
from meshlm.optim.distributed import build_optimizer
from meshlm.optim.optimizer import MixedPrecisionOptimizer
from meshlm.parallel.data import DistributedDataParallel
from meshlm.parallel.mesh import ParallelState
from test_ddp import Toy, batch, dp_backward, make_cfg

STEPS = 5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖: the relative error of a whole tensor."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
VARIANTS = {  # name: (use_distributed_optimizer, overlap_grad_reduce, overlap_param_gather, flat collectives,
    #                 the flat AdamW runs of the CUDA fast path, their kernel eager)
    "plain": (False, False, False, True, False),
    "zero1": (True, False, False, True, False),
    "zero1-overlap": (True, True, True, True, False),
    "zero1-gloo-fallback": (True, True, False, False, False),
    "zero1-flat-update": (True, True, True, True, True),
}


def _train(ps, variant):
    dist_opt, overlap_grad, overlap_param, flat, flat_update = VARIANTS[variant]
    cfg = make_cfg(ddp_bucket_size=300, use_distributed_optimizer=dist_opt, overlap_grad_reduce=overlap_grad,
                   overlap_param_gather=overlap_param)
    cfg.optimizer.clip_grad, cfg.optimizer.lr, cfg.optimizer.lr_warmup_iters = 0.5, 1e-2, 0
    model = Toy()
    ddp = DistributedDataParallel([model], ps, cfg)
    ddp.single_tensor_collectives = flat
    opt = build_optimizer(cfg, ps, [model], ddp)
    assert isinstance(opt, DistributedOptimizer) == dist_opt
    if flat_update:  # runs of both sizes: the compiled kernel's and the multi-tensor kernel's
        import meshlm.optim.optimizer as optimizer
        from meshlm.optim.adamw import flat_steps
        opt.flat, opt.fused, opt._kernel, opt._runs = True, True, flat_steps, opt._flat_runs()
        # the largest runs of this rank's shards to the kernel, the rest to the multi-tensor path
        restore, optimizer.FLAT_MIN = optimizer.FLAT_MIN, max(r.master.numel() for r, *_ in opt._runs)
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels = batch(8, seed=step)
        ddp.zero_grad()
        mine = tokens.chunk(ps.dp)[ps.dp_rank], labels.chunk(ps.dp)[ps.dp_rank]
        losses.append(float(model(*mine).detach()))
        dp_backward(model, ddp, tokens, labels, ps.dp_rank, ps.dp, micro=2)
        res = opt.step()
        assert res.ok and not res.skipped
        norms.append(res.grad_norm)
    opt.finish_param_sync()
    if flat_update:
        optimizer.FLAT_MIN = restore
    return model, opt, {"losses": losses, "norms": norms,
                        "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _matches(opt, full: dict, exact: bool) -> bool:
    """Whether every piece of opt's state equals that range of ``full`` {param: {kind: flat}}."""
    return all(torch.equal(t, full[p][k][lo:lo + t.numel()]) if exact else rel_err(t, full[p][k][lo:lo + t.numel()]) < 1e-12
               for p, lo, views in opt.state_pieces() for k, t in views.items())


def _zero_vs_plain(rank, world, root):
    from meshlm.checkpoint import dist as ckpt
    from meshlm.checkpoint.model_space import ModelSpace
    from meshlm.checkpoint.state import optimizer_state
    ps = ParallelState.build()
    runs, opts, models = {}, {}, {}
    for variant in VARIANTS:
        models[variant], opts[variant], runs[variant] = _train(ps, variant)
    plain = {p: views for p, lo, views in opts["plain"].state_pieces()}  # plain DP: whole params
    by_name = {n: plain[p] for n, p in models["plain"].named_parameters()}
    zero_model = models["zero1"]
    runs["state_match"] = _matches(opts["zero1"], {p: by_name[n] for n, p in zero_model.named_parameters()}, False)
    # a ZeRO-1 optimizer loads the plain-DP state (another sharding) from a checkpoint, nothing gathered
    ckpt.save(root, 1, {"optimizer": optimizer_state(opts["plain"], ModelSpace([models["plain"]], ps))})
    fresh_model, fresh, _ = _train(ps, "zero1")
    _, tree = ckpt.load(root, {"optimizer": optimizer_state(fresh, ModelSpace([fresh_model], ps), load=True)})
    fresh.load_state_dict(tree["optimizer"])
    runs["state_match"] &= fresh.step_count == STEPS and _matches(
        fresh, {p: by_name[n] for n, p in fresh_model.named_parameters()}, True)
    runs["memory"] = opts["zero1"].memory_report()
    bf16 = Toy(dtype=torch.bfloat16)
    cfg = make_cfg(use_distributed_optimizer=True)
    cfg.training.bf16 = True
    ddp = DistributedDataParallel([bf16], ps, cfg)
    runs["memory_bf16"] = build_optimizer(cfg, ps, [bf16], ddp).memory_report()
    runs["padded_bf16"] = ddp.buffers[0].numel
    runs["shard_sizes"] = [s.end - s.start for s in opts["zero1"].shards]
    return runs


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_matches_plain_dp_over_five_steps(dp, tmp_path):
    for runs in run_distributed(_zero_vs_plain, dp, str(tmp_path / "ckpt")):
        ref = runs["plain"]
        for variant in ("zero1", "zero1-overlap", "zero1-gloo-fallback", "zero1-flat-update"):
            got = runs[variant]
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-12)
            assert got["norms"] == pytest.approx(ref["norms"], rel=1e-12)
            assert min(ref["norms"]) > 0.5, "clipping must be active"
            for n, p in ref["params"].items():  # the grad norm's summation order differs: ulp-level
                assert rel_err(got["params"][n], p) < 1e-12, f"{variant} {n}"
        assert runs["state_match"]
        mem, shard = runs["memory"], sum(runs["shard_sizes"])
        assert mem["optimizer_bytes"] == 16 * shard  # float64: masters are the params; 2 moments
        assert shard * dp >= mem["num_params"] > (shard - 64 * len(runs["shard_sizes"])) * dp
        # bf16 params, fp32 main_grads, fp32 master + Adam moments sharded: 2 + 4 + 12/DP bytes
        mem, padded = runs["memory_bf16"], runs["padded_bf16"]
        assert padded % (64 * dp) == 0
        assert (mem["weights_bytes"], mem["grads_bytes"], mem["optimizer_bytes"]) == (
            2 * padded, 4 * padded, 12 * padded // dp)


# ----------------------------------------------------------------------------- grad norm, TP × PP

class Stage(nn.Module):
    """One pipeline stage's params: a TP-split weight, a replicated norm, the shared embedding."""

    def __init__(self, tp):
        super().__init__()
        self.emb = nn.Parameter(torch.zeros(5, 6, dtype=torch.float64))
        self.w = nn.Parameter(torch.zeros(8 // tp, 6, dtype=torch.float64))
        self.norm = nn.Parameter(torch.zeros(6, dtype=torch.float64))
        self.emb.shared_embedding = True
        self.w.tensor_model_parallel, self.w.partition_dim = True, 0
        self.norm.sequence_parallel = self.norm.no_weight_decay = True


def full_grads(stage):
    g = torch.Generator().manual_seed(stage)
    emb = torch.randn(5, 6, generator=torch.Generator().manual_seed(99), dtype=torch.float64)  # both stages
    return {"emb": emb, "w": torch.randn(8, 6, generator=g, dtype=torch.float64),
            "norm": torch.randn(6, generator=g, dtype=torch.float64)}


def _tp_pp_norms(rank, world):
    ps = ParallelState.build(tp=2, pp=2)
    return [_tp_pp_norm(ps, dist_opt) for dist_opt in (False, True)]


def _tp_pp_norm(ps, dist_opt):
    cfg = make_cfg(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, use_distributed_optimizer=dist_opt)
    cfg.optimizer.clip_grad = 1e9
    stage = Stage(tp=2)
    ddp = DistributedDataParallel([stage], ps, cfg)
    opt = build_optimizer(cfg, ps, [stage], ddp)
    full = full_grads(ps.pp_rank)
    stage.emb.main_grad.copy_(full["emb"])  # the grads as they are after finish_grad_sync
    stage.norm.main_grad.copy_(full["norm"])
    stage.w.main_grad.copy_(full["w"].chunk(2, dim=0)[ps.tp_rank])
    return opt.step().grad_norm


def test_grad_norm_under_tp2_pp2_counts_each_param_once_plain_and_zero1():
    grads = [full_grads(0), full_grads(1)]
    want = torch.sqrt(grads[0]["emb"].pow(2).sum()
                      + sum(g["w"].pow(2).sum() + g["norm"].pow(2).sum() for g in grads))
    for norms in run_distributed(_tp_pp_norms, 4):
        assert norms == pytest.approx([float(want)] * 2, rel=1e-12)


def test_build_optimizer_picks_the_class_from_the_flag():
    for flag, cls in ((False, MixedPrecisionOptimizer), (True, DistributedOptimizer)):
        cfg = make_cfg(use_distributed_optimizer=flag)
        model = Toy()
        ddp = DistributedDataParallel([model], ParallelState.single(), cfg)
        assert type(build_optimizer(cfg, ParallelState.single(), [model], ddp)) is cls


# ----------------------------------------------------------------------------- GPTModel under TP = 2

def gpt_cfg():
    from meshlm.config import Config
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 32, 4, 16
    m.hidden_dropout = m.attention_dropout = 0.0
    m.make_vocab_size_divisible_by = 8
    cfg.optimizer.clip_grad, cfg.optimizer.lr, cfg.optimizer.lr_warmup_iters = 0.5, 1e-2, 0
    return cfg


def gpt_losses_and_norms(ps, tp, sequence_parallel, dist_opt=False):
    """Three optimizer steps of GPTModel on fixed batches: (losses, grad norms + the first step's
    norm over the TP-replicated params alone)."""
    from meshlm.model.transformer import GPTModel
    cfg = gpt_cfg()
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.sequence_parallel = tp, sequence_parallel
    cfg.parallel.use_distributed_optimizer = dist_opt
    model = GPTModel(cfg.model, ps, 100, seed=7, sequence_parallel=sequence_parallel, params_dtype=torch.float64)
    ddp = DistributedDataParallel([model], ps, cfg)
    opt = build_optimizer(cfg, ps, [model], ddp)
    losses, norms = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 100, (2, 17), generator=g)
        ddp.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        ddp.finish_grad_sync()
        losses.append(float(loss.detach()))
        if step == 0:  # the norm of the TP-replicated params alone (layer norms, biases, positions)
            saved = [p.main_grad.clone() for p in model.parameters()]
            for p in model.parameters():
                if getattr(p, "tensor_model_parallel", False):
                    p.main_grad.zero_()
            replicated = opt.grad_norm([sh.grad for sh in opt.shards])
            for p, g in zip(model.parameters(), saved):
                p.main_grad.copy_(g)
        norms.append(opt.step().grad_norm)
    return losses, norms + [replicated]


def _gpt_tp2(rank, world):
    ps = ParallelState.build(tp=2)
    return [gpt_losses_and_norms(ps, 2, sp) for sp in (False, True)]


def test_gpt_tp2_with_and_without_sp_matches_single_process_norms_and_losses():
    want_losses, want_norms = gpt_losses_and_norms(ParallelState.single(), 1, False)
    assert min(want_norms) > 0.5, "clipping must be active"
    for runs in run_distributed(_gpt_tp2, 2):
        for losses, norms in runs:
            assert losses == pytest.approx(want_losses, rel=1e-10)
            assert norms == pytest.approx(want_norms, rel=1e-10)
