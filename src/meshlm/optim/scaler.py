"""Loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training" §3.2).

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero;
the optimizer divides the gradients by it again. ``DynamicLossScaler`` follows Megatron's rules:
an overflow (inf/NaN gradient) skips the step and, once ``hysteresis`` overflows have been seen,
halves the scale (never below ``--min-loss-scale``); ``--loss-scale-window`` clean steps in a row
double it and re-arm the hysteresis. ``ConstantScale`` (bf16/fp32) is always 1.
"""

from __future__ import annotations


class ConstantScale:
    """Scale 1.0 for bf16 and fp32 training: nothing to back off, an inf/NaN is an error."""

    dynamic = False
    scale = 1.0
    min_scale = 1.0

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class DynamicLossScaler:
    """Megatron's dynamic loss scaler for ``--fp16``.

    initial_scale (--initial-loss-scale), min_scale (--min-loss-scale), window
    (--loss-scale-window: clean steps before the scale doubles), hysteresis (--hysteresis:
    overflows tolerated before the scale halves).
    """

    dynamic = True

    def __init__(self, initial_scale: float, min_scale: float, window: int, hysteresis: int):
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        """Advance the scale after one step that did (True) or did not (False) overflow."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.window:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.growth_tracker = int(sd["growth_tracker"])
        self.hysteresis_tracker = int(sd["hysteresis_tracker"])


def build_scaler(training_cfg):
    """DynamicLossScaler under --fp16, else ConstantScale."""
    t = training_cfg
    if t.fp16:
        return DynamicLossScaler(t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window, t.hysteresis)
    return ConstantScale()
