"""Gradients copied back from the device asynchronously ([Note: gradients copied back] in
infinity/_grads.py), on the CPU: a stand-in for the CUDA side stream lands each copy late, and
poisons the destination until then, so a reader that does not wait for the copy reads NaN and
the run no longer matches the one whose gradients never left host memory."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import config  # noqa: E402

MICRO = 2


class _Late:
    """A copy that lands only when waited for, or after ``polls`` calls of `done`."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, polls: int, log: list):
        self._src, self._dst, self._polls, self._log = src, dst, polls, log
        self._landed = False

    def done(self) -> bool:
        self._polls -= 1
        if self._polls <= 0:
            self.wait()
        return self._landed

    def wait(self) -> None:
        if not self._landed:
            self._dst.copy_(self._src)
            self._landed = True
            self._log.append("landed")


class _LateCopies:
    """Stands in for `_transport.Copies` (its `start`): the source is read when the copy lands (as the GPU
    reads it after backward's queued work), the destination is NaN until then."""

    def __init__(self, polls: int = 3):
        self.polls = polls
        self.log: list[str] = []
        self.started = 0

    def start(self, src: torch.Tensor, dst: torch.Tensor) -> _Late:
        dst.fill_(float("nan"))
        self.started += 1
        self.log.append("started")
        return _Late(src, dst, self.polls, self.log)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), *[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)],
                         nn.Linear(64, 4))  # fmt: skip


def _train(path, tiers, late: _LateCopies | None, *, overlap: bool, clip: float | None = None, steps: int = 3,
           zero_midway: bool = False, micro: int = MICRO):  # fmt: skip
    cfg = config(path, tiers, optimizer={"overlap": overlap, "sub_group_size": "16KiB", "max_grad_norm": clip,
                                         "gradient_accumulation_steps": micro})  # fmt: skip
    engine = infinity.initialize(_model(), cfg)
    try:
        if late is not None:
            # Gradients as a GPU makes them: outside host memory, copied back by the copier.
            engine.scheduler.runtime.grads_in_pool = False
            engine.grads.copier = late
            engine.grads.store.in_place_on = lambda device: False
        losses = []
        for step in range(steps):
            for m in range(micro):
                g = torch.Generator().manual_seed(step * micro + m)
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                loss = ((engine(x) - y) ** 2).mean()
                engine.backward(loss)
                losses.append(loss.item())
                if zero_midway and step == 1 and m == 0:
                    engine.zero_grad()  # copies may be in flight: their buffers go back after they land
            engine.step()
        return losses, engine.gathered_weights()
    finally:
        engine.close()


@pytest.mark.parametrize("micro", [1, MICRO], ids=["one", "accumulated"])
@pytest.mark.parametrize("overlap", [False, True], ids=["after-backward", "overlap"])
@pytest.mark.parametrize("tiers", [("nvme", "nvme", "nvme"), ("nvme", "cpu", "cpu"), ("cpu", "cpu", "cpu")],
                         ids=["nvme", "host-grads", "cpu"])  # fmt: skip
def test_gradients_copied_back_late_train_bit_identically(tmp_path, tiers, overlap, micro):
    want = _train(tmp_path / "a", tiers, None, overlap=overlap, micro=micro)
    late = _LateCopies(polls=1000)  # lands only when a reader waits for it
    got = _train(tmp_path / "b", tiers, late, overlap=overlap, micro=micro)
    # every unit's gradient of every micro-batch went through the copier, and none was read early
    assert late.started == 3 * micro * 8, late.started
    assert late.log.count("landed") == late.started
    assert got[0] == want[0]
    for k in want[1]:
        assert torch.equal(got[1][k], want[1][k]), k


def test_gradients_copied_back_late_with_clipping_and_zero_grad(tmp_path):
    tiers = ("nvme", "nvme", "nvme")
    want = _train(tmp_path / "a", tiers, None, overlap=True, clip=0.05, zero_midway=True)
    got = _train(tmp_path / "b", tiers, _LateCopies(polls=1000), overlap=True, clip=0.05, zero_midway=True)
    assert got[0] == want[0]
    for k in want[1]:
        assert torch.equal(got[1][k], want[1][k]), k


def test_a_copy_that_fails_fails_its_backward(tmp_path):
    """The copy's error is the backward's (the end of backward waits for the last copies): the
    step refuses the partial gradients, zero_grad gives every landing buffer back, and the
    micro-batch runs again."""

    class _Failing(_LateCopies):
        def start(self, src, dst):
            copy = super().start(src, dst)

            def wait():
                raise RuntimeError("CUDA error: the copy failed")

            copy.wait = wait
            copy.done = lambda: False
            return copy

    cfg = config(tmp_path, ("nvme", "nvme", "nvme"), optimizer={"overlap": False})
    engine = infinity.initialize(_model(), cfg)
    try:
        engine.scheduler.runtime.grads_in_pool = False
        engine.grads.copier = _Failing()
        x = torch.randn(8, 16)
        with pytest.raises(RuntimeError, match="the copy failed"):
            engine.backward(engine(x).pow(2).mean())
        with pytest.raises(RuntimeError, match="zero_grad"):
            engine.step()  # not on part of a gradient
        engine.zero_grad()
        assert engine.pool.in_use_bytes == 0  # no landing buffer kept
        engine.grads.copier = None
        engine.backward(engine(x).pow(2).mean())
        engine.step()  # the step starts over cleanly
    finally:
        engine.close()


def test_copies_into_pool_buffers_stay_within_the_backward_plan(tmp_path):
    """However late the copies land, at most ``max_writes`` gradients are in pool buffers on
    their way (landing or being written) when another copy starts: what the engine's plan gives
    backward beside its fetches."""
    cfg = config(tmp_path, ("nvme", "nvme", "nvme"), optimizer={"overlap": False})
    engine = infinity.initialize(_model(), cfg)
    grads, seen = engine.grads, []

    class _Watched(_LateCopies):
        def start(self, src, dst):
            seen.append(sum(1 for x in grads._landing.values() if x.buffer is not None) + len(grads._writes))
            return super().start(src, dst)

    try:
        engine.scheduler.runtime.grads_in_pool = False
        grads.copier = _Watched(polls=1000)
        for _ in range(2):
            engine.backward(engine(torch.randn(8, 16)).pow(2).mean())
            engine.step()
        assert len(seen) == 16 and max(seen) <= grads.max_writes, seen
        assert max(seen) == grads.max_writes  # the bound is reached: copies do wait for room
    finally:
        engine.close()


def test_a_copy_back_that_finds_the_pool_full_makes_others_give_way(tmp_path):
    """A gradient copied back into a pool buffer is backward's own transfer, needed now: when
    the pool is full, what waits there for later gives way (`Admission.take_for_backward`), as
    for a gradient gathered on the host, rather than the hook waiting out the pool's timeout.
    Here the pool is filled before each backward by buffers that give way when asked."""
    tiers = ("nvme", "nvme", "nvme")
    want = _train(tmp_path / "a", tiers, None, overlap=False)
    cfg = config(tmp_path / "b", tiers, optimizer={"overlap": False, "sub_group_size": "16KiB",
                                                   "gradient_accumulation_steps": MICRO},
                 memory={"host_budget": "1MiB"})  # fmt: skip
    engine = infinity.initialize(_model(), cfg)
    hog, asked = [], []

    def give_back():
        asked.append(len(hog))
        while hog:
            hog.pop().release()

    try:
        engine.pool.timeout = 2.0  # a hook that waits would fail the backward with PoolExhausted
        engine.admission.give_way("test", give_back)
        engine.scheduler.runtime.grads_in_pool = False
        engine.grads.copier = _LateCopies(polls=1000)
        engine.grads.store.in_place_on = lambda device: False
        losses = []
        for step in range(3):
            for m in range(MICRO):
                g = torch.Generator().manual_seed(step * MICRO + m)
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                out = engine(x)  # the parameters fetched first: then nothing but the copies needs the pool
                while True:
                    try:
                        hog.append(engine.pool.acquire(4096, timeout=0))
                    except infinity.swap.PoolExhausted:
                        break
                loss = ((out - y) ** 2).mean()
                engine.backward(loss)
                give_back()
                losses.append(loss.item())
            engine.step()
        assert losses == want[0]
        got = engine.gathered_weights()
        for k in want[1]:
            assert torch.equal(got[k], want[1][k]), k
        assert sum(1 for n in asked if n) >= 3 * MICRO  # every backward found the pool full
    finally:
        give_back()
        engine.close()
