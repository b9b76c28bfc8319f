"""Learning-rate schedule: linear warm-up, then constant, linear, cosine, inverse-square-root or
WSD decay (Megatron's OptimizerParamScheduler, megatron-core 0.16.1 optimizer_param_scheduler.py).

Megatron counts in samples: after n optimizer steps of global batch B, x = n·B, warm-up
W = --lr-warmup-iters·B (or --lr-warmup-fraction·D), decay end D = (--lr-decay-iters, default
--train-iters)·B, WSD anneal A = --lr-wsd-decay-iters·B. The next update uses
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

WSD_ANNEAL = {
    "exponential": lambda q: 2.0 * 0.5 ** q - 1.0,
    "linear": lambda q: 1.0 - q,
    "cosine": lambda q: 0.5 * (math.cos(math.pi * q) + 1.0),
    "minus_sqrt": lambda q: 1.0 - math.sqrt(q),
}


class LRScheduler:
    """The learning rate for the next optimizer step; ``step(opt)`` after each optimizer step.

    opt_cfg: Config.optimizer (lr, min_lr, lr_decay_style, lr_warmup_iters or lr_warmup_fraction,
    lr_decay_iters, lr_wsd_decay_style, lr_wsd_decay_iters). train_iters: the default number of
    decay iterations. global_batch: samples per step B (changes inverse-square-root only when
    W = 0, where Megatron's max(W, 1) is one sample).
    """

    def __init__(self, opt_cfg, train_iters: int, global_batch: int = 1):
        o, b = opt_cfg, global_batch
        self.max_lr, self.min_lr, self.style, self.batch = o.lr, o.min_lr, o.lr_decay_style, b
        self.decay = (o.lr_decay_iters or train_iters) * b
        self.warmup = (o.lr_warmup_fraction * self.decay if o.lr_warmup_fraction is not None
                       else o.lr_warmup_iters * b)
        self.wsd_anneal = (o.lr_wsd_decay_iters or 0) * b
        self.wsd_style = o.lr_wsd_decay_style
        self.num_steps = 0

    def lr_at(self, n: int) -> float:
        """Learning rate of the update made after n completed steps."""
        x = n * self.batch
        if self.warmup > 0 and x <= self.warmup:
            return self.max_lr * x / self.warmup
        if self.style == "constant":
            return self.max_lr
        if x > self.decay:
            return self.min_lr
        if self.style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * math.sqrt(max(self.warmup, 1) / max(x, 1)))
        if self.style == "WSD":
            start = self.decay - self.wsd_anneal
            coeff = 1.0 if x <= start else WSD_ANNEAL[self.wsd_style]((x - start) / self.wsd_anneal)
        else:
            r = (x - self.warmup) / (self.decay - self.warmup)
            coeff = 1.0 - r if self.style == "linear" else 0.5 * (math.cos(math.pi * r) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    @property
    def lr(self) -> float:
        return self.lr_at(self.num_steps)

    def step(self, opt=None) -> float:
        """Count one optimizer step; set the next lr on ``opt`` (anything with set_lr); return it."""
        self.num_steps += 1
        if opt is not None:
            opt.set_lr(self.lr)
        return self.lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.num_steps = int(sd["num_steps"])
