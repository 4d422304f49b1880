"""infinity.aio.empty_aligned: size, alignment, and the lifetime of its memory."""

from __future__ import annotations

import gc

import pytest
import torch

import infinity.aio as aio

KiB = 1 << 10
MiB = 1 << 20


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 3 * 4096 + 7, 1 * MiB], ids=lambda n: f"{n}B")
def test_size_and_type(nbytes):
    buf = aio.empty_aligned(nbytes)
    assert buf.shape == (nbytes,)
    assert buf.dtype == torch.uint8
    assert buf.device.type == "cpu"
    assert buf.is_contiguous()


@pytest.mark.parametrize("alignment", [1, 64, 4096, 64 * KiB, 1 * MiB, 2 * MiB], ids=lambda a: f"align{a}")
@pytest.mark.parametrize("nbytes", [4096, 5 * MiB + 3], ids=lambda n: f"{n}B")
def test_alignment(nbytes, alignment):
    buf = aio.empty_aligned(nbytes, alignment)
    assert buf.data_ptr() % alignment == 0
    assert buf.numel() == nbytes


def test_default_alignment_is_4096():
    assert aio.empty_aligned(100).data_ptr() % 4096 == 0


@pytest.mark.parametrize("alignment", [4096, 1 * MiB])
def test_zero_bytes(alignment):
    buf = aio.empty_aligned(0, alignment)
    assert buf.numel() == 0
    assert buf.dtype == torch.uint8


@pytest.mark.parametrize(
    "kwargs,key",
    [
        (dict(nbytes=-1), "nbytes"),
        (dict(nbytes=4096.0), "nbytes"),
        (dict(nbytes=4096, alignment=0), "alignment"),
        (dict(nbytes=4096, alignment=-4096), "alignment"),
        (dict(nbytes=4096, alignment=3000), "alignment"),
        (dict(nbytes=4096, alignment=4096.0), "alignment"),
    ],
    ids=lambda v: str(v),
)
def test_bad_args_raise_value_error(kwargs, key):
    with pytest.raises(ValueError, match=f"{key}="):
        aio.empty_aligned(**kwargs)


def _filled(nbytes: int, alignment: int) -> torch.Tensor:
    buf = aio.empty_aligned(nbytes, alignment)
    buf.copy_(torch.arange(nbytes, dtype=torch.int64).remainder_(251).to(torch.uint8))
    return buf


@pytest.mark.parametrize("alignment", [4096, 1 * MiB])
def test_memory_outlives_the_call(alignment):
    # The mapping must be owned by the tensor, not by a local of empty_aligned.
    nbytes = 2 * MiB + 5
    buf = _filled(nbytes, alignment)
    gc.collect()
    others = [aio.empty_aligned(nbytes, alignment).fill_(0xEE) for _ in range(4)]
    expected = torch.arange(nbytes, dtype=torch.int64).remainder_(251).to(torch.uint8)
    assert torch.equal(buf, expected)
    del others


def test_view_keeps_memory_alive():
    nbytes = 1 * MiB
    view = _filled(nbytes, 1 * MiB)[4096:8192]
    gc.collect()
    others = [aio.empty_aligned(nbytes, 1 * MiB).fill_(0xEE) for _ in range(4)]
    expected = torch.arange(nbytes, dtype=torch.int64).remainder_(251).to(torch.uint8)[4096:8192]
    assert torch.equal(view, expected)
    del others


def test_typed_view_is_writable():
    buf = aio.empty_aligned(4096).view(torch.float32)
    buf.fill_(1.5)
    assert float(buf.sum()) == 1.5 * 1024


@pytest.mark.gpu
def test_pinned_for_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    buf = aio.empty_aligned(1 * MiB, pin=True)
    assert buf.is_pinned()
    buf.fill_(7)
    dev = buf.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert bool((dev == 7).all())


def _anon_huge_kib_of(buf: torch.Tensor) -> int:
    """AnonHugePages of the mapping holding ``buf`` (from /proc/self/smaps)."""
    address = buf.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_large_buffers_are_2mib_aligned_for_huge_pages():
    """See [Note: huge pages for I/O buffers]: from 2 MiB up a buffer starts on a huge page."""
    assert aio.empty_aligned(2 * MiB).data_ptr() % (2 * MiB) == 0
    assert aio.empty_aligned(6 * MiB + 4096).data_ptr() % (2 * MiB) == 0


def test_large_buffers_get_huge_pages_where_the_kernel_has_them():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("no transparent huge pages in this kernel")
    if "[never]" in mode:
        pytest.skip(f"transparent huge pages disabled: {mode.strip()}")
    buf = aio.empty_aligned(8 * MiB)
    buf.fill_(1)  # fault the pages in
    if _anon_huge_kib_of(buf) == 0:
        pytest.skip("the kernel had no free huge page (fragmented memory)")  # advice, not a promise
    assert _anon_huge_kib_of(buf) % 2048 == 0
    if "[madvise]" in mode:  # with THP "always" every mapping may get huge pages anyway
        small = aio.empty_aligned(8 * MiB, huge=False)
        small.fill_(1)
        assert _anon_huge_kib_of(small) == 0
