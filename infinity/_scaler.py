"""The fp16 loss scaler: dynamic loss scaling, as torch.amp.GradScaler does it.

Owns: the scale and the count of good steps since it last changed. Touches nothing else: the
engine multiplies the loss by `scale` and tells `update` whether the step overflowed.
"""

from __future__ import annotations


class LossScaler:
    """An overflow skips the step and lowers the scale; a run of ``growth_interval`` good
    steps raises it (``precision``: the config's [precision] section)."""

    def __init__(self, precision):
        self.scale = float(precision.initial_scale)
        self.cfg = precision
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale * self.cfg.backoff_factor, self.cfg.min_scale)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.cfg.growth_interval:
                self.scale *= self.cfg.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
