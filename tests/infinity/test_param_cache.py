"""Parameters kept in the host pool between uses ([Note: parameters kept in the pool] in
infinity/_param_cache.py): a fetch of unchanged bytes is lent the kept buffer, any write by
any path makes the next fetch read the drive, and training is the same as with every fetch read."""

import copy

import pytest
import torch

import infinity
from infinity._stats import Stats
from infinity._store import Store
from infinity.swap import HostBufferPool, SwapSpace

from ._common import config, make_model, train


@pytest.fixture
def space(tmp_path):
    pool = HostBufferPool(64 << 20)
    with SwapSpace(str(tmp_path / "swap"), pool=pool, grow_step=1 << 20) as s:
        yield s
    pool.close()


def _kept_store(space, stats=None):
    return Store("nvme", "param", device=torch.device("cpu"), space=space, stats=stats or Stats(),
                 keep_in_pool=True)  # fmt: skip


def _lent(store, name):
    """(values, whether the fetch was lent a kept buffer), the lease released."""
    before = store._stats.total.param_cache_bytes
    lease = store.get(name, kept=True).result()
    try:
        return lease.tensor.clone(), store._stats.total.param_cache_bytes > before
    finally:
        lease.release()


# -- the store ---------------------------------------------------------------------------------
def test_a_copied_write_is_lent_to_the_next_fetch_and_any_other_write_is_read(space):
    store = _kept_store(space)
    a, b = torch.arange(1000, dtype=torch.float32), -torch.arange(1000, dtype=torch.float32)
    store.put("w", a, copy=True).result()
    assert space.pool.in_use_bytes == 0 and space.pool.aside_bytes > 0  # kept, counted free
    values, lent = _lent(store, "w")
    assert lent and torch.equal(values, a)
    store.put("w", b).result()  # written from the caller's tensor: nothing kept matches now
    values, lent = _lent(store, "w")
    assert not lent and torch.equal(values, b)
    values, lent = _lent(store, "w")  # the read's buffer was kept once released
    assert lent and torch.equal(values, b)
    before = store._stats.total.param_cache_bytes
    plain = store.get("w").result()  # a fetch without kept=True reads, into a buffer of its own
    try:
        assert torch.equal(plain.tensor, b) and store._stats.total.param_cache_bytes == before
    finally:
        plain.release()
    values, lent = _lent(store, "w")  # and the kept buffer is still there for the next one
    assert lent and torch.equal(values, b)
    space.put("w/param", a).result()  # behind the store's back: the record changes all the same
    values, lent = _lent(store, "w")
    assert not lent and torch.equal(values, a)


def test_a_kept_buffer_follows_a_rename_and_goes_with_a_discard(space):
    store = _kept_store(space)
    a = torch.arange(64, dtype=torch.float32)
    store.put("w.staged", a, copy=True).result()
    store.put("w", torch.zeros(64), copy=True).result()
    store.rename("w.staged", "w")
    values, lent = _lent(store, "w")
    assert lent and torch.equal(values, a)
    store.discard("w")
    assert space.pool.aside_bytes == 0
    with pytest.raises(KeyError, match="w/param"):
        store.get("w", kept=True)


def test_one_borrower_at_a_time_and_a_replaced_loan_goes_back_to_the_pool(space):
    store = _kept_store(space)
    a, b = torch.ones(256), torch.full((256,), 2.0)
    store.put("w", a, copy=True).result()
    first = store.get("w", kept=True).result()  # lent
    second = store.get("w", kept=True).result()  # lent already: read
    assert first.tensor.data_ptr() != second.tensor.data_ptr()
    assert torch.equal(first.tensor, a) and torch.equal(second.tensor, a)
    store.put("w", b, copy=True).result()  # replaces what is kept while it is lent
    first.release()
    second.release()  # the read's buffer: its record is not the key's now, lent never
    assert space.pool.in_use_bytes == 0
    values, lent = _lent(store, "w")
    assert lent and torch.equal(values, b)


def test_the_pool_takes_the_room_of_kept_buffers_before_it_waits(tmp_path):
    pool = HostBufferPool(4 << 20, slab_size=4 << 20)
    with SwapSpace(str(tmp_path / "swap"), pool=pool, grow_step=1 << 20) as space:
        store = _kept_store(space)
        for i in range(8):  # each 256 KiB: half the budget kept
            store.put(f"w{i}", torch.full((65536,), float(i)), copy=True).result()
        assert pool.aside_bytes == 2 << 20
        held = pool.acquire(2 << 20, timeout=0)  # the free half: nothing kept gives way
        assert pool.aside_bytes == 2 << 20
        more = pool.acquire(256 << 10, timeout=0)  # no wait: the longest kept (w0) gives way
        assert pool.aside_bytes == (2 << 20) - (256 << 10)
        more.release()
        assert [_lent(store, f"w{i}")[1] for i in (1, 0)] == [True, False]
        assert all(torch.equal(_lent(store, f"w{i}")[0], torch.full((65536,), float(i))) for i in range(8))
        held.release()
    pool.close()


# -- the engine ----------------------------------------------------------------------------------
PLACEMENTS = ("nvme,cpu,cpu", "nvme,nvme,nvme", "nvme,nvme,cpu")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_kept_parameters_train_as_read_ones_and_no_parameter_is_read_after_the_first_step(
        tmp_path, engines, placement, dtype):  # fmt: skip
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    losses, weights, reads = {}, {}, {}
    for keep in (True, False):
        cfg = config(tmp_path / f"swap{keep}", placement.split(","), precision={"param_dtype": dtype},
                     memory={"keep_params": keep})  # fmt: skip
        engine = infinity.initialize(make_model(), cfg)
        engines.append(engine)
        losses[keep] = train(engine, 2, dtype=torch_dtype)
        step = engine.stats()["step"]
        reads[keep] = (step["nvme"]["by_kind"].get("param", {}).get("read_bytes", 0), step["param_cache_bytes"])
        losses[keep] += train(engine, 2, start=2, dtype=torch_dtype)
        with infinity.GatheredParameters(list(engine.module.parameters())):
            weights[keep] = [p.detach().clone() for p in engine.module.parameters()]
    assert losses[True] == losses[False]
    assert all(torch.equal(a, b) for a, b in zip(weights[True], weights[False]))
    assert reads[False][0] > 0 and reads[False][1] == 0, reads
    if placement == "nvme,nvme,nvme" and dtype == "fp32":
        # One copy of the fp32 weights: the parameters are the master weights, which the
        # optimizer's stream writes back from its own buffers (not kept: read each step).
        assert reads[True] == reads[False]
    else:
        assert reads[True][0] == 0 and reads[True][1] > 0, reads


@pytest.mark.parametrize("placement", PLACEMENTS[:2])
def test_a_checkpoint_load_and_load_state_dict_are_what_the_next_forward_sees(tmp_path, engines, placement):
    cfg = config(tmp_path / "swap", placement.split(","))
    engine = infinity.initialize(make_model(), cfg)
    engines.append(engine)
    engine.eval()  # no dropout: one forward is compared with another
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(9))
    train(engine, 1)
    engine.save_checkpoint(tmp_path / "ck")
    with torch.no_grad():
        saved = engine(x)
    train(engine, 2, start=1)  # new parameters, kept in the pool
    engine.load_checkpoint(tmp_path / "ck")
    with torch.no_grad():
        assert torch.equal(engine(x), saved)  # not the kept values of the steps after the save
    other = make_model(seed=3)
    engine.module.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(engine(x), other.eval()(x))
    train(engine, 1, start=3)
    with torch.no_grad():
        assert not torch.equal(engine(x), other(x))


def test_a_small_host_budget_gives_the_kept_buffers_up_and_trains_the_same(tmp_path, engines):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), *[torch.nn.Linear(256, 256) for _ in range(30)],
                                torch.nn.Linear(256, 4))  # 3.9 MB of bf16 parameters  # fmt: skip
    losses, step = {}, {}
    for keep in (True, False):
        cfg = config(tmp_path / f"swap{keep}", ("nvme", "nvme", "nvme"), precision={"param_dtype": "bf16"},
                     memory={"keep_params": keep, "host_budget": "5MiB"},
                     optimizer={"sub_group_size": 300_000})  # fmt: skip
        engine = infinity.initialize(copy.deepcopy(model), cfg)
        engines.append(engine)
        losses[keep] = train(engine, 4, dtype=torch.bfloat16)
        step[keep] = engine.stats()["step"]
        assert engine.pool.allocated_bytes <= 5 << 20
    assert losses[True] == losses[False]
    read = step[True]["nvme"]["by_kind"]["param"]["read_bytes"]
    assert read > 0 and step[True]["param_cache_bytes"] > 0, (read, step[True]["param_cache_bytes"])  # some kept, the rest read


def test_parameters_written_under_backward_are_kept_through_their_rename(tmp_path, engines, monkeypatch):
    """nvme,cpu,cpu as on a GPU (forced here on the host): an early update writes its new
    parameters under staged names under backward and the commit renames them; the kept buffer
    goes with the rename, and training is the same as with every parameter read."""
    import infinity._overlap_host as overlap_host

    monkeypatch.setattr(overlap_host, "stages_params", lambda device, store: store.uses_pool)
    losses, step = {}, {}
    for keep in (True, False):
        cfg = config(tmp_path / f"swap{keep}", ("nvme", "cpu", "cpu"), precision={"param_dtype": "bf16"},
                     memory={"keep_params": keep}, optimizer={"overlap": True, "overlap_disk": 1.0})  # fmt: skip
        engine = infinity.initialize(make_model(), cfg)
        engines.append(engine)
        losses[keep] = train(engine, 3, dtype=torch.bfloat16)
        step[keep] = engine.stats()["step"]
        assert engine.overlap.committed > 0
    assert losses[True] == losses[False]
    assert step[True]["nvme"]["by_kind"]["param"].get("read_bytes", 0) == 0, step[True]["nvme"]["by_kind"]
    assert step[False]["nvme"]["by_kind"]["param"]["read_bytes"] > 0


def test_the_overlap_s_staged_copies_bound_what_the_pool_keeps(tmp_path, engines):
    """nvme,cpu,cpu with the optimizer under backward: its staged copies are host memory beside
    the pool in the same budget, so kept buffers grow no slab into their share (the pool is no
    larger than without keep_params, or than the budget less the staged copies), and training
    is the same as with every parameter read."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), *[torch.nn.Linear(256, 256) for _ in range(30)],
                                torch.nn.Linear(256, 4))  # fmt: skip
    losses, allocated = {}, {}
    for keep in (True, False):
        cfg = config(tmp_path / f"swap{keep}", ("nvme", "cpu", "cpu"), precision={"param_dtype": "bf16"},
                     memory={"keep_params": keep, "host_budget": "5MiB"},
                     optimizer={"overlap": True, "sub_group_size": 300_000})  # fmt: skip
        engine = infinity.initialize(copy.deepcopy(model), cfg)
        engines.append(engine)
        allocated[keep] = engine.pool.allocated_bytes  # what initialize's writes grew
        losses[keep] = train(engine, 4, dtype=torch.bfloat16)
        staging = engine.plan.staging
        assert staging > 0 and engine.overlap.committed > 0
        if keep:
            assert engine.stats()["step"]["param_cache_bytes"] > 0
            bound = max(allocated[keep], (5 << 20) - staging)
            assert engine.pool.allocated_bytes <= bound, (engine.pool.allocated_bytes, allocated[keep], staging)
    assert losses[True] == losses[False]
