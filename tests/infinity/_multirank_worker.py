"""One rank of a multi-rank test (tests/infinity/test_multirank.py); also run alone (1 rank).

argv: mode (parity | seeded | routed | load | gather | clip | dead | mismatch | ckpt-save | ckpt-load), output path prefix, stage, swap
directory, and for the ckpt modes the checkpoint root. The global batch of every step is the
same whatever the world size; rank r takes its 1/N.

Modes save and save-alone: parity's steps, then (save) every rank calls
``engine.module.state_dict()`` and ``engine.export`` ({out}.export.safetensors); rank 0 writes the
state_dict ({out}.state_dict.pt), each rank the number of its keys ({out}.{rank}.keys.json); or
(save-alone) rank 0 alone calls state_dict(), as DDP's idiom does, and the other ranks wait for
its error file and exit.

ckpt-save: 5 steps, save, 5 more steps. ckpt-load: load (into any world size and stage), 5
steps. Rank 0 writes the weights right after the save or load ({out}.at_ckpt.pt) and at the end
({out}.weights.pt), so the test can check that a resharded load is exact and trains on alike.
"""

import json
import os
import sys
import time

import torch
from torch import nn

import infinity



class SimulatedFailure(Exception):
    """Raised by rank 1 in "dead" mode and left uncaught, as a user's bug would be."""


mode, out, stage, swap_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ckpt = sys.argv[5] if len(sys.argv) > 5 else None
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
torch.set_num_threads(1)
torch.manual_seed(rank if mode == "seeded" else 0)  # seeded: parity's, each rank its own seed before the build
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 4))
if mode == "routed":  # each rank's forward takes its own head, of one shape: a task's, an expert
    class Routed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 4), nn.Linear(64, 4)

        def forward(self, x):
            return (self.a if rank == 0 else self.b)(torch.tanh(self.body(x)))

    model = Routed()
lr = 2e-3 if (mode == "mismatch" and rank == 1) else 1e-2
cfg = {"tiers": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "nvme": {"paths": [swap_dir], "grow_step": "4MiB"},
       "optimizer": {"lr": lr}, "partition": {"stage": stage, "timeout": 10}}  # fmt: skip
# The test's memory.tile_size, if any: every Linear over it in tiles (docs/architecture.md#tiles).
cfg["memory"] = {"tile_size": os.environ.get("INFINITY_TEST_TILE_SIZE") or None}
if os.environ.get("INFINITY_TEST_DISK_FREE"):  # what statvfs says every filesystem has free
    from infinity import _footprint

    _footprint.disk_free = lambda path: int(os.environ["INFINITY_TEST_DISK_FREE"])
try:
    engine = infinity.initialize(model, cfg)
except ValueError as e:
    open(f"{out}.{rank}.err", "w").write(str(e))
    sys.exit(3)

if mode == "routed":
    x, y = torch.randn(6, 16), torch.randn(6, 4)
    engine.backward(((engine(x) - y) ** 2).mean())
    try:
        engine.step()
    except RuntimeError as e:
        open(f"{out}.{rank}.err", "w").write(str(e))
        sys.exit(4)
    sys.exit(0)

if mode.startswith("ckpt"):
    def run(steps, start):
        for step in range(start, start + steps):
            g = torch.Generator().manual_seed(step)
            x, y = (t.to(engine.device) for t in (torch.randn(12, 16, generator=g), torch.randn(12, 4, generator=g)))
            per = 12 // world
            loss = ((engine(x[rank * per : (rank + 1) * per]) - y[rank * per : (rank + 1) * per]) ** 2).mean()
            engine.backward(loss)
            engine.step()

    if mode == "ckpt-save":
        run(5, 0)
        engine.save_checkpoint(ckpt, client_state={"world": world})
    else:
        assert engine.load_checkpoint(ckpt)[1] == {"world": 2}
    at_ckpt = engine.gathered_weights()
    run(5, 5)
    weights = engine.gathered_weights()
    if rank == 0:
        torch.save(at_ckpt, f"{out}.at_ckpt.pt")
        torch.save(weights, f"{out}.weights.pt")
    engine.close()
    sys.exit(0)

losses, reads, norms = [], [], []
g = torch.Generator().manual_seed(1)
try:
    for step in range(5):
        x, y = (t.to(engine.device) for t in (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)))
        per = 8 // world
        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        if mode == "dead" and rank == 1 and step == 2:
            raise SimulatedFailure("simulated failure in the training loop")
        if mode == "gather":  # parity's steps, each after a read-only gather (nested) of a weight
            w = engine.module[2].weight
            with infinity.GatheredParameters([w]):
                with infinity.GatheredParameters([w]):
                    inner = w.detach().clone()
                if inner.shape != (64, 64) or not torch.equal(w.detach(), inner):
                    raise RuntimeError(f"the outer gather lost its weight: {tuple(w.shape)} after the inner exit")
        loss = ((engine(xs) - ys) ** 2).mean()
        engine.backward(loss)
        if mode == "clip":  # torch's clipping over the engine's parameters, every step clipped
            norms.append(float(torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.05)))
        engine.step()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
            total /= world
        losses.append(float(total))
        reads.append(engine.stats()["step"]["nvme"]["read_bytes"])
    weights = engine.gathered_weights()
    if mode == "save-alone":
        if rank == 0:
            engine.module.state_dict()
        else:  # no collective meanwhile: rank 0's refusal must come from the meeting itself
            while not os.path.exists(f"{out}.0.err"):
                time.sleep(0.1)
            sys.exit(0)
    if mode == "load":  # the DDP idiom's dict (rank 1's empty), then the same file on every rank
        state = engine.module.state_dict()
        try:
            engine.module.load_state_dict({k: v * 2 for k, v in state.items()}, strict=False)
            refused = ""
        except ValueError as e:
            refused = str(e)
        if rank == 0:
            torch.save({k: v * 2 for k, v in state.items()}, f"{out}.doubled.pt")
        torch.distributed.barrier()
        engine.module.load_state_dict(torch.load(f"{out}.doubled.pt", weights_only=True), strict=True)
        weights = engine.gathered_weights()
        json.dump({"refused": refused}, open(f"{out}.{rank}.load.json", "w"))
    if mode == "save":
        state = engine.module.state_dict()
        engine.export(f"{out}.export.safetensors")
        if rank == 0:
            torch.save(state, f"{out}.state_dict.pt")
        with infinity.GatheredParameters(list(engine.module.parameters())):  # DeepSpeed's idiom: rank 0 alone reads
            if rank == 0:
                torch.save(engine.module.state_dict(), f"{out}.gathered_state_dict.pt")
        json.dump({"keys": len(state)}, open(f"{out}.{rank}.keys.json", "w"))
except RuntimeError as e:
    open(f"{out}.{rank}.err", "w").write(str(e))
    sys.exit(4)
if rank == 0:
    torch.save(weights, f"{out}.weights.pt")
count = sum(p.numel() for p in engine.module.parameters())  # the model's, on every rank
json.dump({"losses": losses, "reads": reads, "disk": engine.stats()["disk"], "norms": norms, "count": count},
          open(f"{out}.{rank}.json", "w"))  # fmt: skip
engine.close()
# Everything is written and the engine closed. Left to the interpreter's finalisation, gloo's
# threads still abort an exit now and then ("terminate called without an active exception": 1
# of about 20 two-rank exits here, after all the work; see infinity/_dist.py), which would fail
# a parity test over its teardown: this worker leaves without finalisation.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
