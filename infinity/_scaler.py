"""The fp16 loss scaler: dynamic loss scaling, as torch.amp.GradScaler does it, or with
DeepSpeed's hysteresis.

Owns: the scale, the count of good steps since it last changed, and the overflows left before
it backs off. Touches nothing else: the engine multiplies the loss by `scale` and tells
`update` whether the step overflowed.

With ``precision.hysteresis`` = h > 1 (DeepSpeed's ``fp16.hysteresis``, whose default there is
2), an overflow skips the step and backs the scale off only when it is the h-th since the count
was renewed; the count is renewed when the scale grows, or after every clean step with
``consecutive_hysteresis``. With h = 1 (the default) every overflow backs off, as torch's
GradScaler does.

The scale grows after ``growth_interval`` clean steps, as torch's GradScaler counts them (the
count starts over at every change of the scale); with ``precision.deepspeed_growth`` (a
DeepSpeed config's) as DeepSpeed's loss scaler counts them: ``good_steps`` is the run of clean
steps since the last overflow, and the scale grows at the clean step after a multiple of the
interval (its ``stable_interval = cur_iter - last_overflow_iter - 1``), one step later than
torch's. The engine grew one step early under a DeepSpeed config, and its skipped steps went
another way from there (an audit helper's replay through DeepSpeed 0.19.8's DynamicLossScaler).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("infinity")


class LossScaler:
    """An overflow skips the step and lowers the scale (after ``hysteresis`` of them); a run of
    ``growth_interval`` good steps raises it (``precision``: the config's [precision] section)."""

    def __init__(self, precision):
        self.scale = float(precision.initial_scale)
        self.cfg = precision
        self.good_steps = 0  # clean steps since the scale changed (deepspeed_growth: since the last overflow)
        self.hysteresis = precision.hysteresis  # overflows left before the scale backs off
        self.scaled_backward = False  # a backward since the last step went through `in_backward`
        self._said_floor = False  # an overflow at the minimum scale said (once)
        self.at_floor = False  # the last update was an overflow at the minimum scale, with stop_at_min_scale

    def in_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss``, the same value, whose backward starts from ``scale`` instead of 1: for a loop
        that calls ``loss.backward()`` itself on a loss it also reports (the Trainer)."""
        return _ScaledInBackward.apply(loss, self)

    def update(self, overflow: bool) -> None:
        self.scaled_backward = False
        cfg = self.cfg
        self.at_floor = False
        if overflow:
            if self.hysteresis <= 1:
                if self.scale <= cfg.min_scale and cfg.stop_at_min_scale:
                    self.at_floor = True  # the engine raises once the step is counted (`floor_error`)
                elif self.scale <= cfg.min_scale and not self._said_floor:
                    # The scale cannot back off further: the next steps may all be skipped, and
                    # training stands still (DeepSpeed raises here).
                    self._said_floor = True
                    logger.warning(
                        "fp16 overflow at the minimum loss scale (precision.min_scale = %g): the step was skipped "
                        "and the scale cannot go lower, so the next steps may be skipped too (engine.stats() counts "
                        "skipped_steps). Lower precision.min_scale, or train in bf16. (Said once.)", cfg.min_scale)  # fmt: skip
                self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)
            else:
                self.hysteresis -= 1
            self.good_steps = 0
            return
        if cfg.consecutive_hysteresis:
            self.hysteresis = cfg.hysteresis
        self.good_steps += 1
        if cfg.deepspeed_growth:  # the clean steps before this one since the last overflow: a multiple of the interval
            grow = self.good_steps > 1 and (self.good_steps - 1) % cfg.growth_interval == 0
        else:  # torch's GradScaler: the interval's last clean step, counted again from 0
            grow = self.good_steps >= cfg.growth_interval
        if grow:
            self.hysteresis = cfg.hysteresis
            self.scale *= cfg.growth_factor
            if not cfg.deepspeed_growth:
                self.good_steps = 0

    def floor_error(self) -> FloatingPointError:
        return FloatingPointError(
            f"fp16 overflow at the minimum loss scale (precision.min_scale = {self.cfg.min_scale:g}, DeepSpeed's "
            "fp16.min_loss_scale): the step was skipped and the scale cannot go lower, so training would stand still. "
            "precision.stop_at_min_scale (which a DeepSpeed config sets, as DeepSpeed stops its run here) raises "
            "this; lower min_scale, train in bf16, or set stop_at_min_scale = false to skip such steps and go on"
        )

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "hysteresis": self.hysteresis}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        # (a checkpoint from before the count was kept: a full one, as after a growth)
        self.hysteresis = int(state.get("hysteresis", self.cfg.hysteresis))


class _ScaledInBackward(torch.autograd.Function):
    """The identity forward; backward multiplies the incoming gradient by the scale at that
    moment, and notes that a backward was scaled (the engine refuses an unscaled one)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, scaler: LossScaler) -> torch.Tensor:
        ctx.scaler = scaler
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.scaler.scaled_backward = True
        return grad * ctx.scaler.scale, None
