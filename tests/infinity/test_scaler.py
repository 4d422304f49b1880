"""The fp16 loss scaler (infinity/_scaler.py) against torch's GradScaler rule and DeepSpeed's
hysteresis, step by step."""

from __future__ import annotations

import pytest

import infinity
from infinity._scaler import LossScaler


class _Rule:
    """The dynamic loss scale written out here: an overflow backs off (scale / 2, at least the
    minimum) only when no hysteresis is left (else one is used up); a clean step grows the
    scale and renews the hysteresis (every clean step renews it when consecutive) where the
    clean steps since the last overflow are a multiple of the window: counting this one, as
    torch's GradScaler does (its count starts over at each change of the scale); or, with
    ``deepspeed``, before this one, as DeepSpeed 0.19.8's DynamicLossScaler.update_scale does
    (``stable_interval = cur_iter - last_overflow_iter - 1``, grown when it is a positive
    multiple of the window)."""

    def __init__(self, scale, window, hysteresis, consecutive, deepspeed, low=1.0):
        self.scale, self.window, self.delay, self.consecutive, self.low = scale, window, hysteresis, consecutive, low
        self.left, self.it, self.last_overflow, self.deepspeed = hysteresis, 0, -1, deepspeed

    def update(self, overflow):
        if overflow:
            if self.delay == 1 or self.left == 1:
                self.scale = max(self.scale / 2, self.low)
            else:
                self.left -= 1
            self.last_overflow = self.it
        else:
            if self.consecutive:
                self.left = self.delay
            stable = self.it - self.last_overflow - (1 if self.deepspeed else 0)
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive:
                    self.left = self.delay
                self.scale *= 2
        self.it += 1


PATTERN = [False] * 3 + [True] + [False] * 2 + [True, True] + [False] * 4 + [True, False, True, True, True] + [False] * 7


@pytest.mark.parametrize("deepspeed", [False, True], ids=["torch-count", "deepspeed-count"])
@pytest.mark.parametrize("hysteresis, consecutive", [(1, False), (2, False), (3, False), (2, True)])
def test_the_scale_follows_the_rule_step_by_step(hysteresis, consecutive, deepspeed):
    """deepspeed_growth grew one step early before: the scales of DeepSpeed 0.19.8's scaler
    (an audit helper's replay) parted from the engine's at the first growth after an overflow."""
    cfg = infinity.TierConfig.from_dict({"precision": {"param_dtype": "fp16", "initial_scale": 1024.0, "growth_interval": 3,
                                                       "hysteresis": hysteresis, "consecutive_hysteresis": consecutive,
                                                       "deepspeed_growth": deepspeed}})  # fmt: skip
    ours, rule = LossScaler(cfg.precision), _Rule(1024.0, 3, hysteresis, consecutive, deepspeed)
    seen = []
    for overflow in PATTERN:
        ours.update(overflow)
        rule.update(overflow)
        seen.append(ours.scale)
        assert ours.scale == rule.scale, (len(seen), seen, rule.scale)
    assert len(set(seen)) > 2  # it grew and backed off
    assert seen[2] == (1024.0 if deepspeed else 2048.0)  # the third clean step from the start: torch's grows


def test_a_deepspeed_fp16_config_means_deepspeeds_hysteresis_2_unless_it_says():
    ds = {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}
    assert infinity.TierConfig.from_deepspeed(ds).precision.hysteresis == 2
    assert infinity.TierConfig.from_deepspeed(ds).precision.deepspeed_growth  # and its counting
    ds["fp16"].update(hysteresis=4, consecutive_hysteresis=True)
    p = infinity.TierConfig.from_deepspeed(ds).precision
    assert (p.hysteresis, p.consecutive_hysteresis) == (4, True)


def test_the_hysteresis_left_is_saved_and_restored():
    cfg = infinity.TierConfig.from_dict({"precision": {"param_dtype": "fp16", "hysteresis": 3}})
    a = LossScaler(cfg.precision)
    a.update(True)
    b = LossScaler(cfg.precision)
    b.load_state_dict(a.state_dict())
    for s in (a, b):
        s.update(True)
        s.update(True)
    assert a.scale == b.scale == cfg.precision.initial_scale / 2


def test_an_overflow_at_the_minimum_scale_is_said_once(caplog):
    """The scale cannot back off below precision.min_scale: every later step may be skipped and
    training stand still. DeepSpeed raises; it was silent here (an audit helper)."""
    cfg = infinity.TierConfig.from_dict({"precision": {"param_dtype": "fp16", "initial_scale": 2.0, "min_scale": 1.0}})
    scaler = LossScaler(cfg.precision)
    with caplog.at_level("WARNING", logger="infinity"):
        scaler.update(True)  # 2 -> 1: still backing off
        assert not caplog.records
        for _ in range(3):
            scaler.update(True)
    assert scaler.scale == 1.0
    assert [r.getMessage() for r in caplog.records if "minimum loss scale" in r.getMessage()] != []
    assert len(caplog.records) == 1
