"""Config, model and data shared by the tests in tests/infinity and their child processes."""

import os
import weakref

import torch
from torch import nn

from infinity._resources import proc_bytes
from infinity._stats import peak_rss_bytes


def rss() -> int:
    """The process's resident set now, in bytes."""
    return proc_bytes("/proc/self/status", "VmRSS")


def peak_rss() -> int:
    """Its peak (VmHWM; a write of "5" to /proc/self/clear_refs resets it to the RSS now)."""
    return peak_rss_bytes()


def make_model(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    # Dropout draws from the RNG: a resume is only exact if the RNG state comes back too.
    return nn.Sequential(nn.Linear(16, width), nn.Dropout(0.2), nn.GELU(), nn.Linear(width, width),
                         nn.LayerNorm(width), nn.Linear(width, 4))  # fmt: skip


def config(swap: str, tiers, **sections) -> dict:
    params, grads, optimizer = tiers
    cfg = {"tiers": {"params": params, "grads": grads, "optimizer": optimizer},
           "nvme": {"paths": [str(swap)], "grow_step": "4MiB"}, "memory": {"host_budget": "256MiB"},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}  # fmt: skip
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return cfg


def train(engine, steps: int, start: int = 0, dtype=torch.float32, out: int = 4) -> list[float]:
    """``steps`` steps on batches that depend only on the step number (same data order): 16
    features in, ``out`` out."""
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, out, generator=g).to(dtype)
        loss = ((engine(x) - y) ** 2).float().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().item())
    return losses


class Plain:
    """A plain model and its torch optimizer behind the engine's loop (``model(x)``,
    ``backward(loss)``, ``step()``), so that `train` drives the plain PyTorch side too."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()


def trains_as_plain(engine, plain: nn.Module, x: torch.Tensor, steps: int = 2) -> None:
    """``steps`` steps of the loss ``model(x).pow(2).mean()`` on ``engine`` and on ``plain``
    (torch's AdamW at `config`'s lr and weight decay), then the engine's weights checked against
    plain's (to fp32 rounding)."""
    sides = (engine, Plain(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)))
    for _ in range(steps):
        for side in sides:
            side.backward(side(x).pow(2).mean())
            side.step()
    got = engine.gathered_weights()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-7)


def cpu_unless_gpus(ranks: int) -> dict:
    """The environment that hides the GPUs when there are fewer than ``ranks`` (one H100, two
    ranks): the ranks then use gloo on the CPU, since NCCL needs a GPU per rank and the engine
    refuses to share one (_dist._own_gpu)."""
    short = torch.cuda.is_available() and torch.cuda.device_count() < ranks
    return {"CUDA_VISIBLE_DEVICES": ""} if short else {}


def rank_env(rank: int, world: int, port: int, gpus_needed: int | None = None) -> dict:
    """The environment torchrun gives rank ``rank`` of ``world`` on this machine, on the CPU
    where there are fewer GPUs than ``gpus_needed`` (default ``world``). A test that compares a
    1-rank run with a 2-rank run passes 2 for both, so that both compute on the same device."""
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            **cpu_unless_gpus(gpus_needed or world)}  # fmt: skip


class GivesNoGrad(torch.autograd.Function):
    """``apply(x, weight)``: ``2 x``, and no gradient (None) for ``weight``, as a custom kernel
    that reads a parameter only for shapes may give."""

    @staticmethod
    def forward(ctx, x, weight):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


def adopted_gradients(engine, steps: int, plain_step=None) -> list[list[bool]]:
    """Train ``steps`` steps of a bias-free MLP (its units one parameter each: the gradients
    backward made become the grads tier's tensors, `Store.adopt`); after each step, which of
    every earlier step's adopted gradients are still alive. ``plain_step(x, y)``: the same
    step of a plain model beside, for the caller to compare."""
    store, made, alive = engine.grads.store, [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        x, y = x.to(engine.device), y.to(engine.device)
        engine.backward(((engine(x) - y) ** 2).mean())
        assert store._adopted == {u.name for u in engine.units}  # the short way: adopted
        made.append([weakref.ref(store.get(u.name).result().tensor) for u in engine.units])
        engine.step()
        if plain_step is not None:
            plain_step(x, y)
        alive.append([r() is not None for refs in made for r in refs])
    return alive


def bias_free_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64, bias=False), nn.Tanh(), nn.Linear(64, 4, bias=False))


def write_layer(module: nn.Module, name: str, how: str, new: dict, whole: dict | None = None) -> None:
    """Give ``module``'s submodule ``name`` (a Linear) the weights ``new`` ({"weight", "bias"})
    the way ``how`` says: "load" (the whole module's load_state_dict of ``whole``, its weights
    as they are, with the new ones in), "subload" (the submodule's own load_state_dict),
    "copy" (``p.copy_`` under no_grad), "data" (``p.data.copy_``), "assign" (``p.data = t``)."""
    layer = module.get_submodule(name)
    if how == "load":
        module.load_state_dict({**whole, **{f"{name}.{k}": v for k, v in new.items()}})
    elif how == "subload":
        layer.load_state_dict(new)
    elif how == "copy":
        with torch.no_grad():
            layer.weight.copy_(new["weight"])
            layer.bias.copy_(new["bias"])
    elif how == "data":
        layer.weight.data.copy_(new["weight"])
        layer.bias.data.copy_(new["bias"])
    elif how == "assign":
        layer.weight.data = new["weight"].to(layer.weight.dtype)
        layer.bias.data = new["bias"].to(layer.bias.dtype)
    else:
        raise ValueError(f"{how=}")
