"""infinity.swap: named tensors in swap spaces on NVMe, and the host memory they move through.

- `SwapSpace`: tensors under stable names in preallocated arena files, one per drive, striped,
  with a manifest (JSON, written atomically) and optional xxh3-64 checksums;
- `HostBufferPool`: every host buffer under one byte budget, registered once with the engine;
- `stream`: read ahead, compute, write behind over a sequence of names;
- `SpaceReader`: a read-only view of a space (what swap-inspect uses).
"""

from ._allocator import ExtentAllocator, OutOfSpace
from ._checksum import SwapCorruption
from ._manifest import (
    LOCK_NAME,
    MANIFEST_NAME,
    SPACE_NAME,
    Extent,
    Manifest,
    ManifestError,
    TensorRecord,
    is_space_file,
)
from ._pipeline import Item, stream
from ._pool import HostBuffer, HostBufferPool, PoolExhausted
from ._reader import SpaceReader
from ._space import SwapFuture, SwapSpace

__all__ = [
    "LOCK_NAME",
    "MANIFEST_NAME",
    "SPACE_NAME",
    "Extent",
    "ExtentAllocator",
    "HostBuffer",
    "HostBufferPool",
    "Item",
    "Manifest",
    "ManifestError",
    "OutOfSpace",
    "PoolExhausted",
    "SpaceReader",
    "SwapCorruption",
    "SwapFuture",
    "SwapSpace",
    "TensorRecord",
    "is_space_file",
    "stream",
]
