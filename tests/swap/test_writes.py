"""WriteBehind: bounded, errors surface at the next call or at drain, every buffer goes back."""

import errno

import pytest

from infinity.swap import WriteBehind


class Future:
    def __init__(self, log, name, error=None, done=False):
        self.log, self.name, self.error, self._done = log, name, error, done

    def done(self):
        return self._done

    def result(self):
        self.log.append(("wait", self.name))
        if self.error is not None:
            raise self.error
        return self.name


class Buffer:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def release(self):
        self.log.append(("release", self.name))


def test_at_most_limit_writes_stay_in_flight_oldest_finished_first():
    log = []
    writes = WriteBehind(2)
    for i in range(4):
        writes.add(Future(log, i), Buffer(log, i))
    assert len(writes) == 2
    assert log == [("wait", 0), ("release", 0), ("wait", 1), ("release", 1)]
    writes.drain()
    assert len(writes) == 0
    assert log[4:] == [("wait", 2), ("release", 2), ("wait", 3), ("release", 3)]


def test_a_finished_write_gives_its_buffer_back_at_the_next_call():
    log = []
    writes = WriteBehind(4)
    writes.add(Future(log, "a", done=True), Buffer(log, "a"))
    writes.add(Future(log, "b"), Buffer(log, "b"))
    assert ("release", "a") in log and ("release", "b") not in log
    writes.drain()


def test_an_error_surfaces_at_the_next_call_beyond_the_limit_and_its_buffer_goes_back():
    log = []
    writes = WriteBehind(1)
    writes.add(Future(log, "bad", error=OSError(errno.ENOSPC, "full")), Buffer(log, "bad"))
    with pytest.raises(OSError, match="full"):
        writes.add(Future(log, "next"), Buffer(log, "next"))
    assert ("release", "bad") in log
    writes.drain()
    assert ("release", "next") in log


def test_drain_finishes_every_write_and_raises_the_first_error():
    log = []
    writes = WriteBehind(8)
    writes.add(Future(log, 0), Buffer(log, 0))
    writes.add(Future(log, 1, error=OSError(errno.EIO, "first")), Buffer(log, 1))
    writes.add(Future(log, 2, error=OSError(errno.EIO, "second")), Buffer(log, 2))
    writes.add(Future(log, 3), Buffer(log, 3))
    with pytest.raises(OSError, match="first"):
        writes.drain()
    assert sorted(name for what, name in log if what == "release") == [0, 1, 2, 3]
    assert len(writes) == 0


def test_several_futures_of_one_write_are_all_waited_for_before_its_buffers_go_back():
    log = []
    writes = WriteBehind(0)
    with pytest.raises(OSError, match="a"):
        writes.add([Future(log, "a", error=OSError(errno.EIO, "a")), Future(log, "b")], Buffer(log, "x"))
    assert log == [("wait", "a"), ("wait", "b"), ("release", "x")]


def test_settle_finishes_the_write_of_one_key_and_a_new_write_of_a_key_replaces_the_old():
    log = []
    writes = WriteBehind(8)
    writes.add(Future(log, "u1"), Buffer(log, "u1"), key=1)
    writes.add(Future(log, "u2"), Buffer(log, "u2"), key=2)
    writes.settle(1)
    assert log == [("wait", "u1"), ("release", "u1")] and 1 not in writes and 2 in writes
    writes.add(Future(log, "u2'"), Buffer(log, "u2'"), key=2)
    assert log[2:] == [("wait", "u2"), ("release", "u2")]
    writes.settle(99)  # nothing in flight under that key: nothing happens
    writes.drain()


def test_discard_errors_finishes_everything_and_forgets_io_errors():
    log = []
    writes = WriteBehind(8)
    writes.add(Future(log, 0, error=OSError(errno.EIO, "lost")), Buffer(log, 0))
    writes.add(Future(log, 1), Buffer(log, 1))
    writes.discard_errors()
    assert len(writes) == 0 and {("release", 0), ("release", 1)} <= set(log)


@pytest.mark.parametrize("limit", [-1, 1.5, "2"])
def test_a_bad_limit_is_refused(limit):
    with pytest.raises(ValueError, match="limit"):
        WriteBehind(limit)
