"""Reads checked against their checksums by default: every read path of a SwapSpace raises
SwapCorruption naming the file, the tensor and the offset on a flipped byte, before it hands
out a byte; ``verify="off"`` reads without checking. The check runs on the space's own threads
([Note: reads checked off the caller's thread] in swap/_checksum.py)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import infinity.swap as swap
from infinity.swap import _checksum

MiB = 1 << 20


def _flip(space: swap.SwapSpace, name: str, at: int = 0) -> tuple[str, int]:
    """Flip one bit of byte ``at`` of ``name`` on disk (after a flush); the (arena, offset) of
    the tensor's first extent, which the error must name."""
    space.flush()
    extents = space.info(name).extents
    for e in extents:  # byte ``at`` of the tensor lies in the extent that holds it
        if at < e.nbytes:
            break
        at -= e.nbytes
    with open(space.files[e.file].path, "r+b") as f:
        f.seek(e.offset + at)
        byte = f.read(1)
        f.seek(e.offset + at)
        f.write(bytes([byte[0] ^ 0x10]))
    first = extents[0]
    return space.files[first.file].path, first.offset


def _check_error(err: swap.SwapCorruption, name: str, arena: str, offset: int) -> None:
    assert isinstance(err, OSError)
    assert (err.tensor, err.filename, err.offset) == (name, arena, offset)
    message = str(err)
    assert repr(name) in message and arena in message and f"offset {offset}" in message


def _tensor(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed))


def test_verify_is_always_by_default(open_space):
    assert open_space().verify == "always"


# Below INLINE_BYTES a read is checked on the caller's thread, above on the space's: both, and
# a size whose last 4 KiB unit is staged (the flip in that tail).
SIZES = {"small": 40_000, "large": 3 * MiB, "tail": 3 * MiB + 1028}


@pytest.mark.parametrize("size", sorted(SIZES))
def test_a_flipped_byte_raises_on_get_into_a_pool_buffer(open_space, size):
    space = open_space()
    t = _tensor(SIZES[size])
    space.put("w/param", t).result()
    arena, offset = _flip(space, "w/param", at=t.numel() * 4 - 3)
    held = space.pool.in_use_bytes
    with pytest.raises(swap.SwapCorruption) as info:
        space.get("w/param").result()
    _check_error(info.value, "w/param", arena, offset)
    assert space.pool.in_use_bytes == held  # the buffer went back: nobody got its bytes


@pytest.mark.parametrize("size", sorted(SIZES))
def test_a_flipped_byte_raises_on_get_into_the_callers_tensor(open_space, size):
    space = open_space()
    t = _tensor(SIZES[size])
    space.put("w/exp_avg", t).result()
    arena, offset = _flip(space, "w/exp_avg", at=5)
    with pytest.raises(swap.SwapCorruption) as info:
        space.get("w/exp_avg", torch.empty_like(t)).result()
    _check_error(info.value, "w/exp_avg", arena, offset)


def test_a_flipped_byte_in_a_tensor_striped_over_drives_names_its_first_extent(open_space):
    space = open_space(3, stripe_threshold=1 * MiB, stripe_size=1 * MiB)
    t = _tensor(5 * MiB)
    space.put("big/param", t).result()
    assert len({e.file for e in space.info("big/param").extents}) == 3
    arena, offset = _flip(space, "big/param", at=4 * MiB + 17)  # in the third drive's piece
    with pytest.raises(swap.SwapCorruption) as info:
        space.get("big/param", torch.empty_like(t)).result()
    _check_error(info.value, "big/param", arena, offset)


def test_a_flipped_byte_raises_from_the_stream_before_the_item_is_handed_out(open_space):
    """What the optimizer's states go through (read ahead, update, write behind)."""
    space = open_space()
    for i in range(4):
        space.put(f"{i}/exp_avg", _tensor(1 * MiB, seed=i)).result()
    arena, offset = _flip(space, "2/exp_avg", at=100)
    seen = []
    with pytest.raises(swap.SwapCorruption) as info:
        for item in swap.stream(space, [f"{i}/exp_avg" for i in range(4)], ahead=2):
            seen.append(item.name)
    _check_error(info.value, "2/exp_avg", arena, offset)
    assert seen == ["0/exp_avg", "1/exp_avg"]
    assert space.pool.in_use_bytes == 0


def test_a_flipped_byte_raises_from_a_joined_read(open_space):
    """What one copy of the parameters reads: several tensors into one buffer."""
    space = open_space()
    a, b = _tensor(8192, seed=1), _tensor(MiB, seed=2)
    space.put("a/param", a).result()
    space.put("b/param", b).result()
    arena, offset = _flip(space, "b/param", at=12345)
    joined = swap.Joined(("a/param", "b/param"), (0, 4096), 4096 + b.numel(), torch.float32)
    read = swap.JoinedRead(space, joined, timeout=None)
    with pytest.raises(swap.SwapCorruption) as info:
        read.result()
    _check_error(info.value, "b/param", arena, offset)
    assert space.pool.in_use_bytes == 0


def test_the_space_reader_checks_by_default(open_space, dirs):
    """What checkpoint loads and swap-inspect read with."""
    (path,) = dirs(1)
    space = open_space(paths=[path])
    space.put("w/param", _tensor(MiB)).result()
    arena, offset = _flip(space, "w/param", at=77)
    space.close()
    with swap.SpaceReader(os.path.join(path, "rank0")) as reader:
        with pytest.raises(swap.SwapCorruption) as info:
            reader.read("w/param")
        _check_error(info.value, "w/param", arena, offset)
        with pytest.raises(swap.SwapCorruption):
            for _ in reader.read_chunks("w/param", chunk_bytes=256 << 10):
                pass
        reader.read("w/param", verify=False)  # asked not to: the bytes as they are


@pytest.mark.parametrize("verify", ["off", "checkpoint"])
def test_verify_off_reads_the_flipped_byte_without_checking(open_space, verify):
    space = open_space(verify=verify)
    t = _tensor(MiB)
    space.put("w/param", t).result()
    _flip(space, "w/param", at=0)
    got = space.get("w/param", torch.empty_like(t)).result()
    assert not torch.equal(got, t) and torch.equal(got[1:], t[1:])  # the byte as the drive has it


@pytest.mark.parametrize("size", sorted(SIZES))
def test_reads_checked_give_the_bytes_written(open_space, size):
    space = open_space(2, stripe_threshold=1 * MiB)
    tensors = [_tensor(SIZES[size], seed=i) for i in range(6)]
    for i, t in enumerate(tensors):
        space.put(f"{i}/param", t).result()
    futures = [space.get(f"{i}/param", torch.empty_like(t)) for i, t in enumerate(tensors)]  # all in flight
    for t, fut in zip(tensors, futures):
        assert torch.equal(fut.result(), t)


class _Blocked:
    """A read that lands only when ``landed`` is set."""

    def __init__(self):
        self.landed = threading.Event()

    def done(self) -> bool:
        return self.landed.is_set()

    def wait(self) -> None:
        self.landed.wait()


class _Landed:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


def test_a_read_whose_check_has_not_begun_is_checked_by_its_caller():
    """A check queued behind one that waits for a read still on its way (a read needed now
    that went ahead of reads for later) does not wait behind it: its caller checks it."""
    checker = _checksum.Checker(threads=1)
    older = _Blocked()
    watchdog = threading.Timer(60, older.landed.set)  # a hang would otherwise be the failure
    watchdog.start()
    try:
        data = torch.arange(_checksum.INLINE_BYTES, dtype=torch.uint8)
        expected = _checksum.checksum(data.numpy())
        first = checker.check(older, data, expected, lambda actual: AssertionError(actual))
        second = checker.check(_Landed(), data, expected, lambda actual: AssertionError(actual))
        second.wait()
        assert not older.landed.is_set()  # checked while the thread still waited for the older read
        older.landed.set()
        first.wait()
    finally:
        watchdog.cancel()
        older.landed.set()
        checker.close()


def test_a_read_error_is_raised_as_it_is_not_as_a_mismatch():
    class Failed(_Landed):
        def wait(self):
            raise OSError(5, "Input/output error", "/drive/arena-0.bin")

    checker = _checksum.Checker()
    try:
        data = torch.zeros(_checksum.INLINE_BYTES, dtype=torch.uint8)
        read = checker.check(Failed(), data, "xxh3-64:0", lambda actual: AssertionError(actual))
        for _ in range(2):  # and again to every caller
            with pytest.raises(OSError, match="Input/output error") as info:
                read.wait()
            assert not isinstance(info.value, swap.SwapCorruption)
    finally:
        checker.close()


def test_a_checked_read_in_flight_at_close_is_finished(open_space):
    space = open_space()
    t = _tensor(2 * MiB)
    space.put("w/param", t).result()
    fut = space.get("w/param", torch.empty_like(t))
    space.close()
    assert torch.equal(fut.result(), t)
