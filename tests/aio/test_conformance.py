"""The engine contract, checked against every available backend (see conftest.backend)."""

from __future__ import annotations

import errno
import gc
import importlib
import os
import resource

import numpy as np
import pytest
import torch

import infinity.aio as aio

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nbytes",
    [4 * KiB, 64 * KiB, 1 * MiB, 64 * MiB, 3 * 4096, 257 * 4096, 1 * MiB - 4096, 1 * MiB + 4096],
    ids=lambda n: f"{n}B",
)
def test_round_trip(engine, tmp_path, random_bytes, round_trip, nbytes):
    with aio.open_file(tmp_path / "f", "w+") as f:
        round_trip(engine, f, random_bytes(nbytes), 0)


@pytest.mark.parametrize(
    "nbytes,block_size,queue_depth",
    [
        (64 * MiB, 64 * KiB, 4),  # 1024 chunks, 4 in flight
        (257 * 4096, 64 * KiB, 4),  # last chunk shorter than the block
        (1 * MiB + 4096, 4096, 1),  # 257 chunks, one at a time
        (3 * 4096, 8192, 2),
        (5 * MiB, 3 * 4096, 7),  # block size not a power of two
    ],
    ids=lambda v: str(v),
)
def test_round_trip_in_many_chunks(make_engine, tmp_path, random_bytes, round_trip, nbytes, block_size, queue_depth):
    engine = make_engine(queue_depth=queue_depth, block_size=block_size)
    with aio.open_file(tmp_path / "f", "w+") as f:
        round_trip(engine, f, random_bytes(nbytes), 4096)


def test_counters_count_requests_chunks_and_bytes(make_engine, tmp_path, random_bytes):
    engine = make_engine(queue_depth=4, block_size=64 * KiB)
    data = random_bytes(1 * MiB + 4096)
    with aio.open_file(tmp_path / "f", "w+") as f:
        engine.pwrite(data, f, 0).result()
        engine.pread(aio.empty_aligned(data.numel()), f, 0).result()
    c = engine.counters()
    assert c["requests"] == 2
    assert c["chunks"] >= 2 * 17  # 16 full blocks and one of 4 KiB, each way
    assert c["bytes_written"] == data.numel()
    assert c["bytes_read"] == data.numel()
    assert c["errors"] == 0
    for key in ("short", "retries"):
        assert key in c


def test_many_concurrent_requests(make_engine, tmp_path, random_bytes, file_bytes):
    # 200 requests outstanding at once, at shuffled offsets, waited for in reverse order.
    engine = make_engine(queue_depth=8, block_size=8 * KiB)
    n, size = 200, 16 * KiB
    data = random_bytes(n * size, seed=1)
    order = np.random.default_rng(2).permutation(n)
    with aio.open_file(tmp_path / "f", "w+") as f:
        futures = [engine.pwrite(data[i * size : (i + 1) * size], f, int(i) * size) for i in order]
        for fut in reversed(futures):
            assert fut.result() == size
        assert torch.equal(file_bytes(f.path, 0, n * size), data)

        back = aio.empty_aligned(n * size)
        back.fill_(0)
        futures = [engine.pread(back[i * size : (i + 1) * size], f, int(i) * size) for i in order]
        for fut in reversed(futures):
            assert fut.result() == size
    assert torch.equal(back, data)


def test_far_offset_on_sparse_file(engine, tmp_path, random_bytes, round_trip):
    offset = 64 * GiB + 4096
    data = random_bytes(1 * MiB, seed=3)
    with aio.open_file(tmp_path / "sparse", "w+") as f:
        try:
            engine.pwrite(data, f, offset).result()
        except OSError as e:
            if e.errno in (errno.EFBIG, errno.ENOSPC, errno.EINVAL):
                pytest.skip(f"the filesystem of {tmp_path} refuses a file of {offset + data.numel()} bytes: {e}")
            raise
        assert f.size() == offset + data.numel()
        round_trip(engine, f, data, offset)


# -- end of file ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size,queue_depth", [(1 * MiB, 32), (4096, 4)], ids=["one-chunk", "4K-chunks"])
def test_read_straddling_eof_direct(make_engine, tmp_path, random_bytes, write_file, block_size, queue_depth):
    engine = make_engine(queue_depth=queue_depth, block_size=block_size)
    data = random_bytes(5 * 4096, seed=4)
    write_file(tmp_path / "f", data)
    with aio.open_file(tmp_path / "f", "r") as f:
        buf = aio.empty_aligned(4 * 4096)
        assert engine.pread(buf, f, 3 * 4096).result() == 2 * 4096
    assert torch.equal(buf[: 2 * 4096], data[3 * 4096 :])


@pytest.mark.parametrize("offset", [5 * 4096, 6 * 4096, 1 * GiB], ids=["at-eof", "after-eof", "far-after-eof"])
def test_read_past_eof_direct_returns_zero(engine, tmp_path, random_bytes, write_file, offset):
    write_file(tmp_path / "f", random_bytes(5 * 4096))
    with aio.open_file(tmp_path / "f", "r") as f:
        assert engine.pread(aio.empty_aligned(2 * 4096), f, offset).result() == 0


@pytest.mark.parametrize("block_size", [1 * MiB, 4096], ids=["one-chunk", "4K-chunks"])
def test_read_straddling_eof_buffered(make_engine, tmp_path, random_bytes, write_file, block_size):
    engine = make_engine(queue_depth=4, block_size=block_size)
    data = random_bytes(10_000, seed=5)
    write_file(tmp_path / "f", data)
    with aio.open_file(tmp_path / "f", "r", direct=False) as f:
        buf = torch.zeros(5_000, dtype=torch.uint8)
        assert engine.pread(buf, f, 7_777).result() == 10_000 - 7_777
    assert torch.equal(buf[: 10_000 - 7_777], data[7_777:])


@pytest.mark.parametrize("offset", [10_000, 10_001, 123_457], ids=["at-eof", "after-eof", "far-after-eof"])
def test_read_past_eof_buffered_returns_zero(engine, tmp_path, random_bytes, write_file, offset):
    write_file(tmp_path / "f", random_bytes(10_000))
    with aio.open_file(tmp_path / "f", "r", direct=False) as f:
        assert engine.pread(torch.zeros(333, dtype=torch.uint8), f, offset).result() == 0


def test_buffered_unaligned_round_trip(make_engine, tmp_path, random_bytes, file_bytes):
    engine = make_engine(queue_depth=4, block_size=64 * KiB)
    extents = [(1, 1), (4095, 3), (12_345, 54_321), (1 * MiB - 1, 1 * MiB + 7), (3 * MiB + 5, 4097)]
    with aio.open_file(tmp_path / "f", "w+", direct=False) as f:
        for i, (offset, nbytes) in enumerate(extents):
            data = random_bytes(nbytes + 1, seed=10 + i)[1:]  # an odd buffer address too
            assert engine.pwrite(data, f, offset).result() == nbytes
            assert torch.equal(file_bytes(f.path, offset, nbytes), data)
            back = torch.zeros(nbytes + 3, dtype=torch.uint8)[3:]
            assert engine.pread(back, f, offset).result() == nbytes
            assert torch.equal(back, data)


# -- where O_DIRECT is refused ----------------------------------------------------------------


def test_o_direct_on_tmpfs_round_trips(engine, shm_dir, random_bytes, round_trip):
    # tmpfs accepts O_DIRECT since Linux 6.6 and refuses it before: either way I/O works.
    with aio.open_file(os.path.join(shm_dir, "f"), "w+") as f:
        round_trip(engine, f, random_bytes(1 * MiB + 4096, seed=6), 4096)


def test_o_direct_fallback_round_trips(engine, tmp_path, monkeypatch, random_bytes, round_trip):
    files = importlib.import_module("infinity.aio._files")
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument (simulated)", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(files.os, "open", no_direct)
    monkeypatch.setattr(files, "_warned_buffered", set())
    with aio.open_file(tmp_path / "f", "w+") as f:
        assert not f.direct
        # Unaligned extents work once the file is buffered.
        round_trip(engine, f, random_bytes(3 * 4096 + 2, seed=7)[1:-1], 4096 + 1)


# -- misuse -----------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_misaligned_buffer_address_on_direct_file(engine, tmp_path, op):
    with aio.open_file(tmp_path / "f", "w+") as f:
        if not f.direct or f.mem_align == 1:
            pytest.skip(f"{f} needs no buffer alignment")
        buf = aio.empty_aligned(2 * 4096)[1 : 1 + 4096]
        with pytest.raises(ValueError) as exc:
            getattr(engine, op)(buf, f, 0)
    message = str(exc.value)
    assert f"address={buf.data_ptr():#x}" in message
    assert f"mem_align={f.mem_align}" in message


@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_misaligned_offset_on_direct_file(engine, tmp_path, op):
    with aio.open_file(tmp_path / "f", "w+") as f:
        if not f.direct or f.offset_align == 1:
            pytest.skip(f"{f} needs no offset alignment")
        with pytest.raises(ValueError) as exc:
            getattr(engine, op)(aio.empty_aligned(4096), f, f.offset_align + 1)
    assert f"offset={f.offset_align + 1}" in str(exc.value)


@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_misaligned_length_on_direct_file(engine, tmp_path, op):
    with aio.open_file(tmp_path / "f", "w+") as f:
        if not f.direct or f.offset_align == 1:
            pytest.skip(f"{f} needs no length alignment")
        nbytes = 4096 + f.offset_align // 2
        with pytest.raises(ValueError) as exc:
            getattr(engine, op)(aio.empty_aligned(nbytes), f, 0)
    assert f"nbytes={nbytes}" in str(exc.value)


@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_zero_length_request(engine, tmp_path, op):
    with aio.open_file(tmp_path / "f", "w+") as f:
        assert getattr(engine, op)(aio.empty_aligned(0), f, 4096).result() == 0
        assert f.size() == 0


@pytest.mark.parametrize("offset", [-4096, 4096.0, True], ids=["negative", "float", "bool"])
def test_bad_offset_raises_value_error(engine, tmp_path, offset):
    with aio.open_file(tmp_path / "f", "w+") as f:
        with pytest.raises(ValueError, match="offset"):
            engine.pwrite(aio.empty_aligned(4096), f, offset)


def test_non_file_target_raises_type_error(engine):
    with pytest.raises(TypeError, match="file"):
        engine.pwrite(aio.empty_aligned(4096), "/tmp/not-a-file-object", 0)


# -- I/O errors -------------------------------------------------------------------------------


def _expect_oserror(fn) -> OSError:
    """The OSError of a request, whether raised at submit or by Future.result()."""
    with pytest.raises(OSError) as exc:
        fn().result()
    return exc.value


def test_pwrite_to_read_only_file_raises_ebadf(engine, tmp_path, random_bytes, write_file):
    write_file(tmp_path / "f", random_bytes(4096))
    with aio.open_file(tmp_path / "f", "r") as f:
        fut = engine.pwrite(random_bytes(4096, seed=1), f, 0)
        with pytest.raises(OSError) as exc:
            fut.result()
    assert exc.value.errno == errno.EBADF
    assert exc.value.filename == str(tmp_path / "f")


@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_closed_file_raises_ebadf(engine, tmp_path, op):
    f = aio.open_file(tmp_path / "f", "w+")
    f.close()
    err = _expect_oserror(lambda: getattr(engine, op)(aio.empty_aligned(4096), f, 0))
    assert err.errno == errno.EBADF
    assert err.filename == str(tmp_path / "f")


@pytest.fixture
def closed_fd(tmp_path) -> int:
    """An fd number that is closed, high enough that nothing reopens it during the test."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    high = os.dup2(fd, min(soft, 1024) - 1)
    os.close(fd)
    os.close(high)
    return high


@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_closed_raw_fd_fails_in_the_future(engine, closed_fd, op):
    fut = getattr(engine, op)(aio.empty_aligned(4096), closed_fd, 0)
    with pytest.raises(OSError) as exc:
        fut.result()
    assert exc.value.errno == errno.EBADF


def test_engine_works_after_failed_request(engine, tmp_path, random_bytes, write_file, round_trip):
    write_file(tmp_path / "ro", random_bytes(4096))
    with aio.open_file(tmp_path / "ro", "r") as ro:
        with pytest.raises(OSError):
            engine.pwrite(random_bytes(64 * KiB), ro, 0).result()
    with aio.open_file(tmp_path / "rw", "w+") as f:
        round_trip(engine, f, random_bytes(3 * MiB, seed=8), 0)
    assert engine.counters()["errors"] >= 1


# -- futures ----------------------------------------------------------------------------------


def test_result_and_wait_twice_are_harmless(engine, tmp_path, random_bytes):
    with aio.open_file(tmp_path / "f", "w+") as f:
        fut = engine.pwrite(random_bytes(64 * KiB), f, 0)
        assert fut.wait() is True
        assert fut.wait(0) is True
        assert fut.result() == 64 * KiB
        assert fut.result(timeout=0) == 64 * KiB
        assert fut.done()


def test_failed_result_raises_every_time(engine, tmp_path, random_bytes, write_file):
    write_file(tmp_path / "f", random_bytes(4096))
    with aio.open_file(tmp_path / "f", "r") as f:
        fut = engine.pwrite(random_bytes(4096), f, 0)
        for _ in range(2):
            with pytest.raises(OSError) as exc:
                fut.result()
            assert exc.value.errno == errno.EBADF
        assert fut.wait() is True


def test_result_timeout_zero_on_pending_request(make_engine, tmp_path, random_bytes, write_file, hold_preadv):
    # Deterministic on the threads backend, whose reads are held at os.preadv; elsewhere a
    # read of 16 MiB in 4 KiB blocks, one at a time, is pending right after submit on any
    # real disk, and the check is skipped (not failed) in the rare case it is not.
    engine = make_engine(queue_depth=1, block_size=4096)
    data = random_bytes(16 * MiB, seed=9)
    write_file(tmp_path / "f", data)
    with aio.open_file(tmp_path / "f", "r") as f:
        back = aio.empty_aligned(data.numel())
        fut = engine.pread(back, f, 0)
        pending = not fut.done()
        if pending:
            assert fut.wait(0) is False
            with pytest.raises(TimeoutError, match="not done"):
                fut.result(timeout=0)
        hold_preadv()
        assert fut.result() == data.numel()
    assert torch.equal(back, data)
    if not pending:
        pytest.skip(f"the {engine.backend} read finished before it could be seen pending")


# -- close ------------------------------------------------------------------------------------


def test_close_finishes_writes_in_flight(make_engine, tmp_path, random_bytes, file_bytes):
    engine = make_engine(queue_depth=2, block_size=16 * KiB)
    data = random_bytes(64 * 64 * KiB, seed=11)
    with aio.open_file(tmp_path / "f", "w+") as f:
        futures = [engine.pwrite(data[i * 64 * KiB : (i + 1) * 64 * KiB], f, i * 64 * KiB) for i in range(64)]
        engine.close()
        assert engine.closed
        assert all(fut.done() for fut in futures)
        assert [fut.result() for fut in futures] == [64 * KiB] * 64
    assert torch.equal(file_bytes(tmp_path / "f", 0, data.numel()), data)


def test_close_finishes_reads_in_flight(make_engine, tmp_path, random_bytes, write_file):
    engine = make_engine(queue_depth=2, block_size=16 * KiB)
    data = random_bytes(64 * 64 * KiB, seed=12)
    write_file(tmp_path / "f", data)
    back = aio.empty_aligned(data.numel())
    with aio.open_file(tmp_path / "f", "r") as f:
        futures = [engine.pread(back[i * 64 * KiB : (i + 1) * 64 * KiB], f, i * 64 * KiB) for i in range(64)]
        engine.close()
        assert all(fut.done() for fut in futures)
        assert [fut.result() for fut in futures] == [64 * KiB] * 64
    assert torch.equal(back, data)


def test_close_cancel_fails_or_finishes_every_request(make_engine, tmp_path, random_bytes, file_bytes):
    engine = make_engine(queue_depth=1, block_size=4096)
    data = random_bytes(8 * MiB, seed=13)
    with aio.open_file(tmp_path / "f", "w+") as f:
        futures = [engine.pwrite(data, f, 0)]
        futures += [engine.pwrite(data[i * 64 * KiB : (i + 1) * 64 * KiB], f, 8 * MiB + i * 64 * KiB) for i in range(16)]
        engine.close(cancel=True)
        assert all(fut.done() for fut in futures)
        for i, fut in enumerate(futures):
            try:
                nbytes = fut.result()
            except OSError as e:
                assert e.errno == errno.ECANCELED, e
                continue
            if i == 0:
                assert nbytes == data.numel()
            else:
                assert nbytes == 64 * KiB
                got = file_bytes(f.path, 8 * MiB + (i - 1) * 64 * KiB, 64 * KiB)
                assert torch.equal(got, data[(i - 1) * 64 * KiB : i * 64 * KiB])


def test_close_twice_and_submit_after_close(engine, tmp_path):
    engine.close()
    engine.close()
    with aio.open_file(tmp_path / "f", "w+") as f:
        with pytest.raises(RuntimeError, match="closed"):
            engine.pwrite(aio.empty_aligned(4096), f, 0)


# -- buffers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.bool])
def test_typed_tensor_round_trip(engine, tmp_path, dtype):
    g = torch.Generator().manual_seed(14)
    nbytes = 257 * 4096
    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    src = aio.empty_aligned(nbytes).view(dtype)
    if dtype.is_floating_point:
        src.copy_(torch.randn(numel, generator=g).to(dtype))  # no NaNs, so torch.equal applies
    else:
        src.copy_(torch.randint(0, 2 if dtype == torch.bool else 1 << 62, (numel,), generator=g).to(dtype))
    dst = aio.empty_aligned(nbytes).view(dtype)
    dst.zero_()
    with aio.open_file(tmp_path / "f", "w+") as f:
        assert engine.pwrite(src, f, 0).result() == nbytes
        assert engine.pread(dst, f, 0).result() == nbytes
    assert torch.equal(dst, src)


def test_plain_torch_tensors_on_buffered_file(engine, tmp_path):
    # torch's allocator gives no 4 KiB alignment; a buffered file needs none.
    src = torch.randn(3, 1000, generator=torch.Generator().manual_seed(15))
    dst = torch.zeros_like(src)
    with aio.open_file(tmp_path / "f", "w+", direct=False) as f:
        assert engine.pwrite(src, f, 3).result() == src.nbytes
        assert engine.pread(dst, f, 3).result() == src.nbytes
    assert torch.equal(dst, src)


def test_bytearray_and_numpy_buffers(engine, tmp_path):
    data = np.random.default_rng(16).integers(0, 256, 100_000, dtype=np.uint8)
    src = bytearray(data.tobytes())
    dst = np.zeros(100_000, dtype=np.uint8)
    with aio.open_file(tmp_path / "f", "w+", direct=False) as f:
        assert engine.pwrite(src, f, 0).result() == len(src)
        assert engine.pread(dst, f, 0).result() == dst.nbytes
    assert torch.equal(torch.from_numpy(dst), torch.from_numpy(data))


def test_aligned_numpy_view_on_direct_file(engine, tmp_path, random_bytes):
    src = random_bytes(64 * KiB, seed=17)
    dst = aio.empty_aligned(64 * KiB).numpy().view(np.int32)  # aligned, not a tensor
    with aio.open_file(tmp_path / "f", "w+") as f:
        assert engine.pwrite(src.numpy(), f, 0).result() == src.numel()
        assert engine.pread(dst, f, 0).result() == dst.nbytes
    assert torch.equal(torch.from_numpy(dst).view(torch.uint8), src)


def test_read_only_bytes_can_be_written(engine, tmp_path, file_bytes):
    src = bytes(range(256)) * 16
    with aio.open_file(tmp_path / "f", "w+", direct=False) as f:
        assert engine.pwrite(src, f, 0).result() == len(src)
    assert file_bytes(tmp_path / "f", 0, len(src)).numpy().tobytes() == src


def test_non_contiguous_tensor_raises_value_error(engine, tmp_path):
    buf = torch.zeros(64, 128)[:, ::2]
    with aio.open_file(tmp_path / "f", "w+", direct=False) as f:
        with pytest.raises(ValueError, match="contiguous"):
            engine.pwrite(buf, f, 0)


def test_read_into_read_only_bytes_raises_type_error(engine, tmp_path):
    with aio.open_file(tmp_path / "f", "w+", direct=False) as f:
        with pytest.raises(TypeError, match="writable"):
            engine.pread(bytes(4096), f, 0)


def test_non_buffer_raises_type_error(engine, tmp_path):
    with aio.open_file(tmp_path / "f", "w+", direct=False) as f:
        with pytest.raises(TypeError):
            engine.pwrite([1, 2, 3], f, 0)


@pytest.mark.gpu
def test_cuda_tensor_raises_type_error(engine, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with aio.open_file(tmp_path / "f", "w+") as f:
        with pytest.raises(TypeError, match="host"):
            engine.pwrite(torch.zeros(4096, dtype=torch.uint8, device="cuda"), f, 0)


def test_engine_keeps_write_buffer_alive(make_engine, tmp_path, random_bytes, file_bytes):
    # The only reference to the source is the engine's; freeing it early would unmap the
    # pages under the kernel (empty_aligned is mmap-backed) and write garbage or crash.
    engine = make_engine(queue_depth=1, block_size=4096)
    nbytes = 4 * MiB
    expected = random_bytes(nbytes, seed=18).clone()
    with aio.open_file(tmp_path / "f", "w+") as f:
        tmp = aio.empty_aligned(nbytes)
        tmp.copy_(expected)
        fut = engine.pwrite(tmp, f, 0)
        del tmp
        gc.collect()
        scribble = [aio.empty_aligned(nbytes).fill_(0x5A) for _ in range(4)]  # reuse freed memory
        assert fut.result() == nbytes
        del scribble
    assert torch.equal(file_bytes(tmp_path / "f", 0, nbytes), expected)


def test_engine_keeps_read_buffer_alive(make_engine, tmp_path, random_bytes, write_file):
    # A read whose buffer the caller dropped must land in that buffer, kept alive by the
    # engine, and not in memory mapped afresh at the same address.
    engine = make_engine(queue_depth=1, block_size=4096)
    nbytes = 4 * MiB
    write_file(tmp_path / "f", random_bytes(nbytes, seed=19))
    with aio.open_file(tmp_path / "f", "r") as f:
        fut = engine.pread(aio.empty_aligned(nbytes), f, 0)
        gc.collect()
        scribble = [aio.empty_aligned(nbytes).fill_(0x5A) for _ in range(4)]
        assert fut.result() == nbytes
    for buf in scribble:
        assert bool((buf == 0x5A).all())


# -- registration -----------------------------------------------------------------------------


def test_registered_buffer_round_trips(make_engine, tmp_path, random_bytes, file_bytes):
    engine = make_engine(queue_depth=4, block_size=64 * KiB)
    arena = random_bytes(4 * MiB, seed=20)
    expected = arena.clone()
    engine.register_buffer(arena)
    with aio.open_file(tmp_path / "f", "w+") as f:
        assert engine.pwrite(arena, f, 0).result() == arena.numel()
        assert torch.equal(file_bytes(f.path, 0, arena.numel()), expected)
        arena.zero_()
        assert engine.pread(arena, f, 0).result() == arena.numel()
    assert torch.equal(arena, expected)
    if "fixed" in engine.counters():
        assert engine.counters()["fixed"] > 0


def test_sub_slices_of_registered_buffer_round_trip(make_engine, tmp_path, random_bytes):
    engine = make_engine(queue_depth=4, block_size=64 * KiB)
    arena = random_bytes(4 * MiB, seed=21)
    expected = arena.clone()
    engine.register_buffer(arena)
    pieces = [(0, 4096), (4096, 256 * KiB), (1 * MiB + 8192, 1 * MiB - 8192), (4 * MiB - 4096, 4096)]
    with aio.open_file(tmp_path / "f", "w+") as f:
        futures = [engine.pwrite(arena[lo : lo + n], f, 8 * MiB + lo) for lo, n in pieces]
        assert [fut.result() for fut in futures] == [n for _, n in pieces]
        arena.zero_()
        futures = [engine.pread(arena[lo : lo + n], f, 8 * MiB + lo) for lo, n in pieces]
        assert [fut.result() for fut in futures] == [n for _, n in pieces]
    for lo, n in pieces:
        assert torch.equal(arena[lo : lo + n], expected[lo : lo + n])
    if "fixed" in engine.counters():
        assert engine.counters()["fixed"] > 0


def test_unregistered_buffer_still_round_trips(engine, tmp_path, random_bytes, round_trip):
    arena = random_bytes(1 * MiB, seed=22)
    engine.register_buffer(arena)
    engine.unregister_buffer(arena)
    with aio.open_file(tmp_path / "f", "w+") as f:
        round_trip(engine, f, arena, 0)


def test_unregister_unknown_buffer_raises_value_error(engine):
    with pytest.raises(ValueError, match="not registered"):
        engine.unregister_buffer(aio.empty_aligned(4096))


def test_registered_file_round_trips(engine, tmp_path, random_bytes, round_trip):
    with aio.open_file(tmp_path / "f", "w+") as f:
        engine.register_file(f)
        round_trip(engine, f, random_bytes(2 * MiB + 4096, seed=23), 4096)


def test_closing_registered_file_unregisters_it(engine, tmp_path, random_bytes, round_trip):
    f = aio.open_file(tmp_path / "f", "w+")
    engine.register_file(f)
    engine.pwrite(random_bytes(4096), f, 0).result()
    f.close()
    err = _expect_oserror(lambda: engine.pwrite(random_bytes(4096), f, 0))
    assert err.errno == errno.EBADF
    # The engine (and its ring's file table) still serves other files.
    with aio.open_file(tmp_path / "g", "w+") as g:
        engine.register_file(g)
        round_trip(engine, g, random_bytes(64 * KiB, seed=24), 0)


def test_unregistered_file_still_round_trips(engine, tmp_path, random_bytes, round_trip):
    with aio.open_file(tmp_path / "f", "w+") as f:
        engine.register_file(f)
        engine.unregister_file(f)
        round_trip(engine, f, random_bytes(64 * KiB, seed=25), 0)


def test_register_raw_fd_raises_type_error(engine, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(TypeError, match="File"):
            engine.register_file(fd)
    finally:
        os.close(fd)


# -- engine arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,key",
    [
        (dict(queue_depth=0), "queue_depth"),
        (dict(queue_depth=-1), "queue_depth"),
        (dict(queue_depth=4097), "queue_depth"),
        (dict(block_size=1000), "block_size"),
        (dict(block_size=0), "block_size"),
        (dict(block_size=4096 + 512), "block_size"),
        (dict(block_size=2 * GiB), "block_size"),
    ],
    ids=lambda v: str(v),
)
def test_invalid_engine_args_raise_value_error(backend, kwargs, key):
    with pytest.raises(ValueError, match=rf"{key}=-?\d+"):
        aio.open_engine(backend, **kwargs)


def test_engine_refuses_use_after_fork(engine, tmp_path):
    """A forked child must open its own engine: the parent's threads do not exist there."""
    f = aio.open_file(tmp_path / "f", "w+")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report what happened through the pipe, never return into pytest
        status = b"no error"
        try:
            engine.pwrite(bytearray(4096), f, 0)
        except RuntimeError as e:
            status = b"RuntimeError" if b"after fork" in str(e).encode() else b"wrong message"
        engine.close()  # must not wait for the parent's worker thread
        os.write(write_end, status)
        os._exit(0)
    os.close(write_end)
    _, exit_status = os.waitpid(pid, 0)
    assert os.read(read_end, 100) == b"RuntimeError"
    assert exit_status == 0
    assert engine.pwrite(aio.empty_aligned(4096), f, 0).result() == 4096  # the parent's engine still works


def test_registering_a_larger_view_of_the_same_memory(make_engine, tmp_path, random_bytes, file_bytes):
    """Registration is keyed by address and length: buf[:n], then buf, are two registrations."""
    engine = make_engine(queue_depth=4, block_size=64 * 1024)
    buf = random_bytes(1 << 20, seed=7)
    engine.register_buffer(buf[: 64 * 1024])
    engine.register_buffer(buf)
    f = aio.open_file(tmp_path / "f", "w+")
    assert engine.pwrite(buf, f, 0).result() == buf.numel()
    assert torch.equal(file_bytes(tmp_path / "f", 0, buf.numel()), buf)
    if engine.backend == "uring":
        assert engine.counters()["fixed"] == 16  # every chunk lies inside the whole-buffer registration
    engine.unregister_buffer(buf)
    engine.unregister_buffer(buf[: 64 * 1024])


_SHORT_WRITE_CHILD = r"""
import errno, resource, signal, sys
import torch
import infinity.aio as aio
backend, path, limit, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
engine = aio.open_engine(backend, queue_depth=1, block_size=nbytes)  # one chunk: the kernel cuts it
buf = aio.empty_aligned(nbytes)
buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
buf.numpy().tofile(path + ".expected")
f = aio.open_file(path, "w+")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG instead of a signal
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    engine.pwrite(buf, f, 0).result()
except OSError as e:
    print(e.errno == errno.EFBIG, e.filename == path, engine.counters()["short"])
"""


def test_short_write_continues_then_reports_the_error(backend, tmp_path):
    """The kernel writes up to RLIMIT_FSIZE (a short write); the rest is asked again, which
    fails with EFBIG: the bytes before the limit are on disk and the error names the file."""
    import subprocess
    import sys

    path = str(tmp_path / "f")
    limit, nbytes = 1 * MiB + 4096, 2 * MiB  # aligned, so O_DIRECT may take the short write
    env = {**os.environ, aio.ENV_BACKEND: backend}
    out = subprocess.run([sys.executable, "-c", _SHORT_WRITE_CHILD, backend, path, str(limit), str(nbytes)],
                         capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    is_efbig, names_file, short = out.stdout.split()
    assert (is_efbig, names_file) == ("True", "True")
    assert int(short) >= 1
    expected = np.fromfile(path + ".expected", dtype=np.uint8)
    assert os.path.getsize(path) == limit
    assert np.array_equal(np.fromfile(path, dtype=np.uint8), expected[:limit])


@pytest.mark.uring
def test_an_urgent_read_overtakes_the_reads_waiting(tmp_path):
    """Behind 64 reads of 4 MiB (256 MiB waiting on a queue of 32 1-MiB chunks), an urgent
    read is cut into chunks next: it completes while most of them still wait. Without the
    urgent lane it would complete after all of them."""
    status = aio.probe()["uring"]
    if not status.available:
        pytest.skip(f"aio backend 'uring' unavailable: {status.reason}")
    engine = aio.open_engine("uring", queue_depth=32, block_size=1 * MiB)
    path = str(tmp_path / "data")
    try:
        with aio.open_file(path, "w+") as f:
            chunk = aio.empty_aligned(4 * MiB)
            chunk.fill_(1)
            for i in range(65):
                engine.pwrite(chunk, f, i * 4 * MiB).result()
            bufs = [aio.empty_aligned(4 * MiB) for _ in range(64)]
            waiting = [engine.pread(b, f, i * 4 * MiB) for i, b in enumerate(bufs)]
            urgent = aio.empty_aligned(4 * MiB)
            engine.pread(urgent, f, 64 * 4 * MiB, urgent=True).result()
            still = sum(not fut.done() for fut in waiting)
            for fut in waiting:
                fut.result()
        assert bool((urgent == 1).all())
        assert still >= 32, f"only {still} of the 64 earlier reads were still waiting"
    finally:
        engine.close()
