"""Store: every tier lends a Lease from get and takes a tensor in put, the same way."""

import pytest
import torch

from infinity._stats import Stats
from infinity._store import Pending, Store, stream_together
from infinity.swap import HostBufferPool, SwapSpace

TIERS = ("device", "cpu", "nvme")


@pytest.fixture
def space(tmp_path):
    pool = HostBufferPool(64 << 20)
    with SwapSpace(str(tmp_path), pool=pool, grow_step=1 << 20) as s:
        yield s
    pool.close()


def _store(tier, space, kind="param"):
    return Store(tier, kind, device=torch.device("cpu"), space=space, stats=Stats())


@pytest.mark.parametrize("tier", TIERS)
def test_put_then_get_lends_the_values_and_release_is_idempotent(tier, space):
    store = _store(tier, space)
    value = torch.arange(10, dtype=torch.float32)
    store.put("u", value).result()
    lease = store.get("u").result()
    assert torch.equal(lease.tensor, value) and lease.tensor.dtype == torch.float32
    lease.release()
    lease.release()
    assert space.pool.in_use_bytes == 0


@pytest.mark.parametrize("tier", TIERS)
def test_get_change_in_place_put_is_one_code_path_on_every_tier(tier, space):
    store = _store(tier, space)
    store.put("u", torch.zeros(6)).result()
    lease = store.get("u").result()
    lease.tensor.add_(2.0)
    store.put("u", lease.tensor).result()
    lease.release()
    again = store.get("u").result()
    assert torch.equal(again.tensor, torch.full((6,), 2.0))
    again.release()


@pytest.mark.parametrize("tier", TIERS)
def test_a_copied_put_keeps_the_stored_dtype_and_leaves_the_source_free(tier, space):
    store = _store(tier, space)
    store.put("u", torch.zeros(4, dtype=torch.bfloat16)).result()
    source = torch.tensor([1.5, 2.5, 3.5, 4.5])
    pending = store.put("u", source, copy=True)
    source.zero_()  # a copy was taken: changing the source does not change what is written
    pending.result()
    lease = store.get("u").result()
    assert lease.tensor.dtype == torch.bfloat16
    assert lease.tensor.tolist() == [1.5, 2.5, 3.5, 4.5]
    lease.release()
    assert space.pool.in_use_bytes == 0


@pytest.mark.parametrize("tier", TIERS)
def test_writable_gives_a_tensor_to_fill_and_put(tier, space):
    store = _store(tier, space)
    store.put("u", torch.zeros(5)).result()
    lease = store.writable("u")
    lease.tensor.copy_(torch.arange(5.0))
    store.put("u", lease.tensor).result()
    lease.release()
    got = store.get("u").result()
    assert got.tensor.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    got.release()


@pytest.mark.parametrize("tier", TIERS)
def test_stream_together_updates_every_store_in_place(tier, space):
    stores = [_store(tier, space, kind) for kind in ("master", "exp_avg")]
    for i in range(3):
        for s in stores:
            s.put(f"g{i}", torch.full((8,), float(i))).result()
    for i, item in enumerate(stream_together(stores, ["g0", "g1", "g2"], ahead=1)):
        assert [t[0].item() for t in item.tensors] == [float(i)] * 2
        for t in item.tensors:
            t.add_(10.0)
        item.write_back = i != 1  # group 1 not changed: not written
    for s in stores:
        for i in range(3):
            lease = s.get(f"g{i}").result()
            expected = float(i) if i == 1 and tier == "nvme" else float(i) + 10.0
            assert lease.tensor[0].item() == expected
            lease.release()


def test_only_nvme_uses_the_pool_and_only_resident_tiers_hold_bytes(space):
    by_tier = {tier: _store(tier, space) for tier in TIERS}
    for store in by_tier.values():
        store.put("u", torch.zeros(256)).result()
    assert {t: s.uses_pool for t, s in by_tier.items()} == {"device": False, "cpu": False, "nvme": True}
    assert {t: s.held_bytes for t, s in by_tier.items()} == {"device": 1024, "cpu": 1024, "nvme": 0}
    cpu = torch.device("cpu")
    assert {t: s.in_place_on(cpu) for t, s in by_tier.items()} == {"device": True, "cpu": True, "nvme": False}


def test_an_interrupted_put_finishes_on_the_next_result_and_keeps_its_staged_copy(space, interrupt_once):
    """A caught Ctrl-C while a write is awaited loses nothing (the interrupt is injected)."""
    interrupt_once()
    store = _store("nvme", space)
    pending = store.put("0", torch.arange(1000.0), copy=True)  # from a pool copy
    with pytest.raises(KeyboardInterrupt):
        pending.result()
    assert space.pool.in_use_bytes > 0  # the copy is kept while the write may still read it
    pending.result()
    assert space.pool.in_use_bytes == 0
    lease = store.get("0").result()
    assert torch.equal(lease.tensor, torch.arange(1000.0))
    lease.release()
    space.flush()
    assert "0/param" in space.names()


def test_a_failed_operation_raises_on_every_result():
    """A second result() used to return None after the first raised."""

    class Failing:
        def result(self):
            raise OSError(5, "Input/output error", "arena-0.bin")

        def done(self):
            return True

    failed = Pending(Failing())
    for _ in range(2):
        with pytest.raises(OSError, match="Input/output error"):
            failed.result()
