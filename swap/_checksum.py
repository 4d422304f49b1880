"""Checksums of swapped bytes: xxh3-64, which runs at about 30 GB/s on one core here.

A checksum is stored as "xxh3-64:<16 hex digits>" so the algorithm can change with the
manifest's version without ambiguity.
"""

from __future__ import annotations

import xxhash

PREFIX = "xxh3-64:"


class SwapCorruption(OSError):
    """Bytes read back do not match the checksum written with them.

    ``tensor`` names the tensor; ``filename`` and ``offset`` the first extent of it (the
    checksum covers the whole tensor, so the bad byte may be in any of its extents).
    """

    def __init__(self, tensor: str, filename: str, offset: int, expected: str, actual: str):
        super().__init__(
            f"checksum mismatch in tensor {tensor!r} (first extent at offset {offset}): "
            f"manifest has {expected}, the bytes read give {actual}"
        )
        self.tensor = tensor
        self.filename = filename
        self.offset = offset
        self.expected = expected
        self.actual = actual

    def __str__(self) -> str:
        return f"{self.args[0]}: {self.filename!r}"


def checksum(data) -> str:
    """xxh3-64 of a buffer (a uint8 numpy array or anything with the buffer protocol)."""
    return f"{PREFIX}{xxhash.xxh3_64_hexdigest(data)}"


def checksum_parts(parts) -> str:
    """xxh3-64 of the concatenation of ``parts``, without concatenating them."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return f"{PREFIX}{h.hexdigest()}"
