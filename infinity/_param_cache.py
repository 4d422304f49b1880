"""Parameters kept in the host pool between their uses, in place of reading them back from nvme.

Owns: for each parameter unit's key on nvme, at most one pool buffer that holds the key's bytes
as the swap space recorded them (the buffer a read filled, or the buffer new parameters were
written from), set aside in the pool while no one uses it (`infinity.swap.HostBuffer.set_aside`),
and lent to the runtime's fetches in place of a read. Touches: the pool (through the buffers),
`Stats` (the bytes lent). The params `Store` makes one and goes through it, passing the swap
space's record of a key now; no other code sees it.

[Note: parameters kept in the pool]
With the parameters on nvme, the step writes each new parameter from a pool buffer (the early
updates under backward with the optimizer in host memory write from a staging tensor of their
own, copied into a pool buffer where the pool has room then), and the next forward reads the
same bytes back into another: 2 B a parameter a step in bf16; on an H200, 953M parameters in
nvme,cpu,cpu waited 1.1 s a step for that read. So the buffer a write went from, and the buffer
a read filled once its unit is released, are not released but set aside: the pool counts their
bytes as free, and an `acquire` that finds no other room takes them (the longest aside first)
before it waits. `memory.host_budget` bounds them as before, and they never make anything wait;
what the budget leaves them saves reads.

A buffer is lent only while the space's record of its key is the record its bytes were read
under or written as: the record object itself, which every put and rename of the key replaces.
So no write by any path (the step's, an early update's commit, a checkpoint load, a re-cut,
``load_state_dict``, a write that failed) can leave a stale buffer to be lent: the next fetch
finds the record changed and reads the disk. Only the runtime's fetches borrow a buffer
(`Store.get(..., kept=True)`): they bind it as the parameters or copy it to the device, and
never write it. Other readers (checkpoints, the consolidated state dict, a frozen unit's load,
which changes its lease in place) read the disk as before. One borrower at a time: a second
fetch of a unit lent already reads the disk. A parameter changed in place behind the engine's
back (not through ``load_state_dict``) keeps the change while its buffer is kept, as a resident
tier's tensor keeps it for good; read again, it would be lost.
"""

from __future__ import annotations

import threading

from ._stats import Stats


class _Entry:
    """A key's buffer: its bytes are ``record``'s; lent now or set aside."""

    __slots__ = ("record", "buffer", "lent")

    def __init__(self, record, buffer):
        self.record = record
        self.buffer = buffer
        self.lent = False


class _Loan:
    """A kept buffer lent: the lease's ``release`` hands it back to the cache."""

    __slots__ = ("_cache", "_key", "_entry")

    def __init__(self, cache: "ParamCache", key: str, entry: _Entry):
        self._cache, self._key, self._entry = cache, key, entry

    def view(self, dtype, shape):
        return self._entry.buffer.view(dtype, shape)

    def release(self) -> None:
        if self._entry is not None:
            entry, self._entry = self._entry, None
            self._cache._returned(self._key, entry)


class _Keep:
    """A buffer whose bytes are ``key``'s once ``record_of()`` says which record: on
    ``release`` it is kept (set aside) rather than released, where the record is known."""

    __slots__ = ("_cache", "_key", "_buffer", "_record_of", "_replace")

    def __init__(self, cache: "ParamCache", key: str, buffer, record_of, replace: bool):
        self._cache, self._key, self._buffer, self._record_of = cache, key, buffer, record_of
        self._replace = replace

    def view(self, dtype, shape):
        return self._buffer.view(dtype, shape)

    def release(self) -> None:
        buffer, self._buffer = self._buffer, None
        if buffer is None:
            return
        try:
            record = self._record_of()
        except Exception:  # noqa: BLE001 - a failed write's buffer holds no record's bytes
            record = None
        if record is None:
            buffer.release()
        else:
            self._cache.keep(self._key, record, buffer, replace=self._replace)


class ParamCache:
    """The parameters' buffers set aside in the pool between uses ([Note: parameters kept in
    the pool])."""

    def __init__(self, stats: Stats):
        self._stats = stats
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()  # a write's buffer may come back on the optimizer's threads

    def lend(self, key: str, record):
        """The buffer holding ``key``'s bytes as ``record`` (the space's record of the key now)
        says them (a `_Loan`: ``release`` hands it back), or None where there is none to lend:
        then the caller reads the disk."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.lent:
                return None
            if entry.record is not record or not entry.buffer.take_back():
                del self._entries[key]
                entry.buffer.release()  # (nothing, where the pool took its room)
                return None
            entry.lent = True
        self._stats.add("param_cache_bytes", record.nbytes)
        return _Loan(self, key, entry)

    def after_read(self, key: str, record, buffer) -> _Keep:
        """``buffer``, read under ``record``, to lend now and keep once released where
        nothing is kept for ``key`` then (a write since has its own buffer kept)."""
        return _Keep(self, key, buffer, lambda: record, replace=False)

    def after_write(self, key: str, buffer, future) -> _Keep:
        """``buffer``, which ``future`` (a put of ``key``) writes from, to keep once the write is
        done: its result is the key's new record."""
        return _Keep(self, key, buffer, future.result, replace=True)

    def keep(self, key: str, record, buffer, replace: bool = True) -> None:
        """``buffer`` holds ``record``'s bytes of ``key`` and its holder gives it up: set aside,
        in place of what was kept for the key (unless ``replace`` is False: then only where
        nothing is, else released)."""
        with self._lock:
            old = self._entries.get(key)
            if old is not None and not replace:
                old = None
                buffer.release()
            elif buffer.set_aside():  # (False: the pool keeps no more aside, and released it)
                self._entries[key] = _Entry(record, buffer)
            else:
                self._entries.pop(key, None)
        if old is not None:
            self._discard(old)

    def rename(self, src: str, dst: str, record) -> None:
        """``src``'s bytes are ``dst``'s now, under ``record`` (`SwapSpace.rename`; the caller
        checked that ``src`` held what was kept for it)."""
        with self._lock:
            entry = self._entries.pop(src, None)
            old = self._entries.pop(dst, None)
            if entry is not None:
                entry.record = record
                self._entries[dst] = entry
        if old is not None:
            self._discard(old)

    def recorded(self, key: str):
        """The record of what is kept for ``key``, or None."""
        entry = self._entries.get(key)
        return None if entry is None else entry.record

    def forget(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
        if old is not None:
            self._discard(old)

    @staticmethod
    def _discard(entry: _Entry) -> None:
        """``entry`` is no longer kept: its buffer is released now, or when its loan comes back."""
        if not entry.lent:
            entry.buffer.release()

    def _returned(self, key: str, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                entry.lent = False
                if not entry.buffer.set_aside():  # released: the pool keeps no more aside
                    del self._entries[key]
                return
        entry.buffer.release()
