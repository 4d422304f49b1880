"""infinity.swap: named tensors in swap spaces on NVMe, and the host memory they move through.

- `SwapSpace`: tensors under stable names in preallocated arena files, one per drive, striped,
  with a manifest (JSON, written atomically) and xxh3-64 checksums;
- `HostBufferPool`: every host buffer under one byte budget, registered once with the engine;
- `stream`: read ahead, compute, write behind over a sequence of names;
- `WriteBehind`: writes in flight from host buffers, bounded, their errors never lost;
- `SpaceReader`: a read-only view of a space (what swap-inspect uses);
- `write_json_atomic`, `write_bytes_atomic`, `fsync_dir`, `read_json`, `parse_json`: the durable-file helpers
  the manifest uses, for the layers above (checkpoints, export).

The constants (`ALIGNMENT`, `VERIFY_MODES`) and `round_up`, `human_size` load without torch;
everything else on first use (PEP 562), so `import infinity.config` stays light.
"""

from ._common import ALIGNMENT, VERIFY_MODES, human_size, round_up
from ._writes import WriteBehind

_LAZY = {
    "ExtentAllocator": "._allocator",
    "OutOfSpace": "._allocator",
    "SwapCorruption": "._checksum",
    "DTYPES": "._manifest",
    "LOCK_NAME": "._manifest",
    "MANIFEST_NAME": "._manifest",
    "SPACE_NAME": "._manifest",
    "Extent": "._manifest",
    "Manifest": "._manifest",
    "ManifestError": "._manifest",
    "TensorRecord": "._manifest",
    "dtype_name": "._manifest",
    "fsync_dir": "._manifest",
    "is_space_file": "._manifest",
    "parse_json": "._manifest",
    "read_json": "._manifest",
    "write_bytes_atomic": "._manifest",
    "write_json_atomic": "._manifest",
    "Item": "._pipeline",
    "Joined": "._pipeline",
    "JoinedRead": "._pipeline",
    "stream": "._pipeline",
    "HostBuffer": "._pool",
    "HostBufferPool": "._pool",
    "PoolExhausted": "._pool",
    "SpaceReader": "._reader",
    "SwapFuture": "._space",
    "SwapSpace": "._space",
}

__all__ = ["ALIGNMENT", "VERIFY_MODES", "WriteBehind", "human_size", "round_up", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
