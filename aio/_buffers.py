"""Host buffers for the aio transport: normalising caller buffers, and aligned allocation.

Every buffer that crosses into a backend is reduced to a 1-D uint8 numpy view (`as_bytes`):
it gives one address and length for the C++ engine, a writable memoryview for the threads
backend, and it keeps the caller's object alive for as long as the view lives.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref

import numpy as np
import torch

PAGE_SIZE = mmap.PAGESIZE


def as_bytes(buffer, *, writable: bool) -> np.ndarray:
    """Return a 1-D uint8 view of ``buffer`` sharing its memory.

    ``buffer`` is a CPU torch tensor (any dtype, contiguous) or any object with the buffer
    protocol (bytes, bytearray, memoryview, numpy array, mmap). Reads need a writable one.
    """
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise TypeError(
                f"aio buffers must live in host memory, got a tensor on {buffer.device}; "
                "copy it to a host buffer (infinity.aio.empty_aligned) first"
            )
        if not buffer.is_contiguous():
            raise ValueError(
                f"aio buffers must be contiguous, got a tensor with shape={tuple(buffer.shape)} "
                f"stride={buffer.stride()}"
            )
        if buffer.is_sparse or buffer.is_quantized:
            raise TypeError(f"aio buffers must be dense tensors, got layout={buffer.layout}")
        arr = buffer.detach().reshape(-1).view(torch.uint8).numpy()
    else:
        try:
            view = memoryview(buffer)
        except TypeError:
            raise TypeError(
                f"aio buffers must be CPU tensors or support the buffer protocol, "
                f"got {type(buffer).__name__}"
            ) from None
        if not view.c_contiguous:
            raise ValueError(f"aio buffers must be C-contiguous, got shape={view.shape} strides={view.strides}")
        arr = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.empty(0, dtype=np.uint8)
    if writable and not arr.flags.writeable:
        raise TypeError(f"a read needs a writable buffer, got a read-only {type(buffer).__name__}")
    return arr


def address_of(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def _cuda_register(address: int, nbytes: int) -> None:
    # Portable: pinned for every CUDA context, not only the one current on the registering
    # thread (a pool slab may be made on any thread; each rank copies on its own GPU).
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister({address:#x}, {nbytes}) failed with CUDA error {int(err)}")


def _cuda_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


HUGE_PAGE_SIZE = 2 << 20

# [Note: huge pages for I/O buffers]
# A 1 MiB O_DIRECT transfer into 4 KiB pages is a scatter list of up to 256 segments, unless
# the pages happen to be physically adjacent. Devices cap the segments per request (virtio-blk
# here: 254; NVMe PRP/SGL lists cost per segment too), so scattered pages split one chunk into
# several device requests. Pages first touched by a multi-threaded fill (torch's copy_) are
# scattered; measured on this machine's disk, 1 MiB reads into such a buffer ran at 1.5 GB/s
# against 2.75 GB/s into the same buffer backed by huge pages. So buffers of 2 MiB and more
# are 2 MiB-aligned and advised MADV_HUGEPAGE (which also works where THP is "madvise" only):
# every chunk inside one huge page is one physical segment.


class _Mapping:
    """Owns one anonymous mapping (and its CUDA registration); freed with the last tensor."""

    def __init__(self, nbytes: int, pin: bool, huge: bool):
        self.mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self.mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # THP compiled out or disabled: 4 KiB pages still work
                pass
        # The ctypes array exports the buffer to torch and holds the mmap's export open;
        # the finaliser lives on the array, so CUDA is told before the pages are unmapped.
        self.array = (ctypes.c_uint8 * nbytes).from_buffer(self.mm)
        self.address = ctypes.addressof(self.array)
        if pin:
            _cuda_register(self.address, nbytes)
            weakref.finalize(self.array, _cuda_unregister, self.address)


def empty_aligned(
    nbytes: int, alignment: int = 4096, *, pin: bool | None = None, huge: bool | None = None
) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of ``nbytes`` whose data starts on an ``alignment`` boundary.

    The memory is anonymous (mmap), so io_uring can register it as a fixed buffer; from 2 MiB
    up it is 2 MiB-aligned and advised to use huge pages (see [Note: huge pages for I/O
    buffers]; ``huge=False`` opts out, ``huge=True`` opts in below 2 MiB). With
    ``pin=None`` it is also registered with CUDA (cudaHostRegister) when CUDA is available, so
    the same bytes serve O_DIRECT reads and asynchronous copies to the GPU.
    """
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"{nbytes=} must be a non-negative int")
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{alignment=} must be a positive power of two")
    if pin is None:
        pin = torch.cuda.is_available()
    # mmap returns page-aligned memory; a larger alignment is found inside a larger mapping.
    if huge is None:
        huge = nbytes >= HUGE_PAGE_SIZE
    if huge:
        alignment = max(alignment, HUGE_PAGE_SIZE)  # see [Note: huge pages for I/O buffers]
    slack = alignment - PAGE_SIZE if alignment > PAGE_SIZE else 0
    total = max(nbytes + slack, 1)
    mapping = _Mapping(total, pin, huge)
    tensor = torch.frombuffer(mapping.array, dtype=torch.uint8)
    skip = -mapping.address % alignment
    return tensor[skip : skip + nbytes]
