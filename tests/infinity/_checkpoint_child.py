"""A separate process for tests/infinity/test_checkpoint.py.

argv: mode, then its arguments.
- ``resume OUT CKPT_ROOT PLACEMENT...``: for each placement (e.g. ``nvme-cpu-device``), a fresh
  model under another seed, load CKPT_ROOT/<placement>, train 5 more steps; the final weights of
  every placement go to OUT (a safetensors-free .pt of plain tensors, read with weights_only).
- ``save-forever CKPT_ROOT SWAP``: train and save a checkpoint after every step, forever; prints
  "saved <tag>" after each (the test kills it with SIGKILL in the middle of one).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, make_model, train  # noqa: E402

import infinity  # noqa: E402

mode = sys.argv[1]
# Threads are left as the parent has them: CPU kernels may round differently with another count,
# and that would be the test's doing, not the checkpoint's.
if mode == "resume":
    out, root, placements = sys.argv[2], sys.argv[3], sys.argv[4:]
    results = {}
    for placement in placements:
        swap = os.path.join(root, f"swap-{placement}-child")
        os.makedirs(swap, exist_ok=True)
        torch.manual_seed(1234)  # not the seed the checkpoint was made with: load must restore it
        engine = infinity.initialize(make_model(seed=77), config(swap, placement.split("-")))
        engine.load_checkpoint(os.path.join(root, placement))
        train(engine, 5, start=5)
        for name, w in engine.gathered_weights().items():
            results[f"{placement}/{name}"] = w
        engine.close()
    torch.save(results, out)
elif mode == "save-forever":
    root, swap = sys.argv[2], sys.argv[3]
    engine = infinity.initialize(make_model(seed=0, width=512), config(swap, ["nvme"] * 3))
    step = 0
    while True:
        train(engine, 1, start=step)
        step += 1
        tag = os.path.basename(engine.save_checkpoint(root))
        print(f"saved {tag}", flush=True)
else:
    sys.exit(f"unknown mode {mode!r}")
