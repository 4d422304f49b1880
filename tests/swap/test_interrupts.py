"""A caught Ctrl-C loses nothing: an interrupted wait leaves the operation unfinished, and the
next result(), flush or close finishes it.

The interrupt is injected (the transfer's wait raises KeyboardInterrupt once), not timed.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from infinity.swap import WriteBehind


def _manifest_names(path: str) -> list[str]:
    return sorted(json.load(open(os.path.join(path, "rank0", "manifest.json")))["tensors"])


def test_an_interrupted_put_is_finished_by_the_next_result(open_space, dirs, interrupt_once):
    (path,) = dirs(1)
    space = open_space(paths=[path])
    t = torch.arange(10_000, dtype=torch.float32)
    fut = space.put("0/param", t)
    interrupt_once()
    with pytest.raises(KeyboardInterrupt):
        fut.result()
    assert fut.result() is None  # waits again and finishes
    assert "0/param" in space
    assert torch.equal(space.get("0/param", torch.empty_like(t)).result(), t)
    space.flush()
    assert _manifest_names(path) == ["0/param"]


def test_an_interrupted_put_is_finished_by_flush(open_space, dirs, interrupt_once):
    (path,) = dirs(1)
    space = open_space(paths=[path])
    t = torch.ones(5000)
    fut = space.put("0/param", t)
    interrupt_once()
    with pytest.raises(KeyboardInterrupt):
        fut.result()
    space.flush()  # the caller never waited again: flush finishes it
    assert _manifest_names(path) == ["0/param"]
    assert torch.equal(space.get("0/param", torch.empty_like(t)).result(), t)
    fut.result()  # and the future agrees


def test_a_put_over_an_interrupted_one_lands_after_it(open_space, interrupt_once):
    space = open_space()
    fut = space.put("x", torch.zeros(4096))
    interrupt_once()
    with pytest.raises(KeyboardInterrupt):
        fut.result()
    space.put("x", torch.ones(4096)).result()
    assert torch.equal(space.get("x", torch.empty(4096)).result(), torch.ones(4096))
    assert space.info("x").generation == 2


def test_an_interrupted_get_keeps_its_buffer_and_finishes(open_space, interrupt_once):
    space = open_space()
    t = torch.arange(3000, dtype=torch.int64)
    space.put("x", t).result()
    fut = space.get("x")  # into a pool buffer
    interrupt_once()
    with pytest.raises(KeyboardInterrupt):
        fut.result()
    buf = fut.result()
    assert torch.equal(buf.view(torch.int64, t.shape), t)
    buf.release()
    assert space.pool.in_use_bytes == 0


def test_an_interrupted_close_leaves_the_space_open_and_a_second_close_finishes(open_space, dirs, interrupt_once):
    (path,) = dirs(1)
    space = open_space(paths=[path])
    space.put("0/param", torch.ones(100))
    interrupt_once()
    with pytest.raises(KeyboardInterrupt):
        space.close()
    space.close()
    assert _manifest_names(path) == ["0/param"]


class _Future:
    """A write whose first result() is interrupted."""

    def __init__(self):
        self.waits = 0

    def done(self):
        return False

    def result(self):
        self.waits += 1
        if self.waits == 1:
            raise KeyboardInterrupt


class _Buffer:
    released = False

    def release(self):
        self.released = True


@pytest.mark.parametrize("how", ["drain", "settle", "poll"])
def test_an_interrupted_write_behind_keeps_its_buffer_until_it_completes(how):
    writes = WriteBehind(2)
    fut, buf = _Future(), _Buffer()
    writes.add(fut, buf, key="k")
    finish = {"drain": writes.drain, "settle": lambda: writes.settle("k"), "poll": lambda: writes.poll(keep=0)}[how]
    with pytest.raises(KeyboardInterrupt):
        finish()
    assert not buf.released and "k" in writes  # the write may still be reading the buffer
    finish()
    assert buf.released and len(writes) == 0 and fut.waits == 2


def test_a_write_added_over_an_interrupted_one_under_its_key_is_tracked():
    writes = WriteBehind(2)
    old, new = _Future(), _Future()
    old_buf, new_buf = _Buffer(), _Buffer()
    writes.add(old, old_buf, key="k")
    with pytest.raises(KeyboardInterrupt):
        writes.add(new, new_buf, key="k")  # settling the old one is interrupted
    assert len(writes) == 2 and not new_buf.released
    with pytest.raises(KeyboardInterrupt):
        writes.drain()  # the new one's first wait is interrupted too
    writes.drain()
    assert old_buf.released and new_buf.released
