"""A training campaign from a planned step: time to train, GPU-hours, failures, checkpoint cadence, goodput.

Given a layout's step time (``cost.StepTime.total``, seconds), the global batch (samples a step), the
sequence length and the job's GPUs, and the run's length (``--train-iters``, ``--train-samples`` or
``--train-tokens``), ``campaign`` computes:

- steps and tokens as ``meshlm pretrain`` takes them (``run_length``: a ramp's smaller steps counted),
  the failure-free time to train T (samples / global batch × step) and GPU-hours (T × GPUs);
- failures: each GPU fails independently with a mean time between failures ``--gpu-mtbf-hours``,
  default ``MTBF_GPU_HOURS`` from Meta's Llama 3 report (Dubey et al. 2024, "The Llama 3 Herd of
  Models", §3.3.4 and Table 5: 419 unexpected interruptions in a 54-day snapshot of pre-training on
  16,384 H100 GPUs, i.e. 16,384 × 54 × 24 h / 419 ≈ 50,700 GPU-hours between failures); one failure
  stops the whole synchronous job, so the job's MTBF is M = MTBF_GPU / GPUs;
- the checkpoint: ``CHECKPOINT_BYTES_PER_PARAM`` bytes per parameter (bf16 weights 2 + fp32 master 4 +
  Adam moments 8; bench/RESULTS.md 2026-12-01 measured 14.84 GiB for 1.14B parameters), written by
  all ranks at once at the storage's aggregate write bandwidth ``--ckpt-write-gbps`` (default
  ``WRITE_BYTES_PER_S``: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", §5: checkpoint saves of their 1T model reached 273 GB/s on Selene's
  file system). A synchronous save blocks training for the write, W = bytes / bandwidth;
  ``--async-save`` blocks only for each rank's device-to-host copy of its 1/GPUs share at
  ``D2H_BYTES_PER_S`` (measured on the H200: 14.84 GiB in 0.479 s, bench/RESULTS.md 2026-12-01)
  and writes in the background; the checkpoint is durable W later, and the next one cannot start
  before the last is written (interval ≥ W);
- the checkpoint interval τ that minimises lost work, Daly's higher-order estimate (J. T. Daly, "A
  higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006, eq. 37),
  which refines Young's first-order τ = √(2δM) (J. W. Young, "A first order approximation to the optimum
  checkpoint interval", CACM 17(9), 1974), δ the blocking save time::

      τ = √(2δM) · (1 + ⅓·√(δ / 2M) + (δ / 2M) / 9) − δ     for δ < 2M,   else τ = M

- the expected wall time and goodput, to first order: every τ of training pays δ of saving; each
  failure (rate 1/M over the wall time) costs a restart R (``--restart-minutes``, an assumption: requeue,
  start-up and checkpoint load; default ``RESTART_S``) plus the work since the last durable checkpoint,
  on average (τ + δ)/2 (sync) or τ/2 + W (async). Wall = T·(1 + δ/τ) / (1 − (R + lost)/M); goodput =
  T / wall; expected failures = wall / M.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

from ..batches import BatchSchedule

MTBF_GPU_HOURS = 16384 * 54 * 24 / 419  # Llama 3 §3.3.4: 419 unexpected interruptions, 54 days, 16,384 GPUs
WRITE_BYTES_PER_S = 273e9  # Narayanan et al. 2021 §5: checkpoint saves at 273 GB/s (Selene)
D2H_BYTES_PER_S = 31e9  # --async-save's snapshot: 14.84 GiB in 0.479 s on the H200 (bench/RESULTS.md)
CHECKPOINT_BYTES_PER_PARAM = 14  # bf16 weights 2, fp32 master 4, Adam moments 4 + 4
RESTART_S = 600.0  # an assumption, not a measurement: requeue, start-up, checkpoint load
HOUR, DAY = 3600.0, 86400.0


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (s of training between saves) that minimises the expected lost time,
    Daly 2006's higher-order estimate (module doc), for a blocking save of ``save_s`` seconds and a
    job MTBF of ``mtbf_s`` seconds; ``mtbf_s`` when the save takes 2 MTBF or more."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    x = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - save_s


@dataclass
class Saving:
    """One way of saving (sync or async): blocking seconds a save, the seconds until it is durable,
    the chosen interval (s and steps), the expected wall time (s), failures and goodput."""

    mode: str
    blocking_s: float
    durable_s: float
    interval_s: float
    interval_steps: int
    wall_s: float
    wall_days: float
    expected_failures: float
    goodput: float
    flags: str


@dataclass
class Campaign:
    """The campaign of one layout (module doc); seconds, bytes, hours. ``saves`` holds "sync" and
    "async" at Daly's interval, and "yours" at the flags' --save-interval when given; ``chosen``
    names the mode the flags ask for (--async-save)."""

    steps: int
    tokens: float
    step_s: float
    train_s: float
    train_days: float
    gpu_hours: float
    num_gpus: int
    gpu_mtbf_hours: float
    job_mtbf_s: float
    params: int
    checkpoint_bytes: float
    write_bytes_per_s: float
    restart_s: float
    saves: dict
    chosen: str

    def to_json(self) -> dict:
        return asdict(self)


def run_length(train_iters: Optional[int], train_samples: Optional[int], train_tokens: Optional[float],
               schedule: BatchSchedule, seq_length: int) -> Optional[tuple]:
    """(optimizer steps, samples they consume) of the run, as ``meshlm pretrain`` takes them, or None
    when no length is given. ``schedule``: the run's global batch per step (batches.py, a
    --rampup-batch-size ramp or --step-batch-size-schedule included). --train-iters: that many steps; --train-samples: the steps
    that fit, a partial last batch dropped (``BatchSchedule.iterations``, Megatron's rule: 801
    samples at batch 8 are 100 steps, not 101); --train-tokens: the fewest steps that reach the
    tokens (⌈tokens / seq⌉ samples)."""
    if train_iters is not None:
        steps = train_iters
    elif train_samples is not None:
        steps = schedule.iterations(train_samples)
    elif train_tokens is not None:
        need = math.ceil(train_tokens / seq_length)
        steps = schedule.iterations(need)
        steps += schedule.consumed_after(steps) < need
    else:
        return None
    return steps, schedule.consumed_after(steps)


def _saving(mode: str, train_s: float, step_s: float, blocking: float, durable: float, mtbf: float,
            restart: float, run_steps: int, fixed_steps: Optional[int] = None) -> Saving:
    """One way of saving at Daly's interval, or at ``fixed_steps`` (the flags' --save-interval: an
    async save started before the last one is written waits for it, which blocks)."""
    tau = daly_interval(blocking, mtbf)
    if mode == "async":
        tau = max(tau, durable)  # one background write at a time
    steps = min(max(1, round(tau / step_s)) if fixed_steps is None else fixed_steps, run_steps)  # past the end: one
    tau = steps * step_s
    if mode == "async" and tau < durable:
        blocking += durable - tau
    lost = (tau + blocking) / 2 if mode == "sync" else tau / 2 + durable
    busy = 1 - (restart + lost) / mtbf
    wall = train_s * (1 + blocking / tau) / busy if busy > 0 else math.inf
    flags = f"--save-interval {steps}" + (" --async-save" if mode == "async" else "")
    return Saving(mode=mode, blocking_s=blocking, durable_s=durable, interval_s=tau, interval_steps=steps,
                  wall_s=wall, wall_days=wall / DAY, expected_failures=wall / mtbf,
                  goodput=train_s / wall if wall < math.inf else 0.0, flags=flags)


def campaign(*, steps: int, step_s: float, global_batch: int, seq_length: int, num_gpus: int, params: int,
             samples: Optional[int] = None, gpu_mtbf_hours: float = MTBF_GPU_HOURS,
             write_bytes_per_s: float = WRITE_BYTES_PER_S, restart_s: float = RESTART_S,
             async_save: bool = False, save_interval: Optional[int] = None) -> Campaign:
    """The campaign of ``steps`` optimizer steps on ``num_gpus`` GPUs, ``step_s`` seconds a step of
    ``global_batch`` samples, for a model of ``params`` parameters (module doc for every term and
    its source). samples: what the steps consume (``run_length``; default steps × global batch);
    fewer under a --rampup-batch-size ramp or --step-batch-size-schedule, whose smaller steps are priced at the full batch's time
    per sample. save_interval: the flags' --save-interval, evaluated as ``saves["yours"]`` beside
    Daly's (the line marked "your flags" showed Daly's interval, not the one the flags save at)."""
    samples = steps * global_batch if samples is None else samples
    train_s = samples / global_batch * step_s
    mtbf = gpu_mtbf_hours * HOUR / num_gpus
    ckpt = CHECKPOINT_BYTES_PER_PARAM * params
    write = ckpt / write_bytes_per_s
    saves = {"sync": _saving("sync", train_s, step_s, write, write, mtbf, restart_s, steps),
             "async": _saving("async", train_s, step_s, ckpt / num_gpus / D2H_BYTES_PER_S, write, mtbf, restart_s,
                              steps)}
    if save_interval:
        mode = "async" if async_save else "sync"
        blocking = write if mode == "sync" else ckpt / num_gpus / D2H_BYTES_PER_S
        yours = _saving(mode, train_s, step_s, blocking, write, mtbf, restart_s, steps, save_interval)
        saves["yours"] = replace(yours, flags=f"--save-interval {save_interval}" + " --async-save" * async_save)
    return Campaign(steps=steps, tokens=float(samples) * seq_length, step_s=step_s, train_s=train_s,
                    train_days=train_s / DAY, gpu_hours=train_s * num_gpus / HOUR, num_gpus=num_gpus,
                    gpu_mtbf_hours=gpu_mtbf_hours, job_mtbf_s=mtbf, params=params, checkpoint_bytes=ckpt,
                    write_bytes_per_s=write_bytes_per_s, restart_s=restart_s,
                    saves={k: asdict(v) for k, v in saves.items()}, chosen="async" if async_save else "sync")
