"""Gradients held in the pool for the step instead of written and read back ([Note: gradients
held] in infinity/_grads.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import adopted_gradients, bias_free_mlp, config  # noqa: E402

NVME = ("nvme", "nvme", "nvme")
MICRO = 2  # micro-batches a step: the second adds into what the first left


def _layers(n: int = 8) -> nn.Module:
    torch.manual_seed(0)  # ``n`` 257KiB units (fp32) and two small ones
    return nn.Sequential(nn.Linear(16, 256), *[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(n)],
                         nn.Linear(256, 4))  # fmt: skip


def _run(path, budget: str, hold_limit: int | None = None, steps: int = 3, layers: int = 8, **optimizer):
    """Train ``steps`` steps of `MICRO` micro-batches; ``hold_limit`` replaces the engine's
    plan (0: every gradient written, as before gradients were held). Returns the losses, the
    weights, the grads' nvme traffic of the last step, the fp32 bytes of the gradients, and
    the most bytes held at a step's start."""
    cfg = config(path, NVME, memory={"host_budget": budget},
                 optimizer={"overlap": False, "sub_group_size": "256KiB", "gradient_accumulation_steps": MICRO,
                            **optimizer})  # fmt: skip
    engine = infinity.initialize(_layers(layers), cfg)
    try:
        if hold_limit is not None:
            engine.plan.held = hold_limit
        losses, held, committed = [], 0, []
        for step in range(steps):
            for micro in range(MICRO):
                g = torch.Generator().manual_seed(step * MICRO + micro)
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                loss = ((engine(x) - y) ** 2).mean()
                engine.backward(loss)
                losses.append(loss.item())
            held = max(held, engine.grads.held.bytes)
            engine.step()
            assert engine.grads.held.bytes == 0
            if engine.overlap is not None:
                committed.append(engine.overlap.committed)
        traffic = engine.stats()["step"]["nvme"]["by_kind"].get("grad", {"read_bytes": 0, "write_bytes": 0})
        fp32 = 4 * sum(u.shard_numel for u in engine.units)
        return losses, engine.gathered_weights(), traffic, fp32, held, committed
    finally:
        engine.close()


@pytest.mark.parametrize("budget", ["64MiB", "6MiB"], ids=["all-fit", "part"])
def test_held_gradients_are_neither_written_nor_read_and_change_nothing(tmp_path, budget):
    written = _run(tmp_path / "written", budget, hold_limit=0)
    held = _run(tmp_path / "held", budget)
    assert held[0] == written[0]
    for k in written[1]:
        assert torch.equal(held[1][k], written[1][k]), k
    fp32 = held[3]
    # Written: the first micro-batch writes, the second reads, adds and writes, the step reads.
    assert written[2] == {"read_bytes": 2 * fp32, "write_bytes": 2 * fp32}, (written[2], fp32)
    assert written[4] == 0
    if budget == "64MiB":  # every gradient fits beside what backward and the step need
        assert held[2] == {"read_bytes": 0, "write_bytes": 0}, held[2]
        assert held[4] == fp32
    else:  # the gradients backward makes last (the step's first) are held, the rest written
        assert 0 < held[2]["write_bytes"] < 2 * fp32 and 0 < held[2]["read_bytes"] < 2 * fp32, (held[2], fp32)
        assert 0 < held[4] < fp32


def test_backward_writes_held_gradients_when_the_pool_is_full(tmp_path):
    """A hold limit past what the pool has (16 layers: twice the budget in gradients):
    backward finds the pool full, writes every held gradient and goes on (no wait on the
    pool's timeout); the step writes what it has no room for; the numbers are the same."""
    written = _run(tmp_path / "written", "3584KiB", hold_limit=0, layers=16)
    spilled = _run(tmp_path / "spilled", "3584KiB", hold_limit=1 << 40, layers=16)
    assert spilled[0] == written[0]
    for k in written[1]:
        assert torch.equal(spilled[1][k], written[1][k]), k
    assert spilled[2]["write_bytes"] > 0 and spilled[4] > 0, (spilled[2], spilled[4])


def test_zero_grad_gives_held_gradients_back(tmp_path):
    cfg = config(tmp_path, NVME, optimizer={"overlap": False})
    engine = infinity.initialize(_layers(), cfg)
    try:
        engine.backward(engine(torch.randn(8, 16)).pow(2).mean())
        assert engine.grads.held.bytes == 4 * sum(u.shard_numel for u in engine.units)
        engine.zero_grad()
        assert engine.grads.held.bytes == 0
        assert engine.scheduler.runtime.pool.in_use_bytes == 0
        engine.backward(engine(torch.randn(8, 16)).pow(2).mean())  # a fresh gradient, not added to the dropped one
        engine.step()
        assert engine.scheduler.runtime.pool.in_use_bytes == 0
    finally:
        engine.close()


@pytest.mark.parametrize("clip", [None, 1e-3], ids=["committed", "redone"])
def test_held_gradients_under_the_overlap_change_nothing(tmp_path, clip):
    """The optimizer under backward borrows held gradients for its early updates; committed,
    they go back; discarded (a step that clips), the step redoes the update from them."""
    opt = {"overlap": True, "overlap_disk": 1.0, "max_grad_norm": clip}
    written = _run(tmp_path / "written", "64MiB", hold_limit=0, **opt)
    held = _run(tmp_path / "held", "64MiB", **opt)
    assert held[0] == written[0]
    for k in written[1]:
        assert torch.equal(held[1][k], written[1][k]), k
    assert held[5] == written[5]
    assert held[2] == {"read_bytes": 0, "write_bytes": 0} and held[4] == held[3], (held[2], held[4])
    if clip is None:
        assert all(n > 0 for n in held[5]), held[5]
    else:  # the first step clips (its early updates are discarded); after it none is tried
        assert held[5][0] == 0


def _hf_llama(path, dtype: str, hold: float | None):
    """A transformers Llama called as Trainer calls it (``model(input_ids, labels).loss``, a
    plain ``loss.backward()``), two micro-batches a step; ``hold``: the hold limit as a share of
    the gradients' bytes (None: the engine's plan)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    engine = infinity.initialize(model, config(path, NVME, precision={"param_dtype": dtype},
                                               optimizer={"overlap": False, "gradient_accumulation_steps": MICRO}))  # fmt: skip
    try:
        if hold is not None:
            engine.plan.held = int(hold * 4 * sum(u.shard_numel for u in engine.units))
        losses = []
        for step in range(3):
            for micro in range(MICRO):
                g = torch.Generator().manual_seed(step * MICRO + micro)
                ids = torch.randint(0, 512, (2, 16), generator=g)
                loss = engine.module(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(loss.item())
            engine.step()
        return losses, engine.gathered_weights(), engine.stats()["step"]["nvme"]["by_kind"].get("grad")
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_transformers_model_trains_the_same_with_gradients_held(tmp_path, dtype):
    written = _hf_llama(tmp_path / "written", dtype, hold=0)
    part = _hf_llama(tmp_path / "part", dtype, hold=0.5)
    planned = _hf_llama(tmp_path / "planned", dtype, hold=None)
    for run in (part, planned):
        assert run[0] == written[0]
        for k in written[1]:
            assert torch.equal(run[1][k], written[1][k]), k
    assert 0 < part[2]["write_bytes"] < written[2]["write_bytes"], (part[2], written[2])
    assert planned[2] is None  # the default budget holds every gradient of this model


@pytest.mark.parametrize("tiers", [("device", "device", "device"), ("device", "device", "cpu")], ids=["ddd", "ddc"])
def test_on_the_host_each_adopted_gradient_goes_when_the_next_one_comes(tmp_path, tiers):
    """On the host, the step keeps the gradients backward made (glibc then serves each new one
    from the block the old one frees, one by one, in the next backward): never more than one
    step's beside the next. Training stays bit-identical to plain PyTorch."""
    plain = bias_free_mlp()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01, fused=True)  # the engine's kernel

    def plain_step(x, y):
        ((plain(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()

    engine = infinity.initialize(bias_free_mlp(), config(tmp_path, tiers, optimizer={"overlap": False}))
    try:
        alive = adopted_gradients(engine, 3, plain_step)
        units = len(engine.units)
        assert alive == [[True] * units, [False] * units + [True] * units, [False] * 2 * units + [True] * units]
        for (name, p), q in zip(plain.named_parameters(), engine.gathered_weights().values()):
            assert torch.equal(p.detach(), q), name
    finally:
        engine.close()
