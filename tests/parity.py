"""The parity harness: train a layout through the production path in float64 and compare it with
one process (DESIGN.md, "Correctness rule").

``train_layout(case)`` runs in every worker: it builds the run exactly as ``meshlm pretrain`` does
(``trainer.build``: process groups, model chunks, DP buffers and buckets, the (distributed)
optimizer, LR schedule, logger) with float64 params, feeds it the synthetic ``MaskedData``
(random tokens, loss masks that differ between samples, one fully masked sample) and calls
``trainer.train_step`` STEPS times. It returns the losses, the grad norms, the MoE routing figures
of each logged step (metrics.jsonl's moe_*: global over ranks, so equal in every layout) and every
parameter as a full (TP=1) float64 tensor under its global name — from every rank, so DP replicas
are checked too.

``reference(case)`` is the same run as one process (every parallel size 1), cached per model.
``assert_parity`` compares them at 1e-10 relative: rounding in float64 stays near 1e-15, a real
fault (a missing reduction, a wrong shard, a stale parameter) lands near 1e-3.

``poison_pending_gathers`` makes ZeRO-1's overlapped parameter all-gathers deterministic race
detectors: until a gather is waited for, the bucket's parameters read NaN.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from distributed import run_distributed

STEPS = 3
TOL = 1e-10
VOCAB, SEQ, GLOBAL_BATCH = 50, 8, 8
EOD = VOCAB - 1  # NullTokenizer's EOD id


@dataclass(frozen=True)
class Case:
    """One layout and the model flags it runs with (every field a meshlm flag's value)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    schedule: str = "auto"
    vpp: Optional[int] = None
    first: Optional[int] = None  # --decoder-first-pipeline-num-layers
    last: Optional[int] = None   # --decoder-last-pipeline-num-layers
    dist_opt: bool = False
    zero: int = 0                # --data-parallel-sharding-strategy as a ZeRO stage (0–3; 1 = dist_opt)
    instances: int = 1           # --num-distributed-optimizer-instances (hybrid sharding)
    outer: str = "no_shard"      # --outer-dp-sharding-strategy
    keep: bool = False           # --torch-fsdp2-no-reshard-after-forward (ZeRO-3 keeps gathered params)
    offload: Optional[float] = None  # --optimizer-cpu-offload with this --optimizer-offload-fraction
    overlap_grad: bool = False
    overlap_param: bool = False
    bucket: Optional[int] = 1    # --ddp-bucket-size: 1 puts every parameter in its own bucket
    tied: bool = True
    pos: str = "learned_absolute"  # --position-embedding-type: learned_absolute or rope
    rotary: float = 1.0            # --rotary-percent (with rope)
    norm: str = "LayerNorm"        # --normalization
    one_p: bool = False            # --apply-layernorm-1p (zero-centred norm weights)
    qk_norm: bool = False          # --qk-layernorm
    qkv_bias: bool = False         # --disable-bias-linear --add-qkv-bias (Qwen2's biases)
    swiglu: bool = False
    groups: Optional[int] = None   # --num-query-groups (GQA)
    recompute: str = "none"        # none, selective, full-uniform-N or full-block-N (RECOMPUTE)
    micro: int = 1               # --micro-batch-size
    layers: int = 4
    fast: str = "off"            # --fast-path: "on" compiles the layers and loss, fused AdamW
    per_token: bool = False      # --calculate-per-token-loss
    packed: bool = False         # --eod-mask-loss --reset-position-ids --reset-attention-mask
    experts: int = 0             # --num-experts (0: dense); the MoE fields below need it
    ep: int = 1                  # --expert-model-parallel-size
    moe: tuple = ()              # other MoE flags: ((config field, value), …)
    cp: int = 1                  # --context-parallel-size
    cp_comm: str = "p2p"         # --cp-comm-type
    masked: tuple = ()           # positions whose loss mask is 0 in every sample (MaskedData)
    batch: int = GLOBAL_BATCH    # --global-batch-size
    mup: tuple = ()              # --use-mup and the --mup-* flags: ((config field, value), …)
    fp8: str = ""                # --fp8-format (emulated on CPU); "" off
    fp8_ends: int = 0            # --first-last-layers-bf16 with this many layers at each end (0: off)
    fp8_gather: bool = False     # --fp8-param-gather (its reference: one process with it, ZeRO-1)
    fp8_recipe: str = "tensorwise"  # --fp8-recipe
    fp8_history: int = 1         # --fp8-amax-history-len (delayed)
    fp8_algo: str = "most_recent"  # --fp8-amax-compute-algo (delayed)
    hidden_dropout: float = 0.0  # --hidden-dropout (masks keyed by position: layout-free but for DP)
    attention_dropout: float = 0.0  # --attention-dropout (per head)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def model_key(self) -> tuple:
        """What the single-process reference depends on."""
        return (self.tied, self.pos, self.rotary, self.norm, self.one_p, self.qk_norm, self.qkv_bias, self.swiglu, self.groups, self.micro,
                self.layers, self.per_token, self.packed, self.experts, self.moe, self.masked, self.batch, self.mup,
                self.fp8, self.fp8_ends, self.fp8_gather, self.fp8_recipe, self.fp8_history, self.fp8_algo,
                self.hidden_dropout, self.attention_dropout)

    def __str__(self) -> str:
        default = Case()
        return "-".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) != getattr(default, f.name)) or "single"


def config(case: Case, global_batch: Optional[int] = None):
    """The Config that ``meshlm pretrain`` would build from the case's flags (validated)."""
    from meshlm.config import Config
    from meshlm.validate import validate

    cfg = Config()
    m, p, t, o = cfg.model, cfg.parallel, cfg.training, cfg.optimizer
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = case.layers, 16, 4, SEQ
    m.vocab_size, m.make_vocab_size_divisible_by = VOCAB, 4
    m.hidden_dropout, m.attention_dropout = case.hidden_dropout, case.attention_dropout
    m.untie_embeddings_and_output_weights = not case.tied
    m.normalization, m.position_embedding_type, m.swiglu = case.norm, case.pos, case.swiglu
    m.rotary_percent, m.apply_layernorm_1p = case.rotary, case.one_p
    m.qk_layernorm, m.add_qkv_bias, m.add_bias_linear = case.qk_norm, case.qkv_bias, not case.qkv_bias
    if case.swiglu:
        m.ffn_hidden_size = 24
    if case.groups:
        m.group_query_attention, m.num_query_groups = True, case.groups
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = case.tp, case.pp
    p.context_parallel_size, m.cp_comm_type = case.cp, case.cp_comm
    p.sequence_parallel, p.pipeline_schedule = case.sp, case.schedule
    p.virtual_pipeline_model_parallel_size = case.vpp
    p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers = case.first, case.last
    p.use_distributed_optimizer, p.ddp_bucket_size = case.dist_opt, case.bucket
    p.data_parallel_sharding_strategy = ("no_shard", "optim", "optim_grads", "optim_grads_params")[case.zero]
    p.num_distributed_optimizer_instances, p.outer_dp_sharding_strategy = case.instances, case.outer
    p.torch_fsdp2_no_reshard_after_forward = case.keep
    if case.offload is not None:
        o.optimizer_cpu_offload, o.optimizer_offload_fraction = True, case.offload
    p.overlap_grad_reduce, p.overlap_param_gather = case.overlap_grad, case.overlap_param
    t.micro_batch_size, t.global_batch_size, t.train_iters = case.micro, global_batch or case.batch, STEPS
    t.fast_path = case.fast
    t.recompute_activations = case.recompute == "selective"
    if case.recompute.startswith("full"):
        _, t.recompute_method, n = case.recompute.split("-")
        t.recompute_granularity, t.recompute_num_layers = "full", int(n)
    t.log_interval, t.eval_interval = 1, 1000
    t.calculate_per_token_loss = case.per_token
    cfg.data.eod_mask_loss = cfg.data.reset_position_ids = cfg.data.reset_attention_mask = case.packed
    # the batches are built in the rank itself (--num-workers 0): forking loader workers cost each rank
    # ~0.3 CPU-s a case, and which process reads a batch is tests/test_data_loader.py's subject, not parity's
    cfg.data.num_workers = 0
    if case.experts:
        m.num_experts, m.moe_ffn_hidden_size, p.expert_model_parallel_size = case.experts, 12, case.ep
        for name, value in case.moe:
            setattr(m, name, value)
    for name, value in case.mup:
        setattr(m, name, value)
    t.fp8_format = case.fp8 or None
    t.fp8_param_gather = case.fp8_gather
    t.fp8_recipe, t.fp8_amax_history_len, t.fp8_amax_compute_algo = case.fp8_recipe, case.fp8_history, case.fp8_algo
    if case.fp8_ends:
        t.first_last_layers_bf16, t.num_layers_at_start_in_bf16 = True, case.fp8_ends
        t.num_layers_at_end_in_bf16 = case.fp8_ends
    cfg.data.mock_data, cfg.data.split = True, "1,0,0"
    o.lr, o.min_lr, o.lr_warmup_iters, o.clip_grad = 1e-2, 1e-3, 1, 0.5
    validate(cfg, world=case.world, check_files=False)
    return cfg


class MaskedData:
    """``batch`` × STEPS samples of random ids with EOD (VOCAB − 1) tokens inside; each sample
    masks a different random subset of its tokens, and sample 3 is fully masked (its micro-batch
    adds zero loss); positions in ``masked`` are masked in every sample. ``packing``
    (data/packing.py) adds EOD masking, position and document ids."""

    def __init__(self, packing=None, masked: tuple = (), batch: int = GLOBAL_BATCH):
        self.packing, self.masked, self.batch = packing, list(masked), batch

    def __len__(self) -> int:
        return self.batch * STEPS

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng([7, i])
        ids = torch.from_numpy(np.where(rng.random(SEQ + 1) < 0.25, EOD, rng.integers(0, VOCAB, SEQ + 1)))
        mask = torch.from_numpy((rng.random(SEQ) < 0.7).astype(np.float32))
        if i == 3:
            mask.zero_()
        mask[self.masked] = 0
        item = {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": mask}
        return self.packing.apply(item) if self.packing else item


def poison_pending_gathers(opt) -> None:
    """Defer every asynchronous parameter all-gather of a DistributedOptimizer to its wait(), and
    fill the bucket with NaN until then (an FP8 copy with 0x7F, NaN in E4M3 and E5M2): a parameter
    read before its gather is waited for is NaN, so a race shows as a NaN loss or a parity failure
    on every run, not by chance."""
    original = opt._gather

    class Deferred:
        def __init__(self, full, shard, kw):
            self.full, self.shard, self.kw = full, shard.clone(), kw
            full.fill_(0x7F if full.dtype == torch.uint8 else float("nan"))

        def wait(self):
            original(self.full, self.shard, async_op=False, **self.kw)

    opt._gather = lambda full, shard, async_op, **kw: (Deferred(full, shard, kw) if async_op
                                                       else original(full, shard, async_op=False, **kw))


def _full_params(run) -> dict:
    """{global name: full float64 CPU tensor} of this rank's chunks (collective over TP)."""
    from meshlm.parallel.tensor import gather_full_state_dict

    out = {}
    for chunk in run.chunks:
        for name, t in gather_full_state_dict(chunk, run.ps).items():
            if name == "output_layer.weight" and not run.cfg.model.untie_embeddings_and_output_weights:
                name = "embedding.word_embeddings.weight (last stage copy)"
            out[name] = t
    return out


def train_layout(case: Case, poison: bool = True) -> dict:
    """Train ``case`` for STEPS steps in this worker; {"losses", "norms", "params"} (see module doc).

    Runs on the worker's device (CPU over gloo; its GPU over NCCL), always in float64."""
    from meshlm.data.packing import Packing
    from meshlm.training import trainer

    cfg = config(case)
    run = trainer.build(cfg, dtype=torch.float64)
    run.train_ds = MaskedData(Packing.of(cfg.data, EOD), case.masked, case.batch)
    if poison and case.overlap_param and run.ps.dp > 1:
        poison_pending_gathers(run.opt)
    norms, step = [], run.opt.step

    def recording_step(*args, **kw):
        result = step(*args, **kw)
        norms.append(result.resolve().grad_norm)
        return result

    run.opt.step = recording_step
    records, log = [], run.logger.train_step
    run.logger.train_step = lambda *a, **k: (lambda rec: (records.append(rec), rec)[1])(log(*a, **k))
    state = trainer.TrainState()
    losses = [trainer.train_step(run, state) for _ in range(STEPS)]
    run.opt.finish_param_sync()
    moe = [_flat({k: v for k, v in rec.items() if k.startswith("moe_")}) for rec in records if rec]
    return {"losses": losses, "norms": norms, "params": _full_params(run), "moe": moe,
            "fp8_pushes": [st.steps for st in run.fp8_states]}


def _flat(d: dict, prefix: str = "") -> dict:
    """{"a.b": number} of nested dicts of numbers (None kept)."""
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _worker(rank: int, world: int, cases: list, poison: bool) -> list:
    """train_layout of each case in turn (one process start for several cases)."""
    out = []
    for case in cases:
        try:
            out.append(train_layout(case, poison))
        except Exception as e:
            raise RuntimeError(f"{case}: {e}") from e
    return out


_REFERENCES: dict = {}


def _single(case: Case) -> Case:
    return Case(tied=case.tied, pos=case.pos, rotary=case.rotary, norm=case.norm, one_p=case.one_p,
                qk_norm=case.qk_norm, qkv_bias=case.qkv_bias, swiglu=case.swiglu,
                groups=case.groups, micro=case.micro, layers=case.layers, per_token=case.per_token,
                packed=case.packed, experts=case.experts, moe=case.moe, masked=case.masked, batch=case.batch,
                mup=case.mup, fp8=case.fp8, fp8_ends=case.fp8_ends, fp8_gather=case.fp8_gather,
                dist_opt=case.fp8_gather, fp8_recipe=case.fp8_recipe, fp8_history=case.fp8_history,
                fp8_algo=case.fp8_algo, hidden_dropout=case.hidden_dropout, attention_dropout=case.attention_dropout)


def references(cases: list) -> list:
    """The single-process run of each case's model (computed in one process, cached per model)."""
    todo = list({c.model_key(): _single(c) for c in cases if c.model_key() not in _REFERENCES}.values())
    if todo:
        (runs,) = run_distributed(_worker, 1, todo, False)
        _REFERENCES.update({c.model_key(): r for c, r in zip(todo, runs)})
    return [_REFERENCES[c.model_key()] for c in cases]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ over the whole tensor."""
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def run_layouts(cases: list, poison: bool = True) -> list:
    """For each case (all of one world size), every rank's result of training it (see train_layout)."""
    per_rank = run_distributed(_worker, cases[0].world, cases, poison)
    return [list(results) for results in zip(*per_rank)]


def parity_errors(case: Case, results: list, ref: dict) -> list:
    """Lines naming each loss, grad norm or parameter that differs from ``ref`` by more than TOL."""
    bad = []
    for rank, r in enumerate(results):
        for what in ("losses", "norms"):
            for i, (a, b) in enumerate(zip(r[what], ref[what])):
                if a is None or abs(a - b) > TOL * abs(b):
                    bad.append(f"rank {rank} step {i + 1} {what[:-1]}: {a} vs {b}")
        for i, (got, want) in enumerate(zip(r["moe"], ref["moe"])):  # routing figures (MoE metrics)
            bad += [f"rank {rank} step {i + 1} {k}: {got.get(k)} vs {v}" for k, v in want.items()
                    if (got.get(k) is None) != (v is None) or (v is not None and abs(got[k] - v) > TOL * abs(v))]
        for name, t in r["params"].items():
            want = ref["params"][name.split(" (")[0]]
            err = rel_err(t, want)
            if not err <= TOL:
                bad.append(f"rank {rank} {name}: relative error {err:.2e}")
    return bad


def assert_parity(*cases: Case, poison: bool = True) -> None:
    """Train each case (all of one world size, in one set of processes) and its single-process
    reference; fail naming every loss, norm or parameter that differs by more than TOL."""
    assert len({c.world for c in cases}) == 1, "cases of one call share a world size"
    refs = references(list(cases))
    report = []
    for case, results, ref in zip(cases, run_layouts(list(cases), poison), refs):
        assert max(ref["norms"]) > 0.5, "clipping (--clip-grad 0.5) must be active in the reference"
        covered = {n.split(" (")[0] for r in results for n in r["params"]}
        bad = [f"parameters missing: {sorted(set(ref['params']) - covered)}"] if covered != set(ref["params"]) else []
        bad += parity_errors(case, results, ref)
        if case.fp8_recipe == "delayed":  # the trainer pushed every step into every FP8 linear's history
            bad += [f"FP8 histories pushed {r['fp8_pushes']} times, not {STEPS}" for r in [ref, *results]
                    if not r["fp8_pushes"] or set(r["fp8_pushes"]) != {STEPS}]
        report += [f"{case}:"] + bad[:20] if bad else []
    assert not report, "\n".join(report)
