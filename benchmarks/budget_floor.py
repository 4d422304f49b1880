"""The smallest ``memory.host_budget`` `initialize` accepts for a model, with and without tiles.

Builds the model on the meta device (`infinity.build`: nothing is allocated or written) and
asks `initialize` with a budget of one page, which refuses it with `infinity.HostBudgetError`
naming what the run needs; that need is the floor. The error also carries the budget from
which the optimizer runs under backward (``optimizer.overlap``), reported beside it. By
default the Llama-shaped model of ``benchmarks/scale.py`` (953M parameters), all tiers on
nvme, for each memory.tile_size and optimizer.sub_group_size given.

    python benchmarks/budget_floor.py [--tile-size none 32MiB 16MiB] [--sub-group-size 256MiB 64MiB]
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
from pathlib import Path

from scale import add_model_args, llama_config  # this directory: the same model


def floor(args, tile: str, sub_group: str, swap: str) -> tuple[int, str, int | None]:
    """(the floor in bytes, what sets it, the budget overlap applies from) for one config."""
    import transformers

    import infinity

    cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "nvme": {"paths": [swap]},
           "memory": {"host_budget": 4096, "tile_size": None if tile == "none" else tile},
           "optimizer": {"sub_group_size": sub_group}}  # fmt: skip
    with infinity.build(cfg):
        model = transformers.LlamaForCausalLM(llama_config(args))
    try:
        infinity.initialize(model, cfg).close()
    except infinity.HostBudgetError as e:
        return e.need, e.what, e.overlap_from
    raise RuntimeError("initialize accepted a budget of 4096 bytes")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--tile-size", nargs="+", default=["none", "32MiB", "16MiB"])
    p.add_argument("--sub-group-size", nargs="+", default=["256MiB", "64MiB", "32MiB"])
    args = p.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    swap = tempfile.mkdtemp(prefix="budget-floor-", dir=args.dir)
    try:
        print(f"{'tile_size':>10} {'sub_group_size':>15} {'floor':>10} {'overlap from':>13}  floor set by")
        for tile, group in itertools.product(args.tile_size, args.sub_group_size):
            need, what, overlap = floor(args, tile, group, swap)
            overlap = "-" if overlap is None else f"{overlap / 2**20:.0f}MiB"
            print(f"{tile:>10} {group:>15} {need / 2**20:>7.0f}MiB {overlap:>13}  the {what}", flush=True)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
