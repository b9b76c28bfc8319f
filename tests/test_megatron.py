"""meshlm against megatron-core 0.16.1 itself: the same function, and its checkpoints both ways.

One gloo start of two workers (``mcore``, module fixture) builds megatron-core's GPTModel
(tests/megatron_gpt.py) for each case at its TP, saves it with dist_checkpointing (Megatron-LM's
torch_dist layout), and computes its logits, per-token loss and full gradients; in the same
workers meshlm's production model (GPTModel over a ParallelState of the same TP) is filled from
that checkpoint by the converter's reader and computes the same. The tests then compare them, and
run the round trip megatron-core save → ``convert --from-megatron`` → a meshlm training step →
``convert --to-megatron`` → megatron-core load → the same logits as meshlm's. The same start
also saves a GPT-2 at PP=2, and runs megatron-core's DistributedOptimizer (its CPU patches in
tests/megatron_gpt.py) to write Megatron-LM's default optimizer format: fp32 at DP=2, which
meshlm resumes to megatron-core's own next step, and bf16 at TP=2 with a padded vocabulary.

Float64 wherever megatron-core allows it: its RoPE frequencies, MoE router and cross-entropy are
float32, so the Llama and MoE cases and every loss agree to float32 rounding (~1e-7 relative); the
GPT-2 logits and gradients to float64 rounding with exact GeLU (--no-bias-gelu-fusion) and to 1e-9
with Megatron's default fused bias-GeLU (its kernel rounds sqrt(2/π) to 0.79788456), which meshlm
computes by default too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[test])")
pytest.importorskip("psutil", reason="megatron-core's dist_checkpointing.save needs psutil")

from distributed import run_distributed  # noqa: E402

VOCAB = PADDED = 64  # no padding rows: megatron-core's softmax includes them, meshlm's masks them (README)
SEQ = 8
LLAMA = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
             normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True)
GPT2 = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32)  # Megatron's fused tanh GeLU
GPT2_EXACT = dict(GPT2, bias_gelu_fusion=False)  # --no-bias-gelu-fusion: exact GeLU in both
MOE = dict(LLAMA, num_experts=4, moe_ffn_hidden_size=12, moe_router_topk=2)
QWEN = dict(LLAMA, qk_layernorm=True, add_qkv_bias=True)  # Qwen3's q/k norms beside Qwen2's QKV-only biases
ROUND_TRIP = ("llama_tp1", "gpt2_tp2", "moe_tp2")
PADDED_VOCAB = (60, 64)  # 60 ids padded to 64 rows: --make-vocab-size-divisible-by 32 × TP 2
# name: (meshlm flags, TP, expert layout singleton_local_shards)
CASES = {"llama_tp1": (LLAMA, 1, False), "llama_tp2": (LLAMA, 2, False), "gpt2_tp1": (GPT2, 1, False),
         "gpt2_tp2": (GPT2, 2, False), "gpt2_exact_gelu_tp2": (GPT2_EXACT, 2, False), "moe_tp2": (MOE, 2, False),
         "moe_singleton_tp1": (MOE, 1, True), "moe_ep2": (dict(MOE, ep=2), 1, False), "qwen_tp2": (QWEN, 2, False)}


def _meshlm_config(spec: dict):
    """meshlm's ModelConfig of the case's flags (no dropout, as the megatron-core model)."""
    from meshlm import config as C
    fields = {k: v for k, v in spec.items() if k in {f.name for f in dataclasses.fields(C.ModelConfig)}}
    if "num_query_groups" in fields:
        fields["group_query_attention"] = True
    return C.ModelConfig(**fields, seq_length=SEQ, max_position_embeddings=SEQ, vocab_size=VOCAB,
                         hidden_dropout=0.0, attention_dropout=0.0)


def _meshlm_grads(model, ps) -> dict:
    """{global name: full gradient} of a meshlm model (collective over TP)."""
    from meshlm.parallel.tensor import gather_full_state_dict
    saved = {}
    for p in model.parameters():
        saved[p] = p.data
        p.data = p.grad
    try:
        return gather_full_state_dict(model, ps)
    finally:
        for p, data in saved.items():
            p.data = data


def _both(rank, world, root, tokens, labels):
    """Every case: megatron-core's and meshlm's logits, loss and full gradients (rank 0's)."""
    import megatron_gpt as mgpt
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from meshlm.checkpoint import megatron as mg
    from meshlm.checkpoint.hf import full_shapes, load_into_chunks
    from meshlm.model.transformer import GPTModel
    from meshlm.parallel.mesh import ParallelState
    out = {}
    for name, (spec, tp, singleton) in CASES.items():
        dtype = torch.float32 if spec.get("num_experts") else torch.float64  # the router wants fp32 params
        parallel_state.destroy_model_parallel()
        ref = mgpt.build(spec, tp, PADDED, SEQ, dtype=dtype)
        folder = mgpt.save(ref, os.path.join(root, name), 1, mgpt.megatron_args(spec, tp, VOCAB, SEQ, PADDED),
                           singleton=singleton)
        logits = gather_from_tensor_model_parallel_region(mgpt.forward(ref, tokens))[..., :VOCAB]
        loss = mgpt.forward(ref, tokens, labels)
        loss.sum().backward()
        # (at EP=2 each rank holds its own experts under local names: gradients compared at EP 1 only)
        grads = mgpt.full_grads(ref, parallel_state.get_tensor_model_parallel_group(), spec, VOCAB) \
            if spec.get("ep", 1) == 1 else None

        ps = ParallelState.build(tp, 1)
        m = _meshlm_config(spec)
        ours = GPTModel(m, ps, VOCAB, seed=1, params_dtype=dtype).eval()
        load_into_chunks([ours], mg.read_full(folder, full_shapes([ours]), m, VOCAB), folder)
        from meshlm.parallel import comm
        our_logits = ours(tokens)
        our_logits = (comm.all_gather(our_logits.contiguous(), ps.tp_group, -1) if tp > 1 else our_logits)[..., :VOCAB]
        our_loss = ours(tokens, labels)
        our_loss.sum().backward()
        our_grads = _meshlm_grads(ours, ps)
        if rank == 0:
            out[name] = {"megatron": (logits.detach(), loss.detach(), grads),
                         "meshlm": (our_logits.detach(), our_loss.detach(), our_grads), "folder": folder}
    parallel_state.destroy_model_parallel()  # Megatron's optimizer state carried over (TP=2 → meshlm)
    ref = mgpt.build(LLAMA, 2, PADDED, SEQ)
    opt = mgpt.adam_step(ref, tokens, labels)
    mgpt.save(ref, os.path.join(root, "llama_adam"), 3, mgpt.megatron_args(LLAMA, 2, VOCAB, SEQ, PADDED), optimizer=opt)
    group = parallel_state.get_tensor_model_parallel_group()
    moments = {kind: mgpt.full_grads(ref, group, LLAMA, VOCAB, of=lambda p: mgpt.adam_state(opt, p, kind))
               for kind in ("exp_avg", "exp_avg_sq")}
    weights = mgpt.full_grads(ref, group, LLAMA, VOCAB, of=lambda p: p.data)
    if rank == 0:
        out["adam"] = {"moments": moments, "weights": weights,
                       "step": int(mgpt.adam_state(opt, next(ref.parameters()), "step"))}
    out.update(_pipeline(rank, root, tokens))
    out.update(_distributed_optimizer(rank, root, tokens, labels))
    trip = _round_trip(rank, root, tokens, labels) if rank == 0 else {}
    torch.distributed.barrier()
    resumed = _resume(root)  # meshlm trains on from the converted Adam checkpoint at TP=2
    if rank == 0:
        out["adam"]["resumed"] = resumed
    for name in ROUND_TRIP:  # megatron-core loads meshlm's export at TP=2
        parallel_state.destroy_model_parallel()
        model = mgpt.build(CASES[name][0], 2, PADDED, SEQ, seed=99)  # other weights until loaded
        mgpt.load(model, os.path.join(root, f"{name}_megatron", "iter_0000001"))
        with torch.no_grad():
            logits = gather_from_tensor_model_parallel_region(mgpt.forward(model, tokens))[..., :VOCAB]
        if rank == 0:
            out[name]["round_trip"] = trip[name] + (logits,)
    parallel_state.destroy_model_parallel()
    return out


def _pipeline(rank, root, tokens) -> dict:
    """Rank 0's {"gpt2_pp2": megatron-core's logits of the GPT-2 checkpoint it saved at PP=2
    (tied embeddings: the last stage holds a copy), computed after loading it at PP=1, and the folder}."""
    from megatron.core import parallel_state
    import megatron_gpt as mgpt
    out = {}
    parallel_state.destroy_model_parallel()
    stage = mgpt.build(GPT2, 1, PADDED, SEQ, dtype=torch.float64, pp=2)
    folder = mgpt.save(stage, os.path.join(root, "gpt2_pp2"), 1, mgpt.megatron_args(GPT2, 1, VOCAB, SEQ, PADDED, pp=2))
    parallel_state.destroy_model_parallel()
    whole = mgpt.build(GPT2, 1, PADDED, SEQ, dtype=torch.float64, seed=99)  # other weights until loaded
    mgpt.load(whole, folder)
    with torch.no_grad():
        out["gpt2_pp2"] = {"logits": mgpt.forward(whole, tokens)[..., :VOCAB], "folder": folder}
    return out if rank == 0 else {}


def _distributed_optimizer(rank, root, tokens, labels) -> dict:
    """megatron-core's distributed optimizer saving its default dp_reshardable format, for rank 0:
    "distopt_dp2": Llama at DP=2 (one sample per DP rank) after one step, saved in both formats
    (and --dist-ckpt-optim-fully-reshardable's: "fully_reshardable"); meshlm imports it and
    trains one step at TP=2, then megatron-core trains one step on the same batch: both full
    weights after it. "distopt_bf16_tp2": Llama in bf16 at TP=2 (fp32 masters in the optimizer),
    its vocabulary of PADDED_VOCAB[0] ids padded to PADDED_VOCAB[1] rows, after one step: its
    weights and every parameter's master and moments (full tensors, the real vocabulary rows)."""
    from unittest import mock

    from megatron.core import parallel_state
    import megatron_gpt as mgpt

    from meshlm.checkpoint import dist as ckpt
    from meshlm.checkpoint.megatron_convert import import_megatron
    out = {}
    parallel_state.destroy_model_parallel()
    ref = mgpt.build(LLAMA, 1, PADDED, SEQ)
    ddp, opt = mgpt.optimizer(ref, distributed=True)
    dp = parallel_state.get_data_parallel_rank()
    mgpt.step(ddp, opt, tokens[dp:dp + 1], labels[dp:dp + 1])
    folder = mgpt.save(ref, os.path.join(root, "llama_distopt"), 1, mgpt.megatron_args(LLAMA, 1, VOCAB, SEQ, PADDED),
                       optimizer=opt, sharding="dp_reshardable")
    full = mgpt.save(ref, os.path.join(root, "llama_distopt_full"), 1,  # --dist-ckpt-optim-fully-reshardable
                     mgpt.megatron_args(LLAMA, 1, VOCAB, SEQ, PADDED), optimizer=opt, sharding="fully_reshardable")
    converted = os.path.join(root, "llama_distopt_meshlm")
    if rank == 0:
        with mock.patch.object(ckpt, "_world", lambda: (0, 1)):
            import_megatron(os.path.dirname(folder), converted)
    torch.distributed.barrier()
    ours, batch = _resume_one_step(converted)
    mgpt.step(ddp, opt, batch[0][dp:dp + 1], batch[1][dp:dp + 1])  # megatron-core on meshlm's batch
    theirs = mgpt.full_grads(ref, parallel_state.get_tensor_model_parallel_group(), LLAMA, VOCAB, of=lambda p: p.data)
    out["distopt_dp2"] = {"meshlm": ours, "megatron": theirs, "folder": folder, "fully_reshardable": full}

    vocab, padded = PADDED_VOCAB
    parallel_state.destroy_model_parallel()
    ref = mgpt.build(LLAMA, 2, padded, SEQ, dtype=torch.bfloat16)
    ddp, opt = mgpt.optimizer(ref, distributed=True)
    mgpt.step(ddp, opt, tokens % vocab, labels % vocab)
    folder = mgpt.save(ref, os.path.join(root, "llama_bf16"), 1, mgpt.megatron_args(LLAMA, 2, vocab, SEQ, padded),
                       optimizer=opt, sharding="dp_reshardable")
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    group = parallel_state.get_tensor_model_parallel_group()
    state = {kind: mgpt.full_grads(ref, group, LLAMA, vocab, of=lambda p: inner._get_main_param_and_optimizer_states(
        p)[kind].view(p.shape)) for kind in ("param", "exp_avg", "exp_avg_sq")}  # DP=1: a shard is the whole param
    state["weights"] = mgpt.full_grads(ref, group, LLAMA, vocab, of=lambda p: p.data)
    out["distopt_bf16_tp2"] = {"state": state, "folder": folder}
    parallel_state.destroy_model_parallel()
    return out if rank == 0 else {}


def _resume_one_step(converted: str) -> tuple:
    """meshlm's training step at TP=2 from the converted checkpoint (mock data, Megatron's
    optimizer flags of megatron_gpt.optimizer: Adam, lr 0.01 constant, weight decay 0.01, no
    clipping): (its full weights after the step, (tokens, labels) [2, SEQ] of the batch)."""
    from meshlm.checkpoint import dist as ckpt
    from meshlm.config import Config
    from meshlm.parallel.tensor import gather_full_state_dict
    from meshlm.training import trainer
    cfg = Config.from_dict(ckpt.read_config(ckpt.checkpoint_dir(converted)))
    cfg.data.mock_data = True
    cfg.parallel.tensor_model_parallel_size = 2
    t = cfg.training
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.log_interval, t.eval_iters = 2, 2, 2, 1, 0
    o = cfg.optimizer
    o.lr, o.lr_decay_style, o.weight_decay, o.clip_grad = 1e-2, "constant", 0.01, 0.0
    cfg.checkpoint.load = converted
    run = trainer.build(cfg)
    try:
        state = trainer.load_checkpoint(run)
        assert state.iteration == 1
        items = [run.train_ds[state.consumed_samples + i] for i in range(2)]
        trainer.train_step(run, state)
        full = gather_full_state_dict(run.chunks[0], run.ps)
    finally:
        run.logger.close()
    return full, (torch.stack([x["tokens"] for x in items]), torch.stack([x["labels"] for x in items]))


def _resume(root: str) -> dict:
    """`meshlm pretrain --load` of the converted Adam checkpoint (iteration 3) at TP=2 for one more
    iteration, on mock data; its summary."""
    from meshlm.checkpoint import dist as ckpt
    from meshlm.config import Config
    from meshlm.training import trainer
    converted = os.path.join(root, "llama_adam_meshlm")
    cfg = Config.from_dict(ckpt.read_config(ckpt.checkpoint_dir(converted)))
    cfg.data.mock_data = True
    cfg.parallel.tensor_model_parallel_size = 2
    t = cfg.training
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.log_interval, t.eval_iters = 2, 2, 4, 1, 0
    cfg.checkpoint.load = converted
    cfg.logging.log_dir = os.path.join(root, "resume_logs")
    return trainer.pretrain(cfg)


def _round_trip(rank, root, tokens, labels) -> dict:
    """Rank 0 alone, as a one-process meshlm would (``convert`` runs in one process): import each
    ROUND_TRIP case, take a training step, save, export. {name: (logits before, after the step)}."""
    from unittest import mock

    from meshlm.checkpoint import dist as ckpt
    from meshlm.checkpoint.megatron_convert import export_megatron, import_megatron
    from meshlm.checkpoint.model_space import ModelSpace
    from meshlm.checkpoint.state import model_state
    from meshlm.parallel.mesh import ParallelState
    from meshlm.training.generate import load_model
    out = {}
    with mock.patch.object(ckpt, "_world", lambda: (0, 1)):
        import_megatron(os.path.join(root, "llama_adam"), os.path.join(root, "llama_adam_meshlm"))
        for name in ROUND_TRIP:
            path = import_megatron(os.path.join(root, name), os.path.join(root, f"{name}_meshlm"))
            model, _ = load_model(path)
            with torch.no_grad():
                before = model(tokens)[..., :VOCAB]
            model.train()
            model(tokens, labels).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            model.eval()
            with torch.no_grad():
                after = model(tokens)[..., :VOCAB]
            trained = os.path.join(root, f"{name}_trained")
            ckpt.save(trained, 1, model_state(ModelSpace([model], ParallelState.single())),
                      config=ckpt.read_config(path), layout={"tp": 1, "pp": 1})
            export_megatron(trained, os.path.join(root, f"{name}_megatron"))
            out[name] = (before, after)
    return out


@pytest.fixture(scope="module")  # one start of two workers for every test here (~15 s)
def mcore(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron"))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return {"root": root, "tokens": tokens, "labels": labels,
            "cases": run_distributed(_both, 2, root, tokens, labels)[0]}


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.slow  # the fixture's start (~15 s) is charged to the first test that asks for it
@pytest.mark.parametrize("name", sorted(CASES))
def test_meshlm_computes_megatron_cores_function(mcore, name):
    """Logits, per-token loss and every gradient of meshlm's model filled from megatron-core's
    checkpoint equal megatron-core's, at the case's TP (float32 rounding where megatron-core
    computes in float32: RoPE, cross-entropy, the MoE router)."""
    case = mcore["cases"][name]
    (logits, loss, grads), (our_logits, our_loss, our_grads) = case["megatron"], case["meshlm"]
    spec = CASES[name][0]
    if spec.get("num_experts") or spec.get("position_embedding_type") == "rope":
        tol = 2e-6  # float32 RoPE frequencies and router
    else:  # float64; megatron-core's fused bias-GeLU rounds sqrt(2/pi) to 0.79788456 (relative 1e-9)
        tol = 1e-12 if spec.get("bias_gelu_fusion") is False else 1e-8
    assert _rel(our_logits, logits) < tol
    assert _rel(our_loss, loss) < 2e-6  # megatron-core's cross-entropy is float32
    if grads is None:  # saved at EP=2, read by meshlm at EP=1: logits and loss only
        return
    assert set(our_grads) == set(grads)
    if CASES[name][1] > 1:
        # megatron-core's raw expert .grad at TP=2 is TP (2) times the loss's gradient. Without sequence
        # parallelism (which needs apex on CPU) every TP rank holds all tokens; the allgather dispatcher
        # gathers them over the TP group anyway, so each rank's expert shard sees every token TP times; the
        # reduce-scatter of the combine keeps the forward right (each rank takes its own copy's sum over TP
        # partials), but its backward, an all-gather, hands each copy the same output gradient, so the expert
        # weight gradients sum TP equal contributions. megatron-core refuses to *train* so (moe_layer.py:
        # "MoE and tensor parallelism ... without also enabling sequence parallelism" in training mode);
        # this forward/backward runs in eval mode. With --sequence-parallel each token is gathered once.
        grads = {k: g / CASES[name][1] if ".local_experts." in k else g for k, g in grads.items()}
    bad = {k: _rel(our_grads[k], g) for k, g in grads.items() if _rel(our_grads[k], g) > max(tol, 1e-5 if
                                                                                            tol > 1e-8 else 1e-7)}
    assert not bad


@pytest.mark.slow
def test_import_gives_megatron_cores_logits(mcore, tmp_path):
    """convert --from-megatron of each saved case gives megatron-core's logits in meshlm's
    one-process model (checkpoints saved at TP 1 and 2 and EP 2, stacked and per-expert layouts)."""
    from meshlm.checkpoint.megatron_convert import import_megatron
    from meshlm.training.generate import load_model
    for name in CASES:
        case = mcore["cases"][name]
        out = str(tmp_path / name)
        path = import_megatron(os.path.dirname(case["folder"]), out)
        model, _ = load_model(path)
        with torch.no_grad():
            logits = model(mcore["tokens"])[..., :VOCAB]
        assert _rel(logits, case["megatron"][0]) < 2e-6, name


@pytest.mark.slow
def test_round_trip_megatron_meshlm_train_step_megatron(mcore):
    """megatron-core save (TP 1 or 2) → convert --from-megatron → a training step in meshlm →
    convert --to-megatron → megatron-core load at TP=2: megatron-core computes meshlm's new logits
    (and meshlm's imported model computed megatron-core's before the step)."""
    for name in ROUND_TRIP:
        case = mcore["cases"][name]
        before, after, loaded = case["round_trip"]
        assert _rel(before, case["megatron"][0]) < 2e-6
        assert _rel(after, before) > 1e-3  # the step changed the function
        assert _rel(loaded, after) < 2e-6, name


@pytest.mark.slow
def test_import_carries_megatrons_adam_state(mcore, tmp_path):
    """A Megatron checkpoint with its optimizer's per-parameter state (saved at TP=2, iteration 3)
    becomes a meshlm training checkpoint at iteration 3: every parameter's Adam moments (QKV and
    SwiGLU layouts converted), fp32 masters = weights (fp32 training) and Adam's step, so
    `meshlm pretrain --load` continues with Megatron's moments."""
    from meshlm.checkpoint import dist as ckpt
    from meshlm.checkpoint.megatron_convert import import_megatron
    adam = mcore["cases"]["adam"]
    resumed = adam["resumed"]  # the converted checkpoint resumed at TP=2: one iteration after the 3rd
    assert resumed["iterations"] == 4 and [x is not None for x in resumed["train_losses"]] == [True]
    import_megatron(os.path.join(mcore["root"], "llama_adam"), str(tmp_path / "ckpt"))
    iteration, tree = ckpt.load(str(tmp_path / "ckpt"))
    assert iteration == 3 and tree["train"]["iteration"] == 3 and tree["optimizer"]["step"] == adam["step"] == 1
    saved, fused = tree["optimizer"]["params"], tree["model_fused"]

    def full(name, kind):
        if name in saved:
            return saved[name][kind]
        return torch.cat([saved[key][kind] for key, _ in fused[name]["parts"]], fused[name]["dim"])
    for kind, want in (("exp_avg", adam["moments"]["exp_avg"]), ("exp_avg_sq", adam["moments"]["exp_avg_sq"]),
                       ("master", adam["weights"])):
        assert set(want) <= set(saved) | set(fused)
        for name, t in want.items():
            assert torch.equal(full(name, kind), t.float()), (kind, name)
    assert any(t.abs().max() > 0 for t in adam["moments"]["exp_avg"].values())


@pytest.mark.slow
def test_import_of_a_pipeline_parallel_checkpoint(mcore, tmp_path):
    """GPT-2 saved by megatron-core at PP=2 (each stage writes its layers at their global offsets
    in the stacked [L, …] tensors; the tied embedding once, from the first stage):
    convert --from-megatron gives the logits megatron-core computes after loading that checkpoint
    at PP=1."""
    from meshlm.checkpoint.megatron_convert import import_megatron
    from meshlm.training.generate import load_model
    case = mcore["cases"]["gpt2_pp2"]
    model, _ = load_model(import_megatron(os.path.dirname(case["folder"]), str(tmp_path / "ckpt")))
    with torch.no_grad():
        assert _rel(model(mcore["tokens"])[..., :VOCAB], case["logits"]) < 2e-6


@pytest.mark.slow
def test_distributed_optimizer_checkpoint_resumes_exactly(mcore):
    """Megatron-LM's default distributed-optimizer checkpoint (dp_reshardable buckets, saved by
    megatron-core's DistributedOptimizer at DP=2 after one step), converted and trained one step
    by meshlm at TP=2, gives the weights megatron-core reaches with its own second step on the
    same batch: to float32 rounding of the step (Adam's moments and step carried over; fresh
    moments would change the step by about its own size)."""
    case = mcore["cases"]["distopt_dp2"]
    ours, theirs = case["meshlm"], case["megatron"]
    assert set(ours) == set(theirs)
    bad = {k: _rel(ours[k], w) for k, w in theirs.items() if _rel(ours[k], w) > 2e-6}
    assert not bad


@pytest.mark.slow
def test_import_of_a_bf16_distributed_optimizer_checkpoint_with_a_padded_vocabulary(mcore, tmp_path):
    """A bf16 run at TP=2 (bf16 params, fp32 masters and moments in the distributed optimizer's
    buckets) of 60 token ids padded to 64 rows (--make-vocab-size-divisible-by 32 × TP 2: the 4
    padding rows on TP rank 1): the converted training checkpoint holds megatron-core's fp32
    masters and both moments of every parameter exactly (QKV and SwiGLU TP shards reassembled,
    the padding rows dropped), its weights are the bf16 params, and Adam's step is 1."""
    from meshlm.checkpoint import dist as ckpt
    from meshlm.checkpoint.megatron_convert import import_megatron
    case = mcore["cases"]["distopt_bf16_tp2"]
    want = case["state"]
    import_megatron(os.path.dirname(case["folder"]), str(tmp_path / "ckpt"))
    iteration, tree = ckpt.load(str(tmp_path / "ckpt"))
    assert iteration == 1 and tree["optimizer"]["step"] == 1
    saved, fused = tree["optimizer"]["params"], tree["model_fused"]

    def full(name, kind, where):
        if name in where:
            return where[name][kind] if kind else where[name]
        parts = [where[key][kind] if kind else where[key] for key, _ in fused[name]["parts"]]
        return torch.cat(parts, fused[name]["dim"])
    vocab, padded = PADDED_VOCAB
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert tree["model"][name].shape[0] == vocab < padded
    for name, weight in want["weights"].items():
        assert weight.dtype == torch.bfloat16
        assert torch.equal(full(name, "", tree["model"]), weight.float()), name
        for kind, state in (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            assert torch.equal(full(name, kind, saved).view(weight.shape), want[state][name]), (kind, name)
    assert any(not torch.equal(m.bfloat16().float(), m) for m in want["param"].values())  # masters ≠ weights


@pytest.mark.slow
def test_both_distributed_optimizer_formats_import_the_same_state(mcore, tmp_path):
    """The same DistributedOptimizer state saved as dp_reshardable buckets (meshlm lays them out
    itself) and as fully_reshardable per-parameter tensors (megatron-core maps them to the model
    itself) converts to the same training checkpoint: every moment, master and the step."""
    from meshlm.checkpoint import dist as ckpt
    from meshlm.checkpoint.megatron_convert import import_megatron
    case = mcore["cases"]["distopt_dp2"]
    trees = []
    for name, folder in (("buckets", case["folder"]), ("model_space", case["fully_reshardable"])):
        import_megatron(os.path.dirname(folder), str(tmp_path / name))
        trees.append(ckpt.load(str(tmp_path / name)))
    (it_a, a), (it_b, b) = trees
    assert it_a == it_b == 1 and a["optimizer"]["step"] == b["optimizer"]["step"] == 1
    assert set(a["optimizer"]["params"]) == set(b["optimizer"]["params"])
    for name, kinds in a["optimizer"]["params"].items():
        for kind, t in kinds.items():
            assert torch.equal(t, b["optimizer"]["params"][name][kind]), (name, kind)


@pytest.mark.slow
def test_buckets_read_in_another_parameter_order_are_refused(mcore, tmp_path, monkeypatch, capsys):
    """Buckets laid out by a parameter order other than the one that wrote them fail the masters'
    check: the import says the optimizer state is not read and why, and writes the weights alone
    (iteration 0, no optimizer state), never moments of the wrong parameters."""
    from meshlm.checkpoint import dist as ckpt, megatron_buckets
    from meshlm.checkpoint.megatron_convert import import_megatron
    te = megatron_buckets.ORDERS["transformer_engine"]  # the local spec wrote them
    monkeypatch.setattr(megatron_buckets, "ORDERS", {"transformer_engine": te})
    import_megatron(os.path.dirname(mcore["cases"]["distopt_dp2"]["folder"]), str(tmp_path / "ckpt"))
    out = capsys.readouterr().out
    assert "the Megatron optimizer state is not read" in out and "transformer_engine: its masters are not" in out
    iteration, tree = ckpt.load(str(tmp_path / "ckpt"))
    assert iteration == 0 and "optimizer" not in tree


@pytest.mark.slow
def test_load_of_a_megatron_folder_says_convert_first(mcore):
    from meshlm.checkpoint.dist import check_loadable
    root = os.path.dirname(mcore["cases"]["gpt2_tp1"]["folder"])
    (problem,) = check_loadable(root)
    assert "Megatron-LM checkpoint" in problem and f"meshlm convert --from-megatron {root}" in problem


def test_common_pt_runs_no_planted_code(tmp_path):
    """common.pt is read without running pickle code: megatron enums and the Namespace load, a
    planted payload is refused before anything is unpickled."""
    from meshlm.checkpoint.megatron_common import read_common
    from meshlm.errors import CheckpointError
    good = tmp_path / "good.pt"
    from megatron.core.enums import ModelType
    torch.save({"args": argparse.Namespace(num_layers=2, model_type=ModelType.encoder_or_decoder,
                                           params_dtype=torch.bfloat16), "iteration": 5}, good)
    common = read_common(str(good))
    assert common["iteration"] == 5 and common["args"].num_layers == 2
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    evil = tmp_path / "evil.pt"
    torch.save({"args": argparse.Namespace(num_layers=2), "x": Payload()}, evil)
    with pytest.raises(CheckpointError, match="refused to load: it would run posix.system"):
        read_common(str(evil))
    assert not marker.exists()


def test_megatron_args_meshlm_cannot_compute_are_refused_in_one_line():
    """A Megatron run whose args name a function meshlm lacks is refused naming the flag; the
    shared flags (Megatron's names) become meshlm's model, --bias-gelu-fusion included."""
    from meshlm.checkpoint.megatron import model_from_args
    from meshlm.errors import CheckpointError
    args = argparse.Namespace(num_layers=2, hidden_size=16, num_attention_heads=4, swiglu=False,
                              bias_gelu_fusion=False, moe_layer_freq=1, qk_layernorm=True, squared_relu=False)
    m = model_from_args(args)
    assert (m.num_layers, m.hidden_size, m.bias_gelu_fusion, m.moe_layer_freq, m.qk_layernorm) == (2, 16, False, "1",
                                                                                                   True)
    args.squared_relu = True
    with pytest.raises(CheckpointError, match=r"trained with --squared-relu \(True\); meshlm's model has no"):
        model_from_args(args)


@pytest.mark.parametrize("arg, value, named", [
    ("use_rope_scaling", True, "--use-rope-scaling (True)"),  # Llama 3.1's RoPE was read as plain RoPE
    ("apply_residual_connection_post_layernorm", True, "--apply-residual-connection-post-layernorm"),
    ("window_size", (8, 0), "--window-size ((8, 0))"), ("softmax_type", "learnable", "--softmax-type"),
    ("moe_router_topk_scaling_factor", 2.5, "--moe-router-topk-scaling-factor (2.5)"),
    ("position_embedding_type", "yarn", "--position-embedding-type yarn"),
    ("normalization", "L2Norm", "--normalization L2Norm")])
def test_megatron_args_that_change_the_function_are_refused_not_dropped(arg, value, named):
    """Each was converted without a word into a model that computes another function."""
    from meshlm.checkpoint.megatron import model_from_args
    from meshlm.errors import CheckpointError
    args = argparse.Namespace(num_layers=2, position_embedding_type="rope", softmax_type="vanilla",
                              moe_router_topk_scaling_factor=1.0, rotary_seq_len_interpolation_factor=None)
    model_from_args(args)  # Megatron's defaults (and its neutral values) convert
    setattr(args, arg, value)
    with pytest.raises(CheckpointError) as e:
        model_from_args(args)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_megatron_run_settings_meshlm_lacks_are_left_out_so_the_converted_config_reads_back():
    """--cp-comm-type a2a / allgather (Megatron's spelling), --moe-router-dtype fp64 went into the
    converted config.json as they were, which every later command (pretrain --load, generate,
    convert --to-hf) then refused to read ("cp-comm-type='allgather' is not one of p2p, all_gather")."""
    from meshlm.checkpoint.megatron import model_from_args
    from meshlm import config as C
    for kind, want in (("a2a", "p2p"), ("allgather", "all_gather"), ("a2a+p2p", "p2p")):
        m = model_from_args(argparse.Namespace(num_layers=2, cp_comm_type=[kind], moe_router_dtype="fp64"))
        assert (m.cp_comm_type, m.moe_router_dtype) == (want, "fp32")
        cfg = C.Config()
        cfg.model = m
        assert C.Config.from_dict(cfg.to_dict()).model == m


def test_norm_flags_are_read_under_megatrons_transformer_config_names_too():
    """Megatron-LM's args generated from TransformerConfig (2026-01 on) hold layernorm_epsilon and
    layernorm_zero_centered_gamma, not norm_epsilon / apply_layernorm_1p: a zero-centred model was
    converted as if w were its norm weights (every norm scaling by about 0), and its epsilon lost."""
    from meshlm.checkpoint.megatron import model_from_args
    from meshlm.checkpoint.megatron_convert import megatron_args
    from meshlm import config as C
    m = model_from_args(argparse.Namespace(num_layers=2, layernorm_epsilon=1e-6, layernorm_zero_centered_gamma=True))
    assert (m.norm_epsilon, m.apply_layernorm_1p) == (1e-6, True)
    assert model_from_args(argparse.Namespace(num_layers=2, norm_epsilon=1e-6)).norm_epsilon == 1e-6  # older names
    cfg = C.Config()
    cfg.model.norm_epsilon, cfg.model.apply_layernorm_1p = 1e-6, True
    args = megatron_args(cfg, 100, 128)  # an export carries both names
    assert (args.layernorm_epsilon, args.layernorm_zero_centered_gamma, args.norm_epsilon) == (1e-6, True, 1e-6)


def test_convert_megatron_flags_are_checked(tmp_path, capsys):
    from meshlm.cli import main
    assert main(["convert", "--from-megatron", str(tmp_path)]) == 2
    assert "--from-megatron needs --save (or --output)" in capsys.readouterr().err
    assert main(["convert", "--from-megatron", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a Megatron-LM checkpoint" in err and len(err.splitlines()) == 1
    assert main(["convert", "--from-megatron", str(tmp_path / "nowhere"), "--output", str(tmp_path / "o")]) == 2
    assert "nowhere: no such directory" in capsys.readouterr().err  # was "not a Megatron-LM checkpoint"
    (tmp_path / "common.pt").write_bytes(b"")
    assert main(["convert", "--from-megatron", str(tmp_path / "common.pt"), "--output", str(tmp_path / "o")]) == 2
    assert "common.pt: a file, not a directory; give the folder" in capsys.readouterr().err  # "no such directory"
    assert main(["convert", "--to-megatron", "--load", str(tmp_path)]) == 2
    assert "--to-megatron needs --load" in capsys.readouterr().err


def test_megatron_tracker_naming_a_missing_iteration_is_named(tmp_path, capsys):
    """A Megatron save folder whose tracker names an iteration it lacks (copied without its newest
    iteration) was called "a meshlm checkpoint already"; now the line names the iterations it holds
    and both ways on, and `pretrain --load` still says to convert it."""
    from meshlm.checkpoint import dist as ckpt
    from meshlm.cli import main
    root = tmp_path / "meg"
    (root / "iter_0000006").mkdir(parents=True)
    (root / "iter_0000006" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (root / "iter_0000006" / "common.pt").write_bytes(b"")
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    assert main(["convert", "--from-megatron", str(root), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "meshlm checkpoint already" not in err, err
    assert "names iteration '7'" in err and f"give the folder {root / 'iter_0000006'} itself" in err
    assert "write 6 into" in err
    problems = ckpt.check_loadable(str(root))
    assert len(problems) == 1 and "convert it first" in problems[0] and "write 6 into" in problems[0]


def test_damaged_megatron_folder_names_from_megatron_not_load(tmp_path):
    """A damaged Megatron iteration read by convert --from-megatron was reported as "--load DIR: …;
    load an earlier iteration", a flag the command has not; the line names --from-megatron."""
    from meshlm.checkpoint.megatron import optimizer_states
    from meshlm.errors import CheckpointError
    folder = tmp_path / "meg" / "iter_0000006"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"\x80\x04truncated")
    with pytest.raises(CheckpointError) as e:
        optimizer_states(str(folder))
    line = str(e.value)
    assert line.startswith(f"--from-megatron {tmp_path / 'meg'}: checkpoint iter_0000006 is damaged"), line
    assert "--load" not in line and "give --from-megatron an earlier iteration's folder" in line
