"""A request's Future waited on from two threads: the swap space's checksum threads wait for a
read while the caller's thread reaps finished requests (`Engine._prune`, `wait_range`)."""

from __future__ import annotations

import threading

from infinity.aio._engine import READ, Future


class _Handle:
    """A backend handle whose ``wait`` returns only once ``go`` is set, whatever it is done."""

    def __init__(self):
        self.finished = threading.Event()
        self.go = threading.Event()

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout_s: float) -> bool:
        self.go.wait()
        return self.finished.is_set()

    def outcome(self) -> tuple[int, int]:
        return 4096, 0


def test_a_future_reaped_by_one_thread_while_another_waits_on_it_gives_both_the_outcome():
    handle = _Handle()
    fut = Future(handle, None, READ, "arena-0.bin", 0, 4096, 0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(fut.result()))
    waiter.start()
    handle.finished.set()
    assert fut.done()  # this thread reaps it while the other is inside the handle's wait
    handle.go.set()
    waiter.join()
    assert got == [4096] and fut.result() == 4096
