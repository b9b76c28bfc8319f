"""Learning-rate schedule: linear warm-up, then constant, linear, cosine, inverse-square-root or
WSD decay (Megatron's OptimizerParamScheduler, megatron-core 0.16.1 optimizer_param_scheduler.py).

Megatron counts in samples (megatron/training/training.py get_optimizer_param_scheduler): the
schedule's position x is the number of samples in the optimizer steps taken so far (each step
adds its global batch, which --rampup-batch-size may grow). Iteration-based runs (--train-iters,
constant global batch B): warm-up W = --lr-warmup-iters·B, decay end D = (--lr-decay-iters,
default --train-iters)·B, WSD anneal A = --lr-wsd-decay-iters·B; under --step-batch-size-schedule
each length is the samples its steps take by the schedule (Megatron multiplies by its
--global-batch-size, which it refuses beside the schedule, so its default micro × DP would count
there). Sample-based runs
(--train-samples T): W = --lr-warmup-samples, D = --lr-decay-samples (default T),
A = --lr-wsd-decay-samples. Either way --lr-warmup-fraction f gives W = f·D. With --decoupled-lr
the word embedding and output layer follow the same schedule with lr = --decoupled-lr and min_lr =
--decoupled-min-lr (default --min-lr), as Megatron-core's param groups do. The next update uses
  warm-up (W > 0, x <= W):  lr · x / W          (the very first update has lr 0, as in Megatron)
  constant:                 lr
  x > D:                    min_lr
  inverse-square-root:      max(min_lr, lr · sqrt(max(W, 1) / max(x, 1)))
  otherwise, with r = (x - W) / (D - W):
    linear:  min_lr + (lr - min_lr) · (1 - r)
    cosine:  min_lr + (lr - min_lr) · (1 + cos(π r)) / 2   (Loshchilov & Hutter 2017, SGDR)
    WSD:     lr until x <= D - A, then min_lr + (lr - min_lr) · c(q), q = (x - D + A) / A, with
             c = 2·0.5^q − 1 (exponential), 1 − q (linear), (1 + cos(π q)) / 2 (cosine) or
             1 − √q (minus_sqrt)   (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training
             Beyond Fixed Training Durations")
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from ..errors import CheckpointError

WSD_ANNEAL = {
    "exponential": lambda q: 2.0 * 0.5 ** q - 1.0,
    "linear": lambda q: 1.0 - q,
    "cosine": lambda q: 0.5 * (math.cos(math.pi * q) + 1.0),
    "minus_sqrt": lambda q: 1.0 - math.sqrt(q),
}


class LRScheduler:
    """The learning rate for the next optimizer step; ``step(opt, samples)`` after each step taken.

    opt_cfg: Config.optimizer (lr, min_lr, lr_decay_style, the warm-up, decay and WSD-anneal
    lengths in iterations or samples, lr_warmup_fraction, lr_wsd_decay_style). train_iters: the
    default decay length of an iteration-based run. global_batch: B, samples per step of an
    iteration-based run and the default ``step`` increment. train_samples: --train-samples for a
    sample-based run (the --lr-*-samples lengths apply, uncounted by B), None for iteration-based.
    samples_after: the samples the first n steps take, when the batch changes during an
    iteration-based run (--step-batch-size-schedule): the --lr-*-iters lengths end where those steps
    do, not at n·B (module doc).
    """

    def __init__(self, opt_cfg, train_iters: int, global_batch: int = 1, train_samples: Optional[int] = None,
                 samples_after: Optional[Callable[[int], int]] = None):
        o, b = opt_cfg, global_batch
        if train_samples is None:
            span = samples_after or (lambda steps: steps * b)
            decay_iters, anneal_iters = o.lr_decay_iters or train_iters, o.lr_wsd_decay_iters or 0
            self.decay, warmup = span(decay_iters), span(o.lr_warmup_iters)
            self.wsd_anneal = self.decay - span(max(decay_iters - anneal_iters, 0))
        else:
            self.decay = o.lr_decay_samples or train_samples
            warmup, self.wsd_anneal = o.lr_warmup_samples, o.lr_wsd_decay_samples or 0
        self.warmup = o.lr_warmup_fraction * self.decay if o.lr_warmup_fraction is not None else warmup
        self.max_lr, self.min_lr, self.style, self.batch = o.lr, o.min_lr, o.lr_decay_style, b
        self.decoupled_max, self.decoupled_min = o.decoupled_lr, (o.min_lr if o.decoupled_min_lr is None
                                                                  else o.decoupled_min_lr)
        self.wsd_style = o.lr_wsd_decay_style
        self.samples = 0

    def lr_at(self, x: int, decoupled: bool = False) -> float:
        """Learning rate of the update made after steps totalling x samples (--decoupled-lr's with
        ``decoupled``)."""
        max_lr, min_lr = (self.decoupled_max, self.decoupled_min) if decoupled else (self.max_lr, self.min_lr)
        if self.warmup > 0 and x <= self.warmup:
            return max_lr * x / self.warmup
        if self.style == "constant":
            return max_lr
        if x > self.decay:
            return min_lr
        if self.style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(self.warmup, 1) / max(x, 1)))
        if self.style == "WSD":
            start = self.decay - self.wsd_anneal
            coeff = 1.0 if x <= start else WSD_ANNEAL[self.wsd_style]((x - start) / self.wsd_anneal)
        else:
            r = (x - self.warmup) / (self.decay - self.warmup)
            coeff = 1.0 - r if self.style == "linear" else 0.5 * (math.cos(math.pi * r) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    @property
    def lr(self) -> float:
        return self.lr_at(self.samples)

    @property
    def decoupled_lr(self) -> Optional[float]:
        """--decoupled-lr's value for the next update; None without the flag."""
        return None if self.decoupled_max is None else self.lr_at(self.samples, decoupled=True)

    def step(self, opt=None, samples: Optional[int] = None) -> float:
        """Count one optimizer step of ``samples`` samples (default B); set the next lr on ``opt``
        (anything with set_lr); return it."""
        self.samples += self.batch if samples is None else samples
        if opt is not None:
            opt.set_lr(self.lr, self.decoupled_lr)
        return self.lr

    def state_dict(self) -> dict:
        """The position and the settings it was reached under (compared on load: :meth:`load_state_dict`)."""
        return {"num_samples": self.samples, **self._settings()}

    def _settings(self) -> dict:
        return {name: getattr(self, attr) for name, (attr, _) in SETTINGS.items()}

    def load_state_dict(self, sd: dict, policy: str = "check", where: str = "") -> None:
        """Restore the position; a checkpoint from before the sample count ({"num_steps": n}
        iterations of the constant batch B) gives n·B.

        The settings, as Megatron's OptimizerParamScheduler.load_state_dict: ``policy`` "check"
        (default) raises CheckpointError naming every setting that differs from the checkpoint's
        and the two flags that resolve it; "override" (--override-opt_param-scheduler) keeps this
        run's; "checkpoint" (--use-checkpoint-opt_param-scheduler) takes the checkpoint's.
        Checkpoints saved before the settings were stored are not compared. where: the --load
        folder, for the message.
        """
        self.samples = int(sd["num_samples"]) if "num_samples" in sd else int(sd["num_steps"]) * self.batch
        saved = {name: sd[name] for name in SETTINGS if name in sd}
        if policy == "checkpoint":
            for name, value in saved.items():
                setattr(self, SETTINGS[name][0], value)
            return
        differ = [f"{flags} saved={saved[name]} now={value}" for name, value in self._settings().items()
                  for flags in [SETTINGS[name][1]] if name in saved and saved[name] != value]
        if differ and policy == "check":
            raise CheckpointError(
                f"--load {where}: the checkpoint's LR schedule differs from this run's: {'; '.join(differ)}; "
                f"pass --override-opt_param-scheduler to use this run's settings from here on, or "
                f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's (as Megatron-LM)")


# state_dict key → (LRScheduler attribute, the flags that set it). Lengths are in samples.
SETTINGS = {
    "max_lr": ("max_lr", "--lr"),
    "min_lr": ("min_lr", "--min-lr"),
    "decoupled_max_lr": ("decoupled_max", "--decoupled-lr"),
    "decoupled_min_lr": ("decoupled_min", "--decoupled-min-lr (default --min-lr)"),
    "decay_style": ("style", "--lr-decay-style"),
    "warmup_samples": ("warmup", "warm-up samples (--lr-warmup-iters/-samples/-fraction × global batch)"),
    "decay_samples": ("decay", "decay samples (--lr-decay-iters/-samples, default --train-iters/-samples, "
                               "× global batch)"),
    "wsd_decay_samples": ("wsd_anneal", "WSD anneal samples (--lr-wsd-decay-iters/-samples)"),
    "wsd_decay_style": ("wsd_style", "--lr-wsd-decay-style"),
}


def scheduler_for(cfg, world_size: int) -> LRScheduler:
    """The run's LRScheduler: iteration- or sample-based as the config says (Config, job size)."""
    from ..config import batch_schedule, global_batch, run_iterations
    schedule = batch_schedule(cfg, world_size)
    return LRScheduler(cfg.optimizer, run_iterations(cfg, world_size), global_batch(cfg, world_size),
                       cfg.training.train_samples, None if schedule.constant else schedule.consumed_after)
