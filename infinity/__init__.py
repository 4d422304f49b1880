"""infinity: an NVMe-tiered offload engine for PyTorch training.

Subpackages: `infinity.aio` (async file I/O), `infinity.swap` (swap spaces, later issue),
`infinity.tools` (command-line tools). See the repository's DESIGN for the whole picture.
"""

__version__ = "0.1.0"
