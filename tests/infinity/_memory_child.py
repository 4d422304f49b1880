"""Run by test_memory.py in a fresh process: build, initialise and train an all-nvme model and
print (as JSON) its fp32 state bytes and the peak RSS growth from before the model existed."""

import json
import os
import sys

import torch
from torch import nn

import infinity
from _common import peak_rss, rss  # this directory (the script's own, first on sys.path)

path, width, layers, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# Optional: a vocabulary (an embedding in front, an output layer behind), the tile size and
# the sub-group size.
vocab = int(sys.argv[5]) if len(sys.argv) > 5 else 0
tile = sys.argv[6] if len(sys.argv) > 6 else "64MiB"
sub_group = sys.argv[7] if len(sys.argv) > 7 else "16MiB"
# Two threads in a cold run: torch's workers allocate too (where the heap grew: [Note: malloc threshold]).
torch.set_num_threads(2 if len(sys.argv) > 8 and sys.argv[8] == "cold" else 1)
os.makedirs(path + "-warm", exist_ok=True)
cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
       "nvme": {"paths": [path], "grow_step": "64MiB"}, "memory": {"host_budget": budget, "tile_size": tile},
       "optimizer": {"sub_group_size": sub_group}, "prefetch": {"depth": 2}}  # fmt: skip
# Warm up what every run pays once (torch's allocator, autograd, the aio engine) on a tiny model.
# "cold": torch only, so that `build` is the first thing of infinity the process runs, as in a
# user's script (what glibc is told before the build's frees matters: [Note: malloc threshold]).
if len(sys.argv) > 8 and sys.argv[8] == "cold":
    tiny = nn.Linear(4, 4)
    tiny(torch.randn(2, 4)).sum().backward()
    torch.optim.AdamW(tiny.parameters()).step()
else:
    with infinity.initialize(nn.Linear(4, 4), {**cfg, "nvme": {"paths": [path + "-warm"]}}) as warm:
        warm.backward(warm(torch.randn(2, 4)).sum())
        warm.step()
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
base = rss()

class Stack(nn.Module):
    """Registers each layer as it makes it, as real models do (a list built first and wrapped
    afterwards would hold every layer before build sees any)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(vocab, width) if vocab else None
        self.layers = nn.ModuleList()
        for _ in range(layers):
            self.layers.append(nn.Linear(width, width))
        self.out = nn.Linear(width, vocab) if vocab else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x) if self.out is not None else x


with infinity.build(cfg):
    model = Stack()
largest_module = 4 * max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
engine = infinity.initialize(model, cfg)
# The peak of initialize, then the peak of training over the RSS it left (what the steps add).
init_peak, after_init = peak_rss(), rss()
open("/proc/self/clear_refs", "w").write("5")
for _ in range(2):
    x = torch.randint(0, vocab, (8,)) if vocab else torch.randn(8, width)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
numel = sum(u.numel for u in engine.units)
stats = engine.stats()
train_peak = peak_rss()
print(json.dumps({"state_bytes": 16 * numel, "growth": max(init_peak, train_peak) - base,
                  "training_growth": train_peak - after_init, "pool_peak": stats["peak_host_pool_bytes"],
                  "peak_rss": train_peak, "stats_peak_rss": stats.get("peak_rss_bytes"),
                  "largest_unit_bytes": 4 * max(u.numel for u in engine.units), "params": numel,
                  "largest_module_bytes": largest_module,
                  "tiles": sum(u.is_tile for u in engine.units)}))  # fmt: skip
engine.close()
