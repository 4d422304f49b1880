"""Constants and small helpers of the swap layer that need no torch (the config imports them).

Each is defined here once; `infinity.swap` re-exports them.
"""

from __future__ import annotations

from infinity.aio import ALIGNMENT

# When a SwapSpace's reads check the xxh3-64 checksum that every write records (see [Note:
# checksums] in _manifest.py): "always" (the default), every `get`; "off" and "checkpoint", not
# on `get` ("checkpoint" is for the layers above: checkpoint loads check).
VERIFY_MODES = ("off", "checkpoint", "always")

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def round_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (nbytes + alignment - 1) & -alignment


def human_size(nbytes: int) -> str:
    """Bytes for people: exact and short where it can be ("64MiB", "96B"), else "1.5GiB"."""
    if nbytes < 1024:
        return f"{nbytes}B"
    k = min(len(_UNITS) - 1, (nbytes.bit_length() - 1) // 10)
    for shift in range(k, 0, -1):  # the largest unit that divides it, if the number stays short
        if nbytes % (1 << 10 * shift) == 0 and nbytes >> 10 * shift < 1000:
            return f"{nbytes >> 10 * shift}{_UNITS[shift]}"
    return f"{nbytes / (1 << 10 * k):.1f}{_UNITS[k]}"
