"""The smallest ``memory.host_budget`` `initialize` accepts for a model, with and without tiles.

A table over memory.tile_size and optimizer.sub_group_size of what `infinity-estimate` (one
config at a time, every placement) prints as the floor: the figures are `infinity._estimate`'s,
the engine's own plan on a model built on the meta device (nothing is allocated or written).
Beside the floor, the budget from which the optimizer runs under backward (``optimizer.overlap``).
By default the Llama-shaped model of ``benchmarks/scale.py`` (953M parameters), all tiers on nvme.

    python benchmarks/budget_floor.py [--tile-size none 32MiB 16MiB] [--sub-group-size 256MiB 64MiB]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from scale import add_model_args, llama_config  # this directory: the same model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--tile-size", nargs="+", default=["none", "32MiB", "16MiB"])
    p.add_argument("--sub-group-size", nargs="+", default=["256MiB", "64MiB", "32MiB"])
    args = p.parse_args(argv)
    import transformers

    from infinity import _estimate

    transformers.logging.set_verbosity_error()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    config = llama_config(args)
    print(f"{'tile_size':>10} {'sub_group_size':>15} {'floor':>10} {'overlap from':>13}  floor set by")
    for tile, group in itertools.product(args.tile_size, args.sub_group_size):
        cfg = {"nvme": {"paths": [args.dir]}, "memory": {"tile_size": None if tile == "none" else tile},
               "optimizer": {"sub_group_size": group}}  # fmt: skip
        (e,) = _estimate.estimate(lambda: transformers.LlamaForCausalLM(config), cfg,
                                  placements={"nvme": ("nvme", "nvme", "nvme")})  # fmt: skip
        overlap = "-" if e.overlap_from is None else f"{e.overlap_from / 2**20:.0f}MiB"
        print(f"{tile:>10} {group:>15} {e.floor / 2**20:>7.0f}MiB {overlap:>13}  the {e.floor_what}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
