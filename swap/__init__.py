"""infinity.swap: named tensors in swap spaces on NVMe (built in the swap-layer issue)."""
