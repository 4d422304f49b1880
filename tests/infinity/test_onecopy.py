"""One copy of the fp32 weights: the parameters are the master weights ([Note: one copy of the
fp32 weights] in infinity/_onecopy.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import infinity
from infinity import _onecopy

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, train  # noqa: E402

NVME = ("nvme", "nvme", "nvme")


def _model() -> nn.Module:
    torch.manual_seed(0)  # 257KiB units (page-aligned slices) between small ones (packed)
    return nn.Sequential(nn.Linear(16, 256), nn.LayerNorm(256), nn.Linear(256, 256), nn.Tanh(), nn.LayerNorm(256),
                         nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))  # fmt: skip


def _run(path, monkeypatch, one_copy: bool, overlap: bool, steps: int = 3, ckpt=None):
    with monkeypatch.context() as m:
        if not one_copy:
            m.setattr(_onecopy, "applies", lambda *a: False)
        cfg = config(path, NVME, optimizer={"overlap": overlap, "overlap_disk": 1.0, "sub_group_size": "2MiB",
                                            "max_grad_norm": 1e9})  # fmt: skip
        engine = infinity.initialize(_model(), cfg)
    try:
        engine.plan.held = 0  # every gradient written: the kinds' bytes below are exact
        losses = train(engine, steps)
        if ckpt is not None:
            engine.save_checkpoint(ckpt)
            losses += train(engine, 1, start=steps)
            engine.load_checkpoint(ckpt)
            losses += train(engine, 1, start=steps)
        names = engine.space.names()
        committed = engine.overlap.committed if overlap else 0
        return (losses, engine.gathered_weights(), engine.stats()["step"]["nvme"]["by_kind"], names,
                engine.stats()["disk"], engine.optimizer, 4 * sum(u.shard_numel for u in engine.units), committed)  # fmt: skip
    finally:
        engine.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["after-backward", "overlap"])
def test_one_copy_trains_the_same_and_moves_and_keeps_four_bytes_less(tmp_path, monkeypatch, overlap):
    two = _run(tmp_path / "two", monkeypatch, False, overlap)
    one = _run(tmp_path / "one", monkeypatch, True, overlap)
    assert one[5].one_copy and not two[5].one_copy
    assert one[0] == two[0]
    for k in two[1]:
        assert torch.equal(one[1][k], two[1][k]), k
    if overlap:
        assert one[7] == two[7] == len(one[5].groups)
    # No tensor of master weights beside the parameters; the slices of the large units start
    # at whole pages.
    assert not [n for n in one[3] if n.endswith("/master")] and [n for n in two[3] if n.endswith("/master")]
    for g in one[5].groups:
        for u in g.units:
            if u.shard_numel >= 8 * _onecopy.ALIGN:
                assert g.slices[u.index].start % _onecopy.ALIGN == 0
    # The new parameters are the master weights written: 4 bytes a parameter less each step
    # (less the gaps before the aligned slices, which the two moments write too).
    fp32 = one[6]
    gaps = sum(4 * (g.numel - sum(u.shard_numel for u in g.units)) for g in one[5].groups)
    written = lambda r: sum(k["write_bytes"] for k in r[2].values())  # noqa: E731
    assert 0 < gaps < fp32 / 100 and written(two) - written(one) == fp32 - 2 * gaps, (written(two), written(one), fp32, gaps)
    assert one[2]["master"] == {"read_bytes": fp32, "write_bytes": fp32}, one[2]["master"]
    assert one[2]["param"]["write_bytes"] == 0
    # And 4 bytes a parameter less on disk, in the plan (the moments' gaps aside, and each
    # tensor rounded to whole pages).
    (d1,), (d2,) = one[4].values(), two[4].values()
    assert d2["state_bytes"] - d1["state_bytes"] >= fp32 - 2 * gaps - 4096, (d1, d2, fp32, gaps)


def test_one_copy_checkpoints_load_bit_for_bit(tmp_path, monkeypatch):
    """A checkpoint of a run with one copy resumes it exactly, and loads into a run with two
    (the format is the same)."""
    one = _run(tmp_path / "one", monkeypatch, True, False, ckpt=tmp_path / "ckpt")
    assert one[0][-1] == one[0][-2]  # the step after the load is the step after the save
    with monkeypatch.context() as m:
        m.setattr(_onecopy, "applies", lambda *a: False)
        engine = infinity.initialize(_model(), config(tmp_path / "two", NVME, optimizer={"overlap": False}))
    try:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert train(engine, 1, start=3) == one[0][-1:]
    finally:
        engine.close()


def test_one_copy_applies_to_fp32_parameters_on_nvme_only(tmp_path):
    for tiers, dtype, expected in [(NVME, "fp32", True), (NVME, "bf16", False), (("nvme", "nvme", "cpu"), "fp32", False),
                                   (("cpu", "cpu", "nvme"), "fp32", False)]:  # fmt: skip
        engine = infinity.initialize(_model(), config(tmp_path / f"{tiers}{dtype}", tiers, precision={"param_dtype": dtype}))
        try:
            assert engine.optimizer.one_copy is expected, (tiers, dtype)
        finally:
            engine.close()
