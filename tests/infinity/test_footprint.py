"""The disk a run's swap space takes ([Note: disk footprint] in infinity/_footprint.py): checked
against the drive's free space and nvme.disk_budget at initialize, before anything is written;
the overlap stages only what fits (bit-identical to overlap off: the step updates the rest);
reported by stats(); a disk that fills anyway leaves the engine refusing until a checkpoint loads.
"""

from __future__ import annotations

import errno
import os
import sys
import types

import pytest
import torch
from torch import nn

import infinity
from infinity import _footprint
from infinity.swap import SwapSpace, round_up

sys.path.insert(0, os.path.dirname(__file__))
from _common import config  # noqa: E402

NVME = ("nvme", "nvme", "nvme")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def _cfg(path, overlap: bool, overlap_disk: float | None = None, **nvme) -> dict:
    optimizer = {"overlap": overlap, "sub_group_size": "1KiB"}
    if overlap_disk is not None:
        optimizer["overlap_disk"] = overlap_disk
    cfg = config(path, NVME, optimizer=optimizer)
    cfg["nvme"].update(nvme)
    return cfg


def _step(engine, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = ((engine(x) - y) ** 2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def _fake_free(monkeypatch, free: int) -> None:
    """statvfs says every filesystem has ``free`` bytes left."""
    monkeypatch.setattr(_footprint.os, "statvfs", lambda path: types.SimpleNamespace(f_bavail=free // 4096, f_frsize=4096))


def _state_on_disk(space) -> int:
    """Aligned bytes the tensors under their real names take in ``space``, from its records."""
    return sum(round_up(e.nbytes) for n in space.names() if "~next" not in n for e in space.info(n).extents)


def test_initialize_refuses_a_state_larger_than_the_free_space(tmp_path, monkeypatch):
    _fake_free(monkeypatch, 64 << 10)  # the state of _mlp on nvme alone is over 64KiB in 4KiB pages
    with pytest.raises(ValueError) as info:
        infinity.initialize(_mlp(), _cfg(tmp_path, False))
    message = str(info.value)
    assert str(tmp_path) in message and "64KiB free" in message and "fewer tiers on nvme" in message
    assert list(tmp_path.iterdir()) == []  # nothing left behind: no arena, lock or manifest


@pytest.mark.parametrize("made", [False, True], ids=["path-existed", "path-made"])
def test_initialize_refuses_a_state_larger_than_the_disk_budget_and_leaves_nothing(tmp_path, made):
    swap = tmp_path / "swap" if made else tmp_path  # a missing last component is made by the space
    with pytest.raises(ValueError, match=r"nvme.disk_budget=8KiB"):
        infinity.initialize(_mlp(), _cfg(swap, False, disk_budget="8KiB"))
    assert list(tmp_path.iterdir()) == []  # the refused run's arena, .lock and manifest are gone
    engine = infinity.initialize(_mlp(), _cfg(swap, False))  # and the directory takes the next run
    _step(engine, 0)
    engine.close()


def test_footprint_counts_the_state_as_written(tmp_path):
    engine = infinity.initialize(_mlp(), _cfg(tmp_path, True))
    engine.plan.held = 0  # every gradient on disk, as the footprint plans for
    try:
        _step(engine, 0)
        engine.space.flush()
        disk = engine.stats()["disk"]
        (path, figures), = disk.items()
        assert path == engine.space.rank_dirs[0]
        assert figures["state_bytes"] == _state_on_disk(engine.space)
        # every sub-group staged at once, without a budget: the staging counted too
        assert figures["peak_bytes"] > figures["state_bytes"]
        assert figures["arena_bytes"] == engine.space.arena_sizes()[0] <= figures["cap_bytes"]
    finally:
        engine.close()


def _train(path, overlap: bool, steps: int = 4, model=_mlp, **cfg):
    engine = infinity.initialize(model(), _cfg(path, overlap, **cfg))
    try:
        losses, committed, arenas = [], [], []
        for step in range(steps):
            losses.append(_step(engine, step))
            committed.append(engine.overlap.committed if engine.overlap else 0)
            arenas.append(engine.space.arena_sizes()[0])
        return losses, engine.gathered_weights(), committed, arenas, engine.footprint
    finally:
        engine.close()


def test_overlap_stages_only_what_the_disk_budget_allows(tmp_path):
    probe = infinity.initialize(_mlp(), _cfg(tmp_path / "probe", True, overlap_disk=1.0))
    state, staging = probe.footprint.state[0], probe.footprint.staging[0]
    groups = len(probe.optimizer.groups)
    probe.close()
    budget = round_up(state + staging // 2)  # the state and about half the sub-groups staged
    off = _train(tmp_path / "off", False)
    on = _train(tmp_path / "on", True, overlap_disk=1.0, disk_budget=budget)
    assert on[0] == off[0]
    for k in off[1]:
        assert torch.equal(on[1][k], off[1][k]), k  # exact: the step updated what was not staged
    assert all(0 < c < groups for c in on[2]), on[2]
    assert max(on[3]) <= budget, (on[3], budget)


def test_no_disk_for_staged_copies_runs_the_optimizer_after_backward(tmp_path):
    """optimizer.overlap_disk 0 leaves no disk beside the state for a sub-group's staged
    copies: the plan turns the overlap off (no share of the budget is kept for it), and the
    run is the one without it, bit for bit."""
    off = _train(tmp_path / "off", False)
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "zero", True, overlap_disk=0.0))
    try:
        assert engine.footprint.staging_room == 0
        assert engine.plan.overlap == 0 and engine.overlap is None
        losses = [_step(engine, step) for step in range(len(off[0]))]
        got = engine.gathered_weights()
    finally:
        engine.close()
    assert losses == off[0]
    assert all(torch.equal(got[k], off[1][k]) for k in off[1])


def _layers() -> nn.Module:
    torch.manual_seed(0)  # five 66KiB units and two small ones, a sub-group each (1KiB sub-groups)
    hidden = [nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(5)]
    return nn.Sequential(nn.Linear(16, 128), *hidden, nn.Linear(128, 4))


@pytest.mark.parametrize("overlap_disk", [None, 0.5])  # None: the default, 0.3
def test_the_arena_stays_within_the_state_and_overlap_disk_of_it(tmp_path, overlap_disk):
    fraction = 0.3 if overlap_disk is None else overlap_disk
    off = _train(tmp_path / "off", False, steps=5, model=_layers)
    on = _train(tmp_path / "on", True, steps=5, model=_layers, overlap_disk=overlap_disk)
    assert on[0] == off[0]
    for k in off[1]:
        assert torch.equal(on[1][k], off[1][k]), k  # exact: the step updated what was not staged
    state = on[4].state[0]
    groups = 7
    # some sub-groups staged, not all: every one would take 0.8 x the state beside it
    assert all(0 < c < groups for c in on[2]), on[2]
    assert max(on[3]) <= round_up(int(state * (1 + fraction))), (on[3], state)
    # what a commit frees is taken again by the next step's staged copies: no growth after the first step
    assert on[3][1:] == [on[3][1]] * 4, on[3]


def test_a_disk_full_in_a_staged_write_refuses_until_a_checkpoint_loads(tmp_path, monkeypatch):
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "swap", True))
    try:
        _step(engine, 0)
        engine.save_checkpoint(tmp_path / "ckpt")
        put = SwapSpace.put
        arena = engine.space.files[0].path

        def full(self, name, tensor, **kw):
            if "~next/" in name:  # a staged tensor: see [Note: exact overlap]
                raise OSError(errno.ENOSPC, "cannot grow the arena file: No space left on device", arena)
            return put(self, name, tensor, **kw)

        monkeypatch.setattr(SwapSpace, "put", full)
        with pytest.raises(OSError, match="is full") as info:
            _step(engine, 1)
        assert arena in str(info.value) and "load a checkpoint" in str(info.value)
        monkeypatch.setattr(SwapSpace, "put", put)  # the disk has room again
        with pytest.raises(RuntimeError, match="is full"):
            _step(engine, 1)
        assert not [n for n in engine.space.names() if "~next" in n]
        engine.zero_grad()
        engine.load_checkpoint(tmp_path / "ckpt")
        _step(engine, 1)
    finally:
        engine.close()


def test_footprint_per_drive_follows_the_stripes(tmp_path):
    cfg = _cfg(tmp_path / "a", False, stripe_threshold=0, stripe_size="4KiB")
    cfg["nvme"]["paths"] = [str(tmp_path / "a"), str(tmp_path / "b")]
    engine = infinity.initialize(_mlp(), cfg)
    engine.plan.held = 0  # every gradient on disk, as the footprint plans for
    try:
        _step(engine, 0)
        space = engine.space
        on_disk = [0, 0]
        for name in space.names():
            for e in space.info(name).extents:
                on_disk[e.file] += round_up(e.nbytes)
        disk = engine.stats()["disk"]
        assert [disk[d]["state_bytes"] for d in space.rank_dirs] == on_disk
        assert all(n > 0 for n in on_disk)  # both drives hold a share
    finally:
        engine.close()


def test_a_write_past_the_cap_names_the_arena(tmp_path):
    from infinity.swap import OutOfSpace

    engine = infinity.initialize(_mlp(), _cfg(tmp_path, False))
    try:
        engine.space.limit(engine.space.arena_sizes())  # no growth at all from here
        with pytest.raises(OutOfSpace, match=str(engine.space.files[0].path)):
            engine.space.put("big", torch.zeros(engine.space.arena_sizes()[0] // 4 + 1)).result()
    finally:
        engine.close()
