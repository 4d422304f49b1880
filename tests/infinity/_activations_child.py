"""Run by test_activations.py in a fresh process: train a stack of checkpointed MLP blocks at
a long sequence with ``[activations] tier`` as given, and print (as JSON) the peak RSS growth of
the second step over the RSS before it, and the activation bytes that step moved."""

import json
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity
from _common import peak_rss, rss  # this directory (the script's own, first on sys.path)

path, tier, layers, tokens, hidden = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(2)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(Block())

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)  # keeps each block's input only
        return x


cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "nvme": {"paths": [path]},
       "memory": {"host_budget": "64MiB"}, "optimizer": {"lr": 1e-3, "overlap": False, "sub_group_size": "4MiB"},
       "activations": {"tier": tier, "min_bytes": "1MiB"}}  # fmt: skip
torch.manual_seed(0)
x = torch.randn(tokens, hidden)
with infinity.initialize(Stack(), cfg) as engine:
    for step in range(2):
        if step == 1:  # the first step grew what every step uses (the pool, torch's allocator)
            open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) back to the RSS now
            base = rss()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    st = engine.stats()["step"]
    print(json.dumps({"growth": peak_rss() - base, "out": st["activation_out_bytes"], "in": st["activation_in_bytes"]}))
