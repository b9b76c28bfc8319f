"""Learning-rate schedule: linear warm-up, then constant, linear or cosine decay (Megatron's rules).

With n optimizer steps taken so far, the next update uses
  warm-up (n <= W, W = --lr-warmup-iters > 0):  lr · n / W   (so the very first update has lr 0,
                                                              as in Megatron-LM)
  constant:                                     lr
  n > D (D = --lr-decay-iters, default --train-iters): min_lr
  otherwise, with r = (n - W) / (D - W):
    linear:  min_lr + (lr - min_lr) · (1 - r)
    cosine:  min_lr + (lr - min_lr) · (1 + cos(π r)) / 2   (Loshchilov & Hutter 2017, SGDR)
"""

from __future__ import annotations

import math


class LRScheduler:
    """The learning rate for the next optimizer step; ``step(opt)`` after each optimizer step.

    opt_cfg: Config.optimizer (lr, min_lr, lr_decay_style, lr_warmup_iters, lr_decay_iters).
    train_iters: the default number of decay iterations.
    """

    def __init__(self, opt_cfg, train_iters: int):
        self.max_lr, self.min_lr = opt_cfg.lr, opt_cfg.min_lr
        self.style = opt_cfg.lr_decay_style
        self.warmup = opt_cfg.lr_warmup_iters
        self.decay = opt_cfg.lr_decay_iters or train_iters
        self.num_steps = 0

    def lr_at(self, n: int) -> float:
        """Learning rate of the update made after n completed steps."""
        if self.warmup > 0 and n <= self.warmup:
            return self.max_lr * n / self.warmup
        if self.style == "constant":
            return self.max_lr
        if n > self.decay:
            return self.min_lr
        r = (n - self.warmup) / (self.decay - self.warmup)
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
