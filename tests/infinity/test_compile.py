"""torch.compile over an engine's module: the hooks run eagerly, the module bodies compile
([Note: hooks under torch.compile] in infinity/_compile.py).

The backend is aot_eager: it runs dynamo and AOT autograd as inductor does (the graphs, the
graph breaks at the hooks, the one autograd Function per compiled region whose saved tensors
the engine packs) in a fraction of inductor's compile time on two cores. The losses are
compared with the same engine run eagerly within 1e-5 (fp32; aot_eager runs the same kernels,
so the differences are of float rounding at most).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity

from ._common import config

NVME = ("nvme", "nvme", "nvme")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing (dynamo's caches and recompile counts are global)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int = 32, blocks: int = 2):
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _losses(tmp_path, name: str, prepare, steps: int = 3, tiers=NVME, **sections) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    engine = infinity.initialize(Net(), config(tmp_path / name, tiers, **sections))
    try:
        call = prepare(engine.module)
        losses = []
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            loss = ((call(x) - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    finally:
        engine.close()
    return losses, weights


def _assert_same(eager, compiled):
    assert compiled[0] == pytest.approx(eager[0], abs=1e-5, rel=0), (compiled[0], eager[0])
    assert eager[1].keys() == compiled[1].keys()
    for key, value in eager[1].items():
        torch.testing.assert_close(compiled[1][key], value, atol=1e-5, rtol=0, msg=key)


def test_compiled_module_matches_eager(tmp_path):
    """torch.compile(engine.module), every tier on nvme: 3 steps' losses and the weights after."""
    eager = _losses(tmp_path, "eager", lambda m: m)
    compiled = _losses(tmp_path, "compiled", lambda m: torch.compile(m, backend="aot_eager"))
    _assert_same(eager, compiled)


class _Gated(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.a, self.b, self.act = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.act(self.a(x))
        return x + self.b(h * torch.sigmoid(h))


class _Rooted(nn.Module):
    """A weight the root uses itself, then a block whose ops save their own outputs (an audit
    helper's repro): dynamo breaks the graph around the engine's saved-tensor hooks."""

    def __init__(self, d: int = 48):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) * 0.2)
        self.blocks = nn.ModuleList([_Gated(d)])

    def forward(self, x):
        h = x @ self.w
        for block in self.blocks:
            h = block(h)
        return (h**2).mean()


def test_compiled_module_with_activations_on_nvme_matches_eager(tmp_path):
    """The saved-tensor hooks run eagerly, as the module hooks do: dynamo compiled them and the
    pool code the activation tier's pack calls, and failed on its own guard ("Guard failed on
    the same frame it was created") at the first forward."""

    def run(name, prepare):
        torch.manual_seed(0)
        cfg = config(tmp_path / name, NVME, activations={"tier": "nvme", "min_bytes": 0})
        with infinity.initialize(_Rooted(), cfg) as engine:
            call, losses = prepare(engine.module), []
            for step in range(3):
                loss = call(torch.randn(256, 48, generator=torch.Generator().manual_seed(step)))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            assert engine.stats()["step"]["activation_out_bytes"] > 0
        return losses

    eager = run("eager", lambda m: m)
    assert run("compiled", lambda m: torch.compile(m, backend="aot_eager")) == pytest.approx(eager, abs=1e-5, rel=0)


def test_compiled_blocks_match_eager_with_tiles(tmp_path):
    """Each block compiled in place (torchtitan's way), the 32 x 64 Linears in 4 KiB tiles."""

    def compile_blocks(module):
        for block in module.blocks:
            block.compile(backend="aot_eager")
        return module

    tiles = {"memory": {"tile_size": "4KiB"}}
    eager = _losses(tmp_path, "eager", lambda m: m, **tiles)
    compiled = _losses(tmp_path, "compiled", compile_blocks, **tiles)
    _assert_same(eager, compiled)


def test_fullgraph_names_what_to_compile(tmp_path):
    """One graph of the whole model cannot hold the hooks: the error says what to compile."""
    engine = infinity.initialize(Net(), config(tmp_path / "swap", NVME))
    try:
        compiled = torch.compile(engine.module, backend="aot_eager", fullgraph=True)
        with pytest.raises(Exception, match=r"compile without fullgraph=True.*block\.compile\(\)"):
            compiled(torch.randn(8, 16))
    finally:
        engine.close()


def test_always_ready_blocks_compile_whole_with_fullgraph(tmp_path):
    """Every tier on the compute device, one rank: no module carries a hook ([Note: always-ready
    units' uses] in infinity/_schedule.py), so each block compiles as one graph with
    ``fullgraph=True``, and the whole model without it, both as eager."""

    def compile_blocks(module):
        for block in module.blocks:
            block.compile(backend="aot_eager", fullgraph=True)
        return module

    device = ("device",) * 3
    eager = _losses(tmp_path, "eager", lambda m: m, tiers=device)
    _assert_same(eager, _losses(tmp_path, "blocks", compile_blocks, tiers=device))
    torch._dynamo.reset()
    _assert_same(eager, _losses(tmp_path, "whole", lambda m: torch.compile(m, backend="aot_eager"), tiers=device))
