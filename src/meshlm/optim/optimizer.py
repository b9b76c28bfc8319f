"""Mixed-precision AdamW on fp32 master weights, with loss scaling and global-norm clipping.

The optimizer works on *shards*: contiguous ranges of the DDP buffers (``parallel/data.py``).
Under plain DP a shard is a whole bucket; under ZeRO-1 (``optim/distributed.py``) it is this
rank's 1/DP of the bucket. Each shard holds fp32 ``master`` weights (the params themselves in
fp32 training, else an fp32 copy of the bf16/fp16 params) and the Adam moments ``exp_avg`` and
``exp_avg_sq``, all flat [n] fp32 tensors (the moments bf16 under --use-precision-aware-optimizer with
--exp-avg-dtype / --exp-avg-sq-dtype bf16: optim/adamw.py), so the update runs a few large kernels per
bucket.

One ``step()`` (Megatron's order):
  1. fp16 only (loss scale ≠ 1): unscale the main_grads by 1/loss_scale and look for inf/NaN,
     reduced (MAX) over the model-parallel and DP × CP groups so every rank decides alike;
  2. global gradient norm: squares summed over this rank's grads with each parameter counted
     once (TP-replicated params on tp_rank 0 only; the last stage's copy of a tied embedding not
     counted when PP > 1; under ZeRO-1 each rank's shard), all-reduced over TP × PP (and DP × CP
     under ZeRO-1), MoE experts' squares first summed over EP (each EP rank holds other experts;
     under ZeRO-1 the DP × CP reduction covers that). With loss scale 1 (bf16/fp32) the norm is the inf/NaN check: a non-finite
     grad anywhere makes it non-finite on every rank, so the step needs this one host sync;
  3. on inf/NaN: skip the update and back off the loss scale (fp16); under bf16/fp32 there is
     nothing to back off, so ``ok`` is False and the trainer stops with a message naming the
     iteration and the last checkpoint, unless ``--skip-nan-steps``;
  4. clipping by clip_grad / (norm + 1e-6) when that is below 1, and AdamW (optim/adamw.py,
     torch.optim.AdamW's arithmetic; no weight decay on params marked ``no_weight_decay``, the LR
     times ``lr_mult`` on params that carry one: μP's hidden matrices, meshlm/mup.py) over
     the fragments of every shard. On the fast path (meshlm/fast.py) fused kernels do both (the
     clip coefficient enters as their grad scale): on CUDA, one compiled element-wise kernel a
     run of at least ``FLAT_MIN`` elements (a shard's consecutive fragments of one decay and
     lr_mult; all runs in one compiled call: optim/adamw.py ``flat_adamw_``), which also writes
     the new params, and torch's
     multi-tensor kernel for the smaller runs together; otherwise
     the grads are scaled in place first and foreach kernels update;
  5. masters copied back to the model params (but for the runs the flat kernel wrote), and
     all-gathered under ZeRO-1.

Under --optimizer-cpu-offload the first shards, up to --optimizer-offload-fraction of the
elements, keep their fp32 master and moments in host memory (12 bytes an element, nothing else
whole: optim/offload.py): their grads come to the host after clipping a bounded batch at a time,
one fused CPU AdamW pass updates each batch there, and the step copies the masters back into the
device params through the same bounded staging (the ZeRO-Offload split, Ren et al. 2021 §4). The
norm and the inf check stay on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import fast
from ..dtypes import HALF, wide
from ..host_read import start_read
from ..parallel import watchdog
from .adamw import Group, Run, adamw_, flat_adamw_, flat_steps
from .offload import Staging, host_update
from .scaler import build_scaler
from .schedule import scheduler_for


MOMENT_DTYPES = {"bf16": torch.bfloat16}  # --exp-avg(-sq)-dtype's narrow choices; fp32: the master's dtype
FLAT_MIN = 1 << 20  # elements: smaller runs go to the multi-tensor kernel (``_flat_update``)


def _squares(views: list) -> torch.Tensor:
    """Σ v² over the views as float64 (bf16 ones summed in fp32, as the fp32 buckets' would be): a
    bucket-sized view by one reduction kernel, the small ones by the multi-tensor norm, which launches
    once per ~21 M elements (320 chunks of 65,536) and read bf16 at ~2.4 TB/s on the H200 (issue 31)."""
    wide32 = {"dtype": torch.float32} if any(v.dtype in HALF for v in views) else {}
    big = [torch.linalg.vector_norm(v, 2, **wide32) for v in views if v.numel() >= FLAT_MIN]
    small = [v for v in views if v.numel() < FLAT_MIN]
    return torch.stack(big + (list(torch._foreach_norm(small, 2, **wide32)) if small else [])).double().pow(2).sum()


def _zeros(views: list) -> torch.Tensor:
    """The number of zero elements of the views, as float64."""
    return torch.stack([(v == 0).sum() for v in views]).double().sum()


class DeferredStep:
    """An optimizer step launched without its host sync (``step(defer=True)``); ``resolve()``
    reads its grad norm (waiting only for the norm's copy, not the update) → StepResult."""

    def __init__(self, read_norm):
        self._read_norm, self._result = read_norm, None

    def resolve(self) -> "StepResult":
        """The StepResult (read once; later calls return it again)."""
        if self._result is None:
            norm = self._read_norm()
            self._result = StepResult(ok=True, grad_norm=norm, loss_scale=1.0, skipped=False) \
                if math.isfinite(norm) else StepResult(ok=False, grad_norm=0.0, loss_scale=1.0, skipped=True,
                                                       found_inf=True)
        return self._result


@dataclass
class StepResult:
    """Outcome of one optimizer step.

    ok: False when the run should not go on: inf/NaN gradients under bf16/fp32, or under fp16
        with the loss scale already at --min-loss-scale. The trainer stops (naming the iteration
        and last checkpoint) unless --skip-nan-steps.
    grad_norm: global L2 norm of the unscaled gradients before clipping (0.0 when skipped).
    loss_scale: the scale the step's backward used (1.0 unless fp16).
    skipped: the update was not applied. found_inf: some gradient was inf/NaN.
    """

    ok: bool
    grad_norm: float
    loss_scale: float
    skipped: bool
    found_inf: bool = False

    def resolve(self) -> "StepResult":
        """Itself (a DeferredStep's ``resolve`` gives one)."""
        return self


def param_names(chunks) -> dict:
    """param → name: the name in its chunk, prefixed ``chunk{i}.`` only if names clash across chunks."""
    per_chunk = [dict((p, n) for n, p in c.named_parameters()) for c in chunks]
    flat = [n for names in per_chunk for n in names.values()]
    clash = len(flat) != len(set(flat))
    return {p: (f"chunk{i}.{n}" if clash else n) for i, names in enumerate(per_chunk) for p, n in names.items()}


def counts_in_norm(p: torch.Tensor, ps) -> bool:
    """Whether this rank's copy of p enters the global grad norm (each param counted once; MoE
    experts are whole on every TP rank)."""
    replicated = not getattr(p, "tensor_model_parallel", False) or getattr(p, "expert", False)
    if replicated and ps.tp_rank != 0:
        return False
    return not (getattr(p, "shared_embedding", False) and ps.pp > 1 and not ps.is_first_stage)


@dataclass
class Fragment:
    """Elements [lo, hi) of a shard are elements [p_lo, p_lo + hi - lo) of flattened param p."""

    param: torch.Tensor
    name: str
    lo: int
    hi: int
    p_lo: int
    decay: bool
    counted: bool
    lr_mult: float = 1.0
    decoupled: bool = False  # its LR is --decoupled-lr's (the word embedding, the output layer)


class Shard:
    """This rank's range [start, end) of one bucket with its fp32 master and Adam moments, [n]; on
    the host (``host``: --optimizer-cpu-offload) or beside the params."""

    def __init__(self, buf, bucket, start: int, end: int, names: dict, ps, staging: Optional[Staging] = None,
                 moments: tuple = ("fp32", "fp32"), decoupled: bool = False):
        """staging: the optimizer's host staging when this shard lives on the host, else None;
        moments: (--exp-avg-dtype, --exp-avg-sq-dtype): "fp32" keeps a moment in the master's dtype,
        "bf16" in bf16 (optim/adamw.py); decoupled: --decoupled-lr is given, so the word embedding's
        and output layer's fragments (``embedding_or_output``, model/transformer.py) take its LR."""
        self.buf, self.bucket, self.start, self.end, self.host = buf, bucket, start, end, staging is not None
        self.param = buf.param_of(bucket, start, end)
        self.separate_master = self.param.dtype in HALF or self.host
        dtype, n = wide(self.param.dtype), end - start
        if self.host:  # exact sizes, pageable, filled through the bounded staging (optim/offload.py)
            self.master = torch.empty(n, dtype=dtype)
            staging.to_host(self.master, self.param)
        else:
            self.master = self.param.to(dtype) if self.separate_master else self.param
        self.exp_avg, self.exp_avg_sq = (torch.zeros_like(self.master, dtype=MOMENT_DTYPES.get(name, dtype))
                                         for name in moments)
        self.fragments = []
        # the grad norm takes the shard's grad whole when every fragment counts (the rest of it is zero padding)
        self.whole_norm = all(counts_in_norm(p, ps) for p in bucket.params)
        for p in bucket.params:
            s, e = buf.index[p]
            lo, hi = max(s, start), min(e, end)
            if lo < hi:
                self.fragments.append(Fragment(p, names[p], lo - start, hi - start, lo - s,
                                               not getattr(p, "no_weight_decay", False),
                                               counts_in_norm(p, ps), getattr(p, "lr_mult", 1.0),
                                               decoupled and getattr(p, "embedding_or_output", False)))

    @property
    def grad(self) -> torch.Tensor:
        """[n] view of this range of the bucket's reduced main_grad (allocated during every
        backward; under ZeRO-2/3 the bucket's shard_grad)."""
        return self.buf.owned_grad(self.start, self.end, self.bucket)

    def tensors(self) -> dict:
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


class MixedPrecisionOptimizer:
    """AdamW on fp32 masters for plain data parallelism (every DP rank holds the full state).

    Built by ``build_optimizer`` (optim/distributed.py); see the module docstring for one step. ``lr`` is set by the
    scheduler through ``set_lr``; it starts at the schedule's value for iteration 0.
    """

    def __init__(self, cfg, ps, chunks, ddp):
        o = cfg.optimizer
        self.ps, self.ddp = ps, ddp
        self.weight_decay, self.clip_grad = o.weight_decay, o.clip_grad
        self.betas, self.eps = (o.adam_beta1, o.adam_beta2), o.adam_eps
        self.scaler = build_scaler(cfg.training)
        schedule = scheduler_for(cfg, ps.world_size)
        self.lr, self.decoupled_lr = schedule.lr, schedule.decoupled_lr
        self.step_count = 0
        self.norm_groups = [ps.mp_group]
        self.inf_groups = [ps.mp_group, ddp.group]
        self.names = param_names(chunks)
        ranges = [(buf, b, *self._shard_range(buf, b)) for buf in ddp.buffers for b in buf.buckets]
        total, room = sum(e - s for _, _, s, e in ranges), 0.0
        if o.optimizer_cpu_offload:
            room = o.optimizer_offload_fraction * total
        on_host = []
        for _, _, s, e in ranges:  # whole shards from the first, while within the fraction
            on_host.append(e - s <= room)
            room -= (e - s) if on_host[-1] else room
        self.staging = Staging(ps.device, sum(e - s for (_, _, s, e), h in zip(ranges, on_host) if h))
        moments = (o.exp_avg_dtype, o.exp_avg_sq_dtype)
        self.shards = [Shard(buf, b, s, e, self.names, ps, self.staging if host else None, moments,
                             o.decoupled_lr is not None)
                       for (buf, b, s, e), host in zip(ranges, on_host)]
        self.expert_norm_groups = [ps.ep_group] if any(buf.expert for buf in ddp.buffers) else []  # see grad_norm
        self.fused = fast.enabled(cfg.training.fast_path, ps.device)
        # fused on CUDA with fp32 masters: one compiled element-wise kernel a run, publishing too
        self.flat = (self.fused and ps.device.type == "cuda"
                     and all(s.master.dtype == torch.float32 for s in self.shards if not s.host))
        self._kernel = None  # flat_steps compiled, on first use
        self._runs = None  # [(Run, shard index, lo, hi)] of the device shards, built on first use
        self._published: set = set()  # shards whose params this step's flat update already wrote
        self._small: list = []  # this step's small runs as multi-tensor Groups (``_flat_prepare``)
        self._groups = None  # [(adamw Group, [(shard index, lo, hi)] of its grads, on the host)], built on first use
        self.host_batches = 0  # host AdamW batches in the last step (optim/offload.py)
        self.log_zeros, self._zeros = cfg.logging.log_num_zeros_in_grad, None  # --log-num-zeros-in-grad

    def _shard_range(self, buf, bucket) -> tuple:
        return bucket.start, bucket.end

    # ------------------------------------------------------------------ public API
    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 unless --fp16)."""
        return self.scaler.scale

    def set_lr(self, lr: float, decoupled_lr: Optional[float] = None) -> None:
        """The next step's LR, and --decoupled-lr's (the word embedding's and output layer's)."""
        self.lr = float(lr)
        self.decoupled_lr = None if decoupled_lr is None else float(decoupled_lr)

    @property
    def can_defer(self) -> bool:
        """Whether ``step(defer=True)`` is allowed: no loss scale (bf16/fp32: a non-finite step
        stops the run, so nothing on the host waits for the verdict) and no host shards."""
        return not self.scaler.dynamic and self.scaler.scale == 1.0 and not any(s.host for s in self.shards)

    @property
    def _clip_in_kernel(self) -> bool:
        """Whether the clip enters the fused kernels as their grad scale: they take it in fp32 only, so
        for fp32 masters, where that rounding is the masters' own; float64 masters get an exact
        float64 multiply of the grads instead."""
        return self.fused and all(s.master.dtype == torch.float32 for s in self.shards)

    def step(self, loss: Optional[torch.Tensor] = None, defer: bool = False):
        """Unscale, check inf/NaN, clip, AdamW, publish the new params. Collective over all ranks.

        Call after ``ddp.finish_grad_sync()``. loss: the step's loss, already the same on every rank
        (a tensor on the device); a NaN/inf loss skips the step like NaN/inf gradients, decided in
        the grad norm's host sync, so checking it costs no sync of its own.

        Returns a StepResult, or with ``defer`` (only where ``can_defer``) a DeferredStep at once:
        the clip coefficient is computed on the device and the update launched without the host
        reading the norm, whose ``resolve()`` gives the StepResult later (the trainer's next step),
        so the host goes on queuing work while the GPU runs this step's backward and update. A
        non-finite deferred step is applied (NaN params) and resolves not ``ok``: the run stops.
        Raises ValueError for ``defer`` where not ``can_defer``.
        """
        if defer and not self.can_defer:
            raise ValueError("a deferred optimizer step needs no loss scale and no host shards")
        self._before_step()
        # views when dtypes match; the flat update widens bf16 grads (ddp.half_grads) as it reads them
        grads = [s.grad if self.flat else s.grad.to(s.master.dtype) for s in self.shards]
        if self.flat:
            self._flat_prepare(grads)
        if defer:
            return self._deferred_step(grads, loss)
        scale = self.scaler.scale
        found_inf = scale != 1.0 and self._unscale_and_check(grads, 1.0 / scale)
        norm = 0.0 if found_inf else self.grad_norm(grads, loss)
        self._count_zeros(grads)
        if found_inf or not math.isfinite(norm):
            self._drop_run_grads()
            ok = self.scaler.dynamic and scale > self.scaler.min_scale
            self.scaler.update(True)
            return StepResult(ok=ok, grad_norm=0.0, loss_scale=scale, skipped=True, found_inf=True)
        coeff = self.clip_grad / (norm + 1e-6) if self.clip_grad > 0 else 1.0
        grad_scale = 1.0
        if coeff < 1.0:
            if self._clip_in_kernel:
                grad_scale = 1.0 / coeff
            else:
                torch._foreach_mul_(grads, coeff)
        self._adamw(grads, grad_scale)
        self._publish()
        self.scaler.update(False)
        return StepResult(ok=True, grad_norm=norm, loss_scale=scale, skipped=False)

    def _deferred_step(self, grads: list, loss: Optional[torch.Tensor]) -> "DeferredStep":
        """``step`` with the norm left on the device: the clip coefficient min(1, clip / (norm +
        1e-6)) as a 0-dim tensor (1 where the norm is not finite, so a failed step's grads stay as
        they were for the NaN origin's check), folded into the fused kernels' grad scale or
        multiplied into the grads, as ``step`` does with the float."""
        norm = self._norm_tensor(grads, loss)
        self._count_zeros(grads)
        pending = DeferredStep(start_read(norm))  # copied before the update: its read waits for none of it
        grad_scale = 1.0
        if self.clip_grad > 0:
            coeff = torch.where(torch.isfinite(norm), (self.clip_grad / (norm + 1e-6)).clamp_max(1.0), 1.0)
            if self._clip_in_kernel:
                grad_scale = (1.0 / coeff).to(torch.float32)
            else:
                torch._foreach_mul_(grads, coeff)
        self._adamw(grads, grad_scale)
        self._publish()
        return pending

    def finish_param_sync(self) -> None:
        """Wait for parameter all-gathers still in flight (ZeRO-1 with --overlap-param-gather)."""

    def settle_params(self) -> None:
        """Leave no parameter all-gather in flight and the weights current for forwards outside a
        step (the end of training: its last evaluation), holding no more than they need:
        ``finish_param_sync`` here; the distributed optimizer's ZeRO-3 frees its buckets instead of
        making them all whole (each block gathers its own when it runs)."""
        self.finish_param_sync()

    def _before_step(self) -> None:
        """What ``step`` settles first (the distributed optimizer's gathers)."""
        self.finish_param_sync()

    # ------------------------------------------------------------------ step parts
    def _all_reduce(self, t: torch.Tensor, groups, op, what: str) -> None:
        for g in groups:
            if g is not None:
                watchdog.call(f"all_reduce of the {what}", g, dist.all_reduce, t, op=op, group=g)

    def _unscale_and_check(self, grads: list, inv_scale: float) -> bool:
        """Multiply grads by inv_scale in place; True if any grad on any rank is inf/NaN."""
        device = self.ps.device
        found = torch.zeros(1, device=device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), inv_scale, device=device))
        self._all_reduce(found, self.inf_groups, dist.ReduceOp.MAX, "inf/NaN flag")
        return bool(found.item() > 0)

    def grad_norm(self, grads: list, loss: Optional[torch.Tensor] = None) -> float:
        """Global L2 norm of the gradients (see counts_in_norm), reduced over ``norm_groups``;
        NaN when ``loss`` (a tensor, optional) is NaN or inf (0 · loss enters the sum). A host sync."""
        return float(self._norm_tensor(grads, loss).item())

    def _norm_tensor(self, grads: list, loss: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``grad_norm`` as a 0-dim float64 device tensor (no host sync)."""
        return self._counted_sum(grads, _squares, "squared grad norm", loss).sqrt().reshape(())

    def _counted_sum(self, tensors: list, measure, what: str, loss: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Σ measure(views) over every parameter counted once (``counts_in_norm``), over all ranks,
        as a float64 device tensor [1] (no host sync). tensors: one [n] per shard (its grads, its
        masters); measure(views) → float64 0-dim sum over the views (each on their own device: the
        host shards' masters on the host). The experts' sum is reduced over their groups first."""
        def part(expert: bool) -> torch.Tensor:
            views = [v for s, t in zip(self.shards, tensors) if s.buf.expert == expert
                     for v in ([t] if s.whole_norm else [t[f.lo:f.hi] for f in s.fragments if f.counted])]
            total = torch.zeros(1, dtype=torch.float64, device=self.ps.device)
            for device in dict.fromkeys(v.device for v in views):
                total += measure([v for v in views if v.device == device]).to(total.device)
            return total

        total, experts = part(False), part(True)
        self._all_reduce(experts, self.expert_norm_groups, dist.ReduceOp.SUM, f"{what} of the experts")
        total += experts
        if loss is not None:
            total += 0.0 * loss.to(total.device, torch.float64).reshape(-1)[:1]
        self._all_reduce(total, self.norm_groups, dist.ReduceOp.SUM, what)
        return total

    def params_norm(self) -> float:
        """Global L2 norm of the fp32 master weights, each parameter counted once as in the grad
        norm (Megatron-LM's --log-params-norm, "params norm"). Collective over every rank; a host
        sync: the trainer asks for it on log iterations only."""
        return float(self._counted_sum([s.master for s in self.shards], _squares, "squared params norm").sqrt())

    def _count_zeros(self, grads: list) -> None:
        """Under --log-num-zeros-in-grad (``log_zeros``) keep the number of zero elements of this
        step's gradients, each parameter counted once, as a device tensor (``zeros_in_grad`` reads it)."""
        if self.log_zeros:
            self._zeros = self._counted_sum(grads, _zeros, "zeros in the grads")

    def zeros_in_grad(self) -> Optional[int]:
        """Zero elements of the last step's gradients over all ranks (Megatron-LM's "num zeros");
        None without --log-num-zeros-in-grad or before a step. A host sync."""
        return None if self._zeros is None else int(self._zeros.item())

    def _adamw(self, grads: list, grad_scale: float) -> None:
        """One AdamW update of every shard's fragments (optim/adamw.py); grads used ÷ grad_scale.
        The host shards' in batches on the host (optim/offload.py ``host_update``; their count
        in ``host_batches``).

        The masters' and moments' fragment views are built once; the grads' each step (the
        buckets' grad tensors are new every step, see parallel/data.py)."""
        self.step_count += 1
        if self._groups is None:
            self._groups = self._fragment_groups()
        kw = dict(step=self.step_count, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                  decoupled_lr=self.decoupled_lr)
        device = [group for group, _, on_host in self._groups if not on_host]
        for group, where, on_host in self._groups:
            group.grads = [] if on_host or self.flat else [grads[i][lo:hi] for i, lo, hi in where]
        if self.flat:
            self._flat_update(grad_scale, kw)
        else:
            adamw_(device, fused=self.fused, grad_scale=grad_scale, **kw)
        self.host_batches = host_update([(g, w) for g, w, on_host in self._groups if on_host], grads,
                                        self.staging, grad_scale=grad_scale, **kw)
        for group, _, _ in self._groups:
            group.grads = []  # hold no grad memory past the step

    def _flat_prepare(self, grads: list) -> None:
        """Point the runs at this step's grads and group the small runs (``_flat_update``): host
        work done before the grad norm's sync, while the GPU still runs the backward."""
        if self._runs is None:
            self._runs = self._flat_runs()
            self._kernel = fast.compile_fn(flat_steps, dynamic=True)
        small, narrow = {}, []
        for run, i, lo, hi in self._runs:
            run.grad = grads[i][lo:hi]
            if run.master.numel() < FLAT_MIN:
                g = small.setdefault((run.decay, run.lr_mult, run.decoupled),
                                     Group([], [], [], [], run.decay, run.lr_mult, run.decoupled))
                for dst, t in ((g.params, run.master), (g.grads, run.grad), (g.exp_avgs, run.exp_avg),
                               (g.exp_avg_sqs, run.exp_avg_sq)):
                    dst.append(t)
                if run.grad.dtype != run.master.dtype:
                    narrow.append((g.grads, len(g.grads) - 1))
        if narrow:  # the multi-tensor kernel takes the masters' dtype: bf16 grads widened in one cast
            wide_flat = torch.cat([lst[j] for lst, j in narrow]).to(torch.float32)
            for (lst, j), w in zip(narrow, wide_flat.split([lst[j].numel() for lst, j in narrow])):
                lst[j] = w
        self._small = list(small.values())

    def _flat_update(self, grad_scale: float, kw: dict) -> None:
        """The device shards' update as runs, their params published: each run of at least
        ``FLAT_MIN`` elements by its kernel in one compiled call for all of them (optim/adamw.py
        ``flat_adamw_``), the small ones (norms, biases, the router) together by the multi-tensor
        kernel and one copy, since each kernel launch costs the host µs whatever its size. After
        ``_flat_prepare``."""
        big = [r for r, *_ in self._runs if r.master.numel() >= FLAT_MIN]
        flat_adamw_(big, grad_scale=grad_scale, kernel=self._kernel, **kw)
        adamw_(self._small, fused=True, grad_scale=grad_scale, **kw)
        outs = [(r.out, r.master) for r, *_ in self._runs if r.out is not None and r.master.numel() < FLAT_MIN]
        if outs:
            torch._foreach_copy_(*map(list, zip(*outs)))
        self._drop_run_grads()
        self._published = {i for _, i, _, _ in self._runs}

    def _drop_run_grads(self) -> None:
        """Hold no grad memory past the step (the runs' and small groups' views)."""
        for run, *_ in self._runs or ():
            run.grad = None
        self._small = []

    def _flat_runs(self) -> list:
        """[(Run, shard index, lo, hi)]: each device shard's consecutive fragments of one (decay,
        lr_mult, decoupled) merged into one range of views (masters, moments, the params to publish into)."""
        runs = []
        for i, s in enumerate(self.shards):
            if s.host:
                continue
            spans = []
            for f in s.fragments:
                if spans and spans[-1][1] == f.lo and spans[-1][2:] == [f.decay, f.lr_mult, f.decoupled]:
                    spans[-1][1] = f.hi
                else:
                    spans.append([f.lo, f.hi, f.decay, f.lr_mult, f.decoupled])
            for lo, hi, decay, lr_mult, decoupled in spans:
                out = s.param[lo:hi] if s.separate_master else None
                runs.append((Run(s.master[lo:hi], None, s.exp_avg[lo:hi], s.exp_avg_sq[lo:hi], out, decay, lr_mult,
                                 decoupled), i, lo, hi))
        return runs

    def _fragment_groups(self) -> list:
        """[(Group, where, on the host)], one per (decay, lr_mult, decoupled, device or host) present: fragment
        views of masters and moments, and where each fragment's grad lies: (shard index, lo, hi)."""
        groups = {}
        for i, s in enumerate(self.shards):
            for f in s.fragments:
                key = (f.decay, f.lr_mult, f.decoupled, s.host)
                if key not in groups:
                    groups[key] = (Group([], [], [], [], f.decay, f.lr_mult, f.decoupled), [], s.host)
                grp, where, _ = groups[key]
                where.append((i, f.lo, f.hi))
                for dst, t in ((grp.params, s.master), (grp.exp_avgs, s.exp_avg), (grp.exp_avg_sqs, s.exp_avg_sq)):
                    dst.append(t[f.lo:f.hi])
        return list(groups.values())

    def _publish(self) -> None:
        """Copy the updated masters into the model params (cast to their dtype; host masters
        through the bounded staging), but for the shards this step's flat update wrote."""
        published, self._published = self._published, set()
        for i, s in enumerate(self.shards):
            if s.host:
                self.staging.to_device(s.param, s.master)
            elif s.separate_master and i not in published:
                s.param.copy_(s.master)

    # ------------------------------------------------------------------ checkpointing
    def state_pieces(self) -> list:
        """This rank's tensor state by parameter, nothing copied: [(param, p_lo, {"master", "exp_avg",
        "exp_avg_sq": [n] views of the live fp32 state})], each holding elements [p_lo, p_lo + n)
        of the flattened local (TP/PP) param: the whole param under plain DP, this rank's part of
        it under ZeRO-1. A checkpoint reads them to save and writes into them to load
        (checkpoint/state.py ``optimizer_state``), so neither gathers anything over DP."""
        self.settle_params()
        return [(f.param, f.p_lo, {k: t[f.lo:f.hi] for k, t in s.tensors().items()})
                for s in self.shards for f in s.fragments]

    def state_dict(self) -> dict:
        """The scalars, the same on every rank: ``{"step": int, "lr": float, "loss_scaler": {...}}``
        (the tensors are ``state_pieces``)."""
        return {"step": self.step_count, "lr": self.lr, "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """Restore ``state_dict()``'s scalars once the tensors of ``state_pieces`` hold the loaded
        state, then copy the masters into the params (all-gathered under ZeRO-1: collective over
        DP × CP, every rank calls it; under ZeRO-3 into its shards)."""
        self.settle_params()
        self.step_count = int(sd["step"])
        self.lr = float(sd["lr"])
        self.scaler.load_state_dict(sd["loss_scaler"])
        self._publish()

    def reload_model_params(self, from_whole: bool = True) -> None:
        """Copy the model params into the fp32 masters (Megatron's ``reload_model_params``): after
        loading only the model weights (--no-load-optim, --finetune) the masters must start from
        them, not from the initial weights. fp32 params are their own masters: nothing to do.
        from_whole: the params were loaded whole (the distributed optimizer's ZeRO-3 then copies
        them into its shards first)."""
        self.settle_params()
        for s in self.shards:
            if s.host:
                self.staging.to_host(s.master, s.param)
            elif s.separate_master:
                s.master.copy_(s.param)

    # ------------------------------------------------------------------ reporting
    def memory_report(self) -> dict:
        """Bytes this rank holds for weights, gradients and optimizer state, and per parameter.

        weights = param buffers (under ZeRO-3 the param shards plus the buckets whole right now; under
        --fp8-param-gather the FP8 copies too, one byte an element, likewise),
        grads = the main_grad buffers while allocated (under ZeRO-2/3 the reduced shards a rank
        keeps), optimizer = fp32 masters (when the params are not fp32) + exp_avg + exp_avg_sq
        over this rank's shards on the device, padding included (optimizer_host_bytes: the same for
        the shards --optimizer-cpu-offload keeps on the host, not in total_bytes; host_staging_bytes: its
        pinned staging buffers allocated so far, optim/offload.py). Per parameter this is the ZeRO paper's
        accounting (Rajbhandari et al. 2020, §3.1): bf16 params with fp32 main_grads: 2 + 4 + 12
        bytes, 2 + 4 + 12/DP under ZeRO-1, 2 + 4/DP + 12/DP under ZeRO-2, (2 + 4 + 12)/DP under
        ZeRO-3; fp32: 4 + 4 + 8 likewise.
        Returns {"num_params", "weights_bytes", "grads_bytes", "optimizer_bytes", "total_bytes",
        "bytes_per_param": {"weights", "grads", "optimizer", "total"}, "optimizer_host_bytes",
        "host_staging_bytes"}.
        """
        n = sum(p.numel() for buf in self.ddp.buffers for p in buf.params)
        weights = grads = 0
        for b in self.ddp.buffers:
            size = b.size if b.shard_grads else 1
            grads += b.numel // size * b.grad_dtype.itemsize
            if b.param_data is not None:
                weights += b.param_data.numel() * b.param_data.element_size()
            else:
                weights += sum(k.param_shard.numel() * k.param_shard.element_size()
                               + k.param.untyped_storage().nbytes() for k in b.buckets)
            if b.fp8:  # --fp8-param-gather's uint8 copies: whole (ZeRO-1/2), or the shard and what is gathered
                weights += sum(k.param8.untyped_storage().nbytes() + (k.param8_shard.numel() if b.sharded_params else 0)
                               for k in b.buckets)
        held = [(s.host, t.numel() * t.element_size()) for s in self.shards for k, t in s.tensors().items()
                if s.separate_master or k != "master"]
        optim = sum(n for host, n in held if not host)
        total = weights + grads + optim
        per = {k: v / max(n, 1) for k, v in
               (("weights", weights), ("grads", grads), ("optimizer", optim), ("total", total))}
        return {"num_params": n, "weights_bytes": weights, "grads_bytes": grads, "optimizer_bytes": optim,
                "total_bytes": total, "bytes_per_param": per,
                "optimizer_host_bytes": sum(n for host, n in held if host), "host_staging_bytes": self.staging.nbytes()}
