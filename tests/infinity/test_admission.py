"""Pool admission ([Note: traffic classes] in infinity/_admission.py): what gives way to a
transfer needed now, the budget's shares, and the activation tier inside its share."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity
from infinity._admission import ACTIVATION_CHUNK, ACTIVATION_CHUNKS, BRIEF_WAIT, Admission, Plan, activation_chunk
from infinity._resources import HostBudgetError
from infinity.swap import HostBufferPool, PoolExhausted

sys.path.insert(0, os.path.dirname(__file__))
from _common import config  # noqa: E402

MiB = 1 << 20


class _Pool:
    """Has room once ``frees`` of the registered give-ways have run; records the timeouts asked."""

    def __init__(self, frees: int | None):
        self.frees, self.freed, self.asked = frees, 0, []

    def take(self, timeout):
        self.asked.append(timeout)
        if timeout is None or (self.frees is not None and self.freed >= self.frees):
            return "buffer"
        raise PoolExhausted("full", asked=1, budget=1, held=1, buffers=1, free=0)


def _admission(pool, calls):
    admission = Admission(pool=None, plan=Plan(budget=0, usable=0))
    for what in ("prefetch", "activation", "kept", "overlap", "grad"):
        admission.give_way(what, lambda what=what: (calls.append(what), setattr(pool, "freed", pool.freed + 1)))
    return admission


def test_a_transfer_needed_now_takes_what_is_free_without_anything_giving_way():
    pool, calls = _Pool(frees=0), []
    assert _admission(pool, calls).take_now(pool.take) == "buffer"
    assert calls == [] and pool.asked == [0]


def test_the_others_give_way_in_order_until_it_fits():
    pool, calls = _Pool(frees=2), []
    assert _admission(pool, calls).take_now(pool.take) == "buffer"
    assert calls == ["prefetch", "activation"]  # kept units, the overlap and held gradients stay
    assert pool.asked == [0, 0, 0]


def test_it_waits_only_once_everything_gave_way_what_it_spares_last():
    pool, calls = _Pool(frees=None), []
    assert _admission(pool, calls).take_now(pool.take, last=("prefetch",)) == "buffer"
    assert calls == ["activation", "kept", "overlap", "grad", "prefetch"]
    # a brief wait for what is on its way back before the prefetches go; then the pool's own wait
    assert pool.asked == [0, 0, 0, 0, 0, BRIEF_WAIT, 0, None]


def test_a_gradient_buffer_in_a_fragmented_pool_gets_the_room_of_the_prefetches():
    # Audit J's floor case, 7 runs in 24: the bytes free, not in one piece, the prefetches
    # between them; backward spared them and waited out the pool's timeout for reads only it uses.
    page = 4096
    pool = HostBufferPool(4 * page, slab_size=4 * page, alignment=page, timeout=0.5)
    a, p, held, c = (pool.acquire(page) for _ in range(4))  # first-fit: pages 0, 1, 2, 3
    a.release()
    c.release()  # pages 0 and 3 free: 8 KiB, in two pieces
    admission = Admission(pool=pool, plan=Plan(budget=4 * page, usable=4 * page))
    admission.give_way("prefetch", p.release)
    start = time.monotonic()
    buffer = admission.take_for_backward(2 * page)  # was: PoolExhausted "8KiB free but fragmented"
    assert buffer.nbytes == 2 * page and p.released and time.monotonic() - start < 0.5
    buffer.release()
    held.release()


def test_the_activation_chunk_follows_the_budget():
    assert activation_chunk(4 << 30) == ACTIVATION_CHUNK
    small = activation_chunk(40 * MiB)
    assert small % 4096 == 0 and ACTIVATION_CHUNKS * small <= 40 * MiB // 4
    assert activation_chunk(4096) == 4096  # at least a page


class _Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, hidden, layers):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(hidden) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def _cfg(path, tier, budget):
    return config(path, ("nvme", "nvme", "nvme"), memory={"host_budget": budget},
                  optimizer={"overlap": False, "sub_group_size": "1MiB"},
                  activations={"tier": tier, "min_bytes": "64KiB"})  # fmt: skip


def _need(path, tier, hidden, layers) -> HostBudgetError:
    with pytest.raises(HostBudgetError) as info:
        infinity.initialize(_Stack(hidden, layers), _cfg(path, tier, 4096))
    return info.value


def _train(path, tier, budget, hidden, layers, tokens, steps=2):
    torch.manual_seed(0)
    model, x = _Stack(hidden, layers), torch.randn(tokens, hidden)
    with infinity.initialize(model, _cfg(path, tier, budget)) as engine:
        losses = []
        for _ in range(steps):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses, engine.gathered_weights(), engine.stats()


def test_forward_and_backward_plan_the_activation_share(tmp_path):
    """With activations on nvme, what forward and backward need at most includes the tier's
    chunks: the budget initialize accepts has room for them beside the parameters' fetches."""
    device, nvme = _need(tmp_path / "d", "device", 256, 2), _need(tmp_path / "n", "nvme", 256, 2)
    extra = nvme.needs["forward/backward"] - device.needs["forward/backward"]
    assert extra == ACTIVATION_CHUNKS * activation_chunk(int(4096 * 0.85))


def test_activations_larger_than_the_budget_move_in_chunks_within_their_share(tmp_path):
    """Each block's input is 16 MiB; the budget is 8 MiB: the tier moves them through the pool
    a chunk at a time, never past its share, and the run is the one with activations on the
    device (where a tensor went through one pool buffer, this waited 60 s and raised)."""
    want = _train(tmp_path / "device", "device", "8MiB", 256, 4, 16384)
    got = _train(tmp_path / "nvme", "nvme", "8MiB", 256, 4, 16384)
    assert got[0] == want[0]
    for k in want[1]:
        assert torch.equal(got[1][k], want[1][k]), k
    pool = got[2]["pool"]
    share = pool["shares"]["activation"]
    assert 0 < pool["by_traffic"]["activation"]["peak_bytes"] <= share < 8 * MiB
    assert got[2]["step"]["activation_out_bytes"] == 4 * 16 * MiB
    assert "activation" not in want[2]["pool"]["by_traffic"]


def test_the_smallest_budget_initialize_accepts_trains_with_activations_on_nvme(tmp_path):
    """At the budget initialize asks for, nothing waits on the pool for good: parameter fetches,
    gradients and activation chunks share it as planned."""
    need = _need(tmp_path / "need", "nvme", 512, 4).need
    want = _train(tmp_path / "device", "device", need, 512, 4, 4096)
    got = _train(tmp_path / "nvme", "nvme", need, 512, 4, 4096)
    assert got[0] == want[0]
    by = got[2]["pool"]["by_traffic"]
    assert by["activation"]["peak_bytes"] <= got[2]["pool"]["shares"]["activation"]
    assert got[2]["step"]["activation_out_bytes"] == 4 * 4096 * 512 * 4  # every block's input went


def test_planning_at_another_budget_changes_nothing_of_a_running_engine(tmp_path):
    """The plan is a function of the engine's layout: planned again at a budget whose step reads
    fewer sub-groups ahead (as the estimate's bisection does), the engine keeps its own plan's
    read-ahead and shares, and steps as before."""
    from infinity import _admission
    from infinity._layout import Layout
    from infinity._update import ReadAhead

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    cfg = config(tmp_path, ("nvme",) * 3, memory={"host_budget": "256MiB"},
                 optimizer={"sub_group_size": "1MiB", "overlap": False})  # fmt: skip
    with infinity.initialize(model, cfg) as engine:
        assert engine.optimizer.read_ahead == ReadAhead()
        shares = dict(vars(engine.plan))
        layout = Layout(engine.units, engine.device, engine.dtype, engine.param_store, engine.grads.store,
                        engine.optimizer.substates, engine.transport, engine.space, engine.dist,
                        engine.grads_full)  # fmt: skip
        state = engine.optimizer.groups[0].record.state_bytes(engine.optimizer.kinds)
        tight = _admission.make_plan(layout, _at_budget(cfg, 13 * state // 2), activations_in_pool=False)
        assert tight.read_ahead.bytes is not None and tight.read_ahead.bytes < 3 * state  # it did plan less
        assert engine.optimizer.read_ahead == ReadAhead() and dict(vars(engine.plan)) == shares
        engine.backward(engine(torch.randn(4, 256)).sum())
        assert engine.step()


def _at_budget(cfg: dict, budget: int) -> infinity.TierConfig:
    return infinity.TierConfig.from_dict({**cfg, "memory": {"host_budget": budget}})


@pytest.mark.parametrize("tiers, overlap, activations, late", [
    (("nvme", "nvme", "nvme"), True, "nvme", False), (("nvme", "nvme", "nvme"), False, "device", False),
    (("nvme", "nvme", "nvme"), True, "device", True), (("nvme", "cpu", "cpu"), True, "device", False),
    (("cpu", "nvme", "cpu"), False, "nvme", False),
], ids=["nvme-overlap-activations", "nvme", "nvme-overlap-copied-back", "host-states-overlap", "grads-on-nvme"])  # fmt: skip
def test_every_buffer_taken_while_training_names_its_class(tmp_path, monkeypatch, tiers, overlap, activations, late):
    """stats()["pool"] says what holds the budget by class: a buffer taken in forward, backward
    or the step under "other" (what names none) would hide what took it. Such were the
    activation tier's staged tails on the host, and the early updates that the end of backward
    starts (``late``: gradients copied back as from a GPU, landing only at the end of backward,
    by the stand-in of tests/infinity/test_copy_back.py)."""
    from test_copy_back import _LateCopies, _model

    from infinity.swap import _pool

    torch.manual_seed(0)
    model = _model()
    cfg = config(tmp_path, tiers, optimizer={"overlap": overlap, "sub_group_size": "16KiB",
                                             "gradient_accumulation_steps": 2},
                 activations={"tier": activations, "min_bytes": 0},
                 memory={"host_budget": "1MiB" if late else "256MiB"})  # fmt: skip
    engine = infinity.initialize(model, cfg)
    if late:
        engine.scheduler.runtime.grads_in_pool = False
        engine.grads.copier = _LateCopies(polls=1000)
        engine.grads.store.in_place_on = lambda device: False
    taken: list[str] = []
    acquire = _pool.HostBufferPool.acquire

    def named(self, nbytes, timeout=None, *, traffic=None):
        taken.append(traffic or self._counts.label())
        return acquire(self, nbytes, timeout, traffic=traffic)

    monkeypatch.setattr(_pool.HostBufferPool, "acquire", named)
    try:
        for step in range(3):
            for m in range(2):
                x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2 * step + m))
                engine.backward(engine(x).pow(2).mean())
            engine.step()
    finally:
        engine.close()
    assert taken and _pool.OTHER not in taken, sorted(set(taken))
