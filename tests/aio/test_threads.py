"""The threads backend's own scheduling; its contract is in test_conformance.py."""

from __future__ import annotations

import time

import pytest
import torch

import infinity.aio as aio


def test_chunk_before_eof_is_read_when_a_later_chunk_finds_eof_first(tmp_path, monkeypatch, random_bytes, write_file):
    # Three blocks of data, a read of four blocks in 4 KiB chunks. The worker that takes
    # chunk 0 is held briefly before it starts (as a preempted thread would be), so chunk 3
    # finds EOF first; chunk 0 must still be read and counted.
    data = random_bytes(3 * 4096, seed=1)
    write_file(tmp_path / "f", data)
    monkeypatch.delenv(aio.ENV_BACKEND, raising=False)
    engine = aio.open_engine("threads", queue_depth=4, block_size=4096)
    run_chunk = engine._run_chunk

    def late_first_chunk(req, op, view, fd, offset, direct):
        if offset == 0:
            time.sleep(0.2)
        return run_chunk(req, op, view, fd, offset, direct)

    monkeypatch.setattr(engine, "_run_chunk", late_first_chunk)
    try:
        with aio.open_file(tmp_path / "f", "r") as f:
            buf = aio.empty_aligned(4 * 4096)
            n = engine.pread(buf, f, 0).result()
    finally:
        engine.close()
    assert n == 3 * 4096
    assert torch.equal(buf[: 3 * 4096], data)
