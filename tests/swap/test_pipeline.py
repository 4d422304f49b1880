"""stream(): read ahead, compute, write behind, with bounded buffers and surfaced errors."""

from __future__ import annotations

import os

import pytest
import torch

import infinity.swap as swap


def _fill(space, n, numel=100_000):
    names = [f"g{i}/exp_avg" for i in range(n)]
    for i, name in enumerate(names):
        space.put(name, torch.full((numel,), float(i))).result()
    return names


def test_stream_updates_every_item_in_place(open_space):
    space = open_space()
    names = _fill(space, 10)
    seen = []
    for item in swap.stream(space, names, ahead=2):
        seen.append(item.name)
        item.tensor.mul_(2).add_(1)
    assert seen == names
    for i, name in enumerate(names):
        assert torch.equal(space.get(name, torch.empty(100_000)).result(), torch.full((100_000,), 2.0 * i + 1))
    assert space.pool.in_use_bytes == 0


def test_stream_holds_a_bounded_number_of_buffers(open_space):
    space = open_space()
    names = _fill(space, 12, numel=256 * 1024)  # 1 MiB each
    for item in swap.stream(space, names, ahead=2):
        item.tensor.add_(1)
    # ahead reads + the item in hand + one write behind, 1 MiB each (plus no tail: whole units)
    assert space.pool.peak_bytes <= (2 + 2) * (1 << 20)


def test_stream_without_write_back_leaves_the_space_unchanged(open_space):
    space = open_space()
    names = _fill(space, 4)
    for item in swap.stream(space, names, write_back=False):
        item.tensor.zero_()
    assert torch.equal(space.get(names[3], torch.empty(100_000)).result(), torch.full((100_000,), 3.0))


def test_leaving_early_finishes_and_returns_every_buffer(open_space):
    space = open_space()
    names = _fill(space, 8)
    for i, item in enumerate(swap.stream(space, names, ahead=3)):
        item.tensor.fill_(-1)
        if i == 2:
            break
    assert space.pool.in_use_bytes == 0
    assert torch.equal(space.get(names[1], torch.empty(100_000)).result(), torch.full((100_000,), -1.0))


def test_a_write_behind_error_surfaces_at_the_next_step(open_space, monkeypatch):
    space = open_space()
    names = _fill(space, 6)
    real = space.engine.pwrite
    bad_fd = os.open("/dev/null", os.O_RDONLY)

    def failing(buffer, file, offset):
        return real(buffer, bad_fd, offset)  # EBADF: writes fail, reads do not

    monkeypatch.setattr(space.engine, "pwrite", failing)
    steps = 0
    with pytest.raises(OSError) as info:
        for item in swap.stream(space, names, ahead=1):
            steps += 1
    assert info.value.errno == 9
    assert steps <= 3  # item 0's write fails; it is seen within two more steps, not at the end
    assert space.pool.in_use_bytes == 0
    os.close(bad_fd)


def test_unknown_names_fail_before_any_io(open_space):
    space = open_space()
    with pytest.raises(KeyError, match="nope"):
        list(swap.stream(space, ["nope"]))


def test_stream_of_name_tuples_reads_and_writes_them_together(open_space):
    space = open_space()
    for g in range(3):
        for kind in ("master", "exp_avg"):
            space.put(f"opt.{g}/{kind}", torch.full((1000,), float(g))).result()
    groups = [(f"opt.{g}/master", f"opt.{g}/exp_avg") for g in range(3)]
    for item in swap.stream(space, groups, ahead=1):
        master, m = item.tensors
        assert torch.equal(master, m)
        master.add_(1)
        m.mul_(3)
    for g in range(3):
        assert torch.equal(space.get(f"opt.{g}/master", torch.empty(1000)).result(), torch.full((1000,), g + 1.0))
        assert torch.equal(space.get(f"opt.{g}/exp_avg", torch.empty(1000)).result(), torch.full((1000,), 3.0 * g))
    assert space.pool.in_use_bytes == 0


def test_a_joined_entry_reads_several_tensors_into_one_buffer_and_writes_each_back(open_space):
    """`swap.Joined`: each name at its start of one flat tensor (one page-aligned, one not,
    one short of a page), updated in place and written back under its own name."""
    space = open_space()
    sizes, starts = (3000, 1500, 700), (0, 3072, 4600)
    for u, n in enumerate(sizes):
        space.put(f"u{u}/param", torch.arange(n, dtype=torch.float32) + 10_000 * u).result()
    space.put("opt.0/exp_avg", torch.zeros(5300)).result()
    joined = swap.Joined(tuple(f"u{u}/param" for u in range(3)), starts, 5300, torch.float32)
    for r in range(2):
        for item in swap.stream(space, [(joined, "opt.0/exp_avg")], ahead=1):
            flat, m = item.tensors
            assert flat.shape == (5300,) and m.shape == (5300,)
            for u, (n, a) in enumerate(zip(sizes, starts)):
                assert torch.equal(flat[a : a + n], torch.arange(n, dtype=torch.float32) + 10_000 * u + r), u
                assert torch.equal(m[a : a + n], torch.full((n,), float(r))), u
                flat[a : a + n].add_(1)
                m[a : a + n].add_(1)
    for u, n in enumerate(sizes):
        got = space.get(f"u{u}/param", torch.empty(n)).result()
        assert torch.equal(got, torch.arange(n, dtype=torch.float32) + 10_000 * u + 2), u
    assert space.pool.in_use_bytes == 0


def test_reading_ahead_never_waits_for_pool_memory(open_space):
    """ahead=3 of 1 MiB items in a 3.5 MiB pool: the reads ahead that find no room are issued
    later, and the loop runs to the end (it used to wait for memory only its own reads held,
    then raise PoolExhausted)."""
    pool = swap.HostBufferPool(7 << 19, timeout=2.0)
    space = open_space(pool=pool)
    names = _fill(space, 8, numel=256 * 1024)
    for item in swap.stream(space, names, ahead=3):
        item.tensor.add_(1)
    assert pool.peak_bytes <= 7 << 19
    for i, name in enumerate(names):
        assert torch.equal(space.get(name, torch.empty(256 * 1024)).result(), torch.full((256 * 1024,), i + 1.0))
    pool.close()


class _Held:
    """A write the caller started from an item's buffer, in flight until its result is waited for."""

    def __init__(self):
        self.waited = False

    def done(self):
        return False  # in flight until waited for

    def result(self):
        self.waited = True  # a real future's result() waits for the write to finish


@pytest.mark.parametrize("write_back", [True, False])
def test_writes_the_caller_starts_from_an_item_keep_its_buffers_until_done(open_space, write_back):
    space = open_space()
    names = _fill(space, 6)
    held, first = _Held(), None
    for i, item in enumerate(swap.stream(space, names, ahead=1)):
        if i == 0:
            first = item.buffers
            item.after.append(held)
            item.write_back = write_back
        elif i == 1:
            assert not any(b.released for b in first)  # item 0 is the write behind: in flight
        else:
            # The stream finishes item 0's writes before it hands out item 2 (one write behind):
            # the write from its buffer was waited for, and only then did the buffer go back.
            assert held.waited and all(b.released for b in first)
    assert space.pool.in_use_bytes == 0
    assert torch.equal(space.get(names[0], torch.empty(100_000)).result(), torch.full((100_000,), 0.0))


def test_an_error_in_the_loop_waits_for_the_writes_from_the_item_in_hand(open_space):
    space = open_space()
    names = _fill(space, 4)
    held = _Held()
    with pytest.raises(RuntimeError, match="update failed"):
        for i, item in enumerate(swap.stream(space, names, ahead=2)):
            if i == 1:
                item.after.append(held)
                raise RuntimeError("update failed")
    assert held.waited  # the buffer went back only after the write from it was finished
    assert space.pool.in_use_bytes == 0
