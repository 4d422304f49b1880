"""One rank of test_inplace's several-rank runs; also run alone (1 rank).

argv: output prefix, stage, swap directory, tiers ("device,device,cpu"), how, param dtype.
One step, then new weights for the model's middle Linear, given ``how`` (every rank alike, as
`_common.write_layer` says; "load", of the whole module, is the reference); then two steps. Rank 0 writes the weights (``{out}.pt``): state_dict() right after the write and at the end.
"""

import os
import sys

import torch
from torch import nn

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_layer  # noqa: E402

out, stage, swap, tiers, how, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].split(","), sys.argv[5], sys.argv[6]
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))
cfg = {"tiers": dict(zip(("params", "grads", "optimizer"), tiers)), "nvme": {"paths": [swap], "grow_step": "4MiB"},
       "optimizer": {"lr": 1e-2}, "partition": {"stage": stage, "timeout": 20}, "precision": {"param_dtype": dtype}}  # fmt: skip
engine = infinity.initialize(model, cfg)
low = engine.module[2].weight.dtype


def steps(start, n):
    for step in range(start, start + n):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        per = 8 // world
        x, y = x[rank * per : (rank + 1) * per].to(low), y[rank * per : (rank + 1) * per].to(low)
        engine.backward(((engine(x) - y) ** 2).float().mean())
        engine.step()


steps(0, 1)
g = torch.Generator().manual_seed(99)
new = {"weight": torch.randn(32, 32, generator=g).to(low).float(), "bias": torch.randn(32, generator=g).to(low).float()}
write_layer(engine.module, "2", how, new, whole=engine.gathered_weights() if how == "load" else None)
after_write = engine.module.state_dict()
steps(1, 2)
final = engine.module.state_dict()
if rank == 0:
    torch.save({"after_write": after_write, "final": final}, f"{out}.pt")
engine.close()
