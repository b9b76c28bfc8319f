"""megatron-core 0.16.1 as the reference of the batch ramp and the LR schedule (test helper).

``core_scheduler`` builds megatron-core's OptimizerParamScheduler over a stand-in optimizer (its
one param group receives the lr). ``core_steps`` walks a run as Megatron's training loop does:
before each step the num-microbatches calculator is updated at the consumed samples, the step
takes its global batch, and the scheduler and consumed samples advance by num_microbatches ×
micro × DP (megatron/training/training.py, train / train_step). ``megatron_train_iters`` is
Megatron's update_train_iters (megatron/training/training.py, not part of megatron-core), driven
by megatron-core's calculator.
"""

from __future__ import annotations

import types
import warnings


def _core():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import num_microbatches_calculator as calc
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    return calc, OptimizerParamScheduler


def core_scheduler(style, warmup_steps, decay_steps, max_lr=1e-3, min_lr=1e-5, **kw):
    """(megatron-core's scheduler counting samples, the param group it writes the lr into)."""
    group = {}
    opt = types.SimpleNamespace(param_groups=[group])
    ref = _core()[1](opt, init_lr=0.0, max_lr=max_lr, min_lr=min_lr, lr_warmup_steps=warmup_steps,
                     lr_decay_steps=decay_steps, lr_decay_style=style, start_wd=0.1, end_wd=0.1,
                     wd_incr_steps=decay_steps, wd_incr_style="constant", **kw)
    return ref, group


def core_calculator(global_batch, micro, dp, ramp=None):
    """megatron-core's calculator: constant, or RampupBatchsizeNumMicroBatchesCalculator for ramp
    = (start, increment, samples). rank 1: it logs nothing."""
    calc = _core()[0]
    if ramp is None:
        return calc.ConstantNumMicroBatchesCalculator(global_batch, micro, dp, False, 1)
    return calc.RampupBatchsizeNumMicroBatchesCalculator(global_batch, micro, dp, False, 1, *ramp)


def core_steps(steps, global_batch, micro, dp, ramp=None, scheduler=None):
    """Megatron's first ``steps`` training steps: [(global batch, micro-batches, consumed samples
    before the step, lr of the step's update)]; lr None without a scheduler (from core_scheduler)."""
    calc = core_calculator(global_batch, micro, dp, ramp)
    ref, group = scheduler or (None, {})
    out, consumed = [], 0
    for _ in range(steps):
        calc.update(consumed, consistency_check=True)
        out.append((calc.get_current_global_batch_size(), calc.get(), consumed, group.get("lr")))
        increment = calc.get() * micro * dp
        if ref is not None:
            ref.step(increment)
        consumed += increment
    return out


def megatron_train_iters(train_samples, global_batch, micro, dp, ramp=None):
    """Megatron's update_train_iters for a run of ``train_samples`` samples."""
    if ramp is None:
        return train_samples // global_batch
    calc = core_calculator(global_batch, micro, dp, ramp)
    iterations = consumed = 0
    while consumed <= ramp[2] and consumed <= train_samples:
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch
    return iterations
