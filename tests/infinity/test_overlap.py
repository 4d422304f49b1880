"""The optimizer under backward (optimizer.overlap): the same numbers as the step after backward.

Every test trains twice on the same data, with overlap and without, and asserts bit-identical
losses and weights (torch.equal): an early update is committed only when it is the update the
step would run (see [Note: exact overlap] in infinity/_overlap.py), and the step without
overlap is itself checked against torch.optim in test_engine.py and test_optim.py. Each test
also asserts how many sub-groups were committed early, so that a test whose overlap silently
never ran (or always ran) fails.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
from torch import nn

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import config  # noqa: E402

NVME = ("nvme", "nvme", "nvme")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def _batch(step: int, micro: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)


def _cfg(path, overlap: bool, tiers=NVME, **sections):
    # overlap_disk 1.0: disk for every sub-group's staged copies (test_footprint tests the bound)
    opt = {"overlap": overlap, "sub_group_size": "1KiB", "overlap_disk": 1.0, **sections.pop("optimizer", {})}
    return config(path, tiers, optimizer=opt, **sections)


def _train(path, overlap, *, model=None, steps=4, micro=1, dtype=torch.float32, tiers=NVME, between=None,
           loss_fn=None, **sections):  # fmt: skip
    """Losses, final weights and sub-groups committed early per step."""
    os.makedirs(path, exist_ok=True)
    engine = infinity.initialize(model if model is not None else _mlp(), _cfg(path, overlap, tiers, **sections))
    losses, committed = [], []
    for step in range(steps):
        for m in range(micro):
            x, y = _batch(step, m, dtype)
            out = engine(x)
            loss = loss_fn(step, out, y) if loss_fn else ((out - y) ** 2).float().mean()
            engine.backward(loss)
            losses.append(loss.item())
        if between is not None:
            between(engine, step)
        engine.step()
        committed.append(engine.overlap.committed if engine.overlap else 0)
    weights = engine.gathered_weights()
    names = engine.space.names() if engine.space is not None else []  # None: every tier resident
    engine.close()
    assert not [n for n in names if "~next" in n], names  # nothing staged is left behind
    return losses, weights, committed


def _same(a, b) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


def test_overlap_is_bit_identical_and_commits_every_sub_group(tmp_path):
    off = _train(tmp_path / "off", False)
    on = _train(tmp_path / "on", True)
    _same(off, on)
    assert off[2] == [0] * 4
    assert on[2] == [4] * 4  # 4 units, one sub-group each (1KiB), all updated under backward


@pytest.mark.parametrize("tiers", [NVME, ("cpu", "cpu", "cpu")], ids=["nvme", "host"])  # host: _overlap_host
def test_overlap_matches_torch_adamw(tmp_path, tiers):
    on = _train(tmp_path / "on", True, tiers=tiers)
    assert on[2] == [4] * 4
    ref = _mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(4):
        x, y = _batch(step)
        loss = ((ref(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(loss.item() - on[0][step]) < 1e-5
    for name, p in ref.named_parameters():
        assert torch.allclose(on[1][name], p.detach(), atol=1e-5), name


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_overlap_in_low_precision(tmp_path, dtype):
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    off = _train(tmp_path / "off", False, dtype=torch_dtype, precision={"param_dtype": dtype})
    on = _train(tmp_path / "on", True, dtype=torch_dtype, precision={"param_dtype": dtype})
    _same(off, on)
    assert on[2] == [4] * 4


@pytest.mark.parametrize("clip, committed", [(1e-3, [0, 0, 0, 0]), (1e3, [4, 4, 4, 4])])
def test_overlap_with_clipping(tmp_path, clip, committed):
    """A step that clips discards its early updates (and the next step does not try); one under
    the limit commits them."""
    off = _train(tmp_path / "off", False, optimizer={"max_grad_norm": clip})
    on = _train(tmp_path / "on", True, optimizer={"max_grad_norm": clip})
    _same(off, on)
    assert on[2] == committed


def test_overlap_with_clip_grad_norm_called_between_backward_and_step(tmp_path):
    """What Trainer and accelerate loops do: the clip is known only after backward."""
    off = _train(tmp_path / "off", False, between=lambda e, s: e.clip_grad_norm_(1e-3 if s % 2 else 1e3))
    on = _train(tmp_path / "on", True, between=lambda e, s: e.clip_grad_norm_(1e-3 if s % 2 else 1e3))
    _same(off, on)
    assert on[2][0] == 4 and on[2][1] == 0  # step 0 under the limit; step 1 clipped


def test_overlap_with_fp16_overflow(tmp_path):
    """An overflow is known only at the step: the early updates are discarded, the step skipped."""

    def loss_fn(step, out, y):
        loss = ((out - y) ** 2).float().mean()
        return loss * 1e30 if step == 1 else loss  # scaled by the loss scale: inf in fp16

    kw = dict(dtype=torch.float16, precision={"param_dtype": "fp16", "initial_scale": 1024}, loss_fn=loss_fn)
    off = _train(tmp_path / "off", False, **kw)
    on = _train(tmp_path / "on", True, **kw)
    _same(off, on)
    assert on[2][1] == 0 and on[2][0] == 4 and on[2][2] == 4


@pytest.mark.parametrize("tiers", [NVME, ("nvme", "cpu", "nvme"), ("cpu", "cpu", "cpu")], ids=["held", "resident", "host"])
def test_overlap_with_fp16_and_clipping_leaves_the_gradients_as_the_step_reads_them(tmp_path, tiers):
    """The fused kernels unscale the gradients they are given in place. An early update under
    a loss scale that is then discarded (the step clips) must leave the gradient the step reads
    again (held in the pool, or the tier's own tensor) as it was: it updated 0.06 off."""
    kw = dict(dtype=torch.float16, tiers=tiers, precision={"param_dtype": "fp16", "initial_scale": 1024},
              optimizer={"max_grad_norm": 1e-3})  # fmt: skip
    off = _train(tmp_path / "off", False, **kw)
    on = _train(tmp_path / "on", True, **kw)
    _same(off, on)
    assert on[2] == [0] * 4  # every early update discarded: the step clips


def test_overlap_with_gradient_accumulation(tmp_path):
    off = _train(tmp_path / "off", False, micro=3, optimizer={"gradient_accumulation_steps": 3})
    on = _train(tmp_path / "on", True, micro=3, optimizer={"gradient_accumulation_steps": 3})
    _same(off, on)
    assert on[2] == [4] * 4  # only the third backward updated early, and all of it held


def test_more_micro_batches_than_configured_stays_exact_and_says_so(tmp_path, caplog):
    """gradient_accumulation_steps = 1 but two backward passes a step: the first one's early
    updates are stale by the second (its gradients changed) and are discarded."""
    off = _train(tmp_path / "off", False, micro=2)
    with caplog.at_level(logging.WARNING, logger="infinity"):
        on = _train(tmp_path / "on", True, micro=2)
    _same(off, on)
    assert on[2] == [0] * 4
    assert "gradient_accumulation_steps = 1, but this step follows 2 backward passes" in caplog.text


def test_a_hyperparameter_changed_between_backward_and_step(tmp_path):
    def change(engine, step):
        if step == 2:
            if engine.overlap is not None:
                engine.overlap.pump(block=True)  # every early update made with the old lr
            for group in engine.optimizer.param_groups:
                group["lr"] = 0.5

    off = _train(tmp_path / "off", False, between=change)
    on = _train(tmp_path / "on", True, between=change)
    _same(off, on)
    assert on[2] == [4, 4, 0, 4]


def test_overlap_with_an_lr_schedule(tmp_path):
    def run(path, overlap):
        os.makedirs(path)
        engine = infinity.initialize(_mlp(), _cfg(path, overlap),
                                     lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)))  # fmt: skip
        losses = []
        for step in range(4):
            x, y = _batch(step)
            loss = ((engine(x) - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out = losses, engine.gathered_weights(), [engine.overlap.committed if overlap else 0]
        engine.close()
        return out

    on = run(tmp_path / "on", True)
    _same(run(tmp_path / "off", False), on)
    assert on[2] == [4]


class _Twice(nn.Module):
    """One Linear used at both ends: its gradient comes in two parts, first and last in backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(16, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.shared(torch.tanh(self.mid(self.shared(x)))))


def test_overlap_with_a_module_used_twice(tmp_path):
    off = _train(tmp_path / "off", False, model=_Twice())
    on = _train(tmp_path / "on", True, model=_Twice())
    _same(off, on)
    assert on[2] == [3] * 4


def _gpt2(reentrant: bool | None):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    return model


@pytest.mark.parametrize("reentrant", [None, False, True])
def test_overlap_on_gpt2_with_activation_checkpointing(tmp_path, reentrant):
    """Tied embeddings (wte is also lm_head: its gradient is final only at the end), and
    forwards run again inside backward, reentrant or not."""

    def run(path, overlap):
        os.makedirs(path)
        engine = infinity.initialize(_gpt2(reentrant), _cfg(path, overlap, optimizer={"sub_group_size": "16KiB"}))
        g = torch.Generator().manual_seed(1)
        losses, committed = [], []
        for _ in range(3):
            ids = torch.randint(0, 64, (2, 17), generator=g)
            loss = engine(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            committed.append(engine.overlap.committed if overlap else 0)
        out = losses, engine.gathered_weights(), committed
        engine.close()
        return out

    off = run(tmp_path / "off", False)
    on = run(tmp_path / "on", True)
    _same(off, on)
    assert min(on[2]) > 0


def test_zero_grad_after_backward_discards_early_updates(tmp_path):
    os.makedirs(tmp_path / "a")
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a", True))
    before = engine.gathered_weights()
    x, y = _batch(0)
    engine.backward(((engine(x) - y) ** 2).mean())
    assert engine.overlap.pending > 0
    engine.zero_grad()
    assert engine.overlap.pending == 0
    assert not [n for n in engine.space.names() if "~next" in n]
    assert all(torch.equal(before[k], v) for k, v in engine.gathered_weights().items())
    assert all(float(s) == 0 for s in engine.optimizer.steps.values())
    engine.close()


@pytest.mark.parametrize("grads", ["cpu", "device"])
def test_overlap_with_resident_gradients(tmp_path, grads):
    """Gradients on a resident tier are lent in place (on the GPU for the device tier): the
    early update moves them to the host as the step does."""
    tiers = ("nvme", grads, "nvme")
    off = _train(tmp_path / "off", False, tiers=tiers)
    on = _train(tmp_path / "on", True, tiers=tiers)
    _same(off, on)
    assert on[2] == [4] * 4


@pytest.mark.parametrize("tiers, kind", [(("cpu", "nvme", "nvme"), None), (("nvme", "nvme", "cpu"), "InMemory"),
                                         (("device",) * 3, "InMemory")])  # fmt: skip
def test_overlap_on_nvme_does_not_apply_where_the_states_or_parameters_are_resident(tmp_path, tiers, kind):
    """Parameters resident beside states on nvme: none (a forward inside backward would see
    new parameters); states in host memory: the host overlap's (tests/infinity/test_overlap_host.py)."""
    os.makedirs(tmp_path / "a")
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a", True, tiers=tiers))
    overlap = engine.overlap
    assert (type(overlap.staging).__name__ if overlap is not None else None) == kind
    engine.close()


def test_config_keys(tmp_path):
    with pytest.raises(ValueError, match="optimizer.gradient_accumulation_steps: 0 must be at least 1"):
        infinity.TierConfig.from_dict({"optimizer": {"gradient_accumulation_steps": 0}})
    with pytest.raises(ValueError, match='optimizer.overlap: expected true, false or "auto"'):
        infinity.TierConfig.from_dict({"optimizer": {"overlap": "yes"}})
    assert infinity.TierConfig().optimizer.overlap == "auto"


@pytest.mark.parametrize("tiers, overlap, kind", [
    (("device", "device", "cpu"), "auto", None),  # the host computes: early updates take its cores
    (("device", "device", "cpu"), True, "InMemory"),
    (("nvme", "cpu", "cpu"), "auto", "InMemory"),  # backward waits for reads: room for them
    (NVME, "auto", "OnDisk"),
])  # fmt: skip
def test_auto_overlaps_where_it_can_gain(tmp_path, tiers, overlap, kind):
    """On the host (no GPU here): "auto" leaves out the host overlap where every parameter is in
    memory; true forces it; on nvme it applies."""
    engine = infinity.initialize(_mlp(), _cfg(tmp_path, overlap, tiers=tiers))
    got = engine.overlap
    assert (type(got.staging).__name__ if got is not None else None) == kind
    engine.close()



def test_an_early_update_that_fails_fails_the_backward_and_nothing_is_half_committed(tmp_path, monkeypatch):
    """An error in an early update (a drive error, say) is raised by the backward it ran in;
    the step is then refused until zero_grad, and redoing the step gives the same numbers."""
    ref = _train(tmp_path / "ref", True, steps=2)
    os.makedirs(tmp_path / "a")
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a", True))
    real = engine.optimizer.apply
    calls = []

    def failing(index, *args):
        calls.append(index)
        if len(calls) == 2:
            raise OSError(5, "injected I/O error")
        return real(index, *args)

    x, y = _batch(0)
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()
    monkeypatch.setattr(engine.optimizer, "apply", failing)
    overlap = engine.overlap
    # Every early update runs before backward returns, so the failure is the backward's.
    monkeypatch.setattr(overlap, "backward_ended", lambda: overlap.pump(block=True))
    x, y = _batch(1)
    with pytest.raises(OSError, match="injected"):
        engine.backward(((engine(x) - y) ** 2).mean())
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="last backward failed part-way"):
        engine.step()
    engine.zero_grad()
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()
    got = engine.gathered_weights()
    engine.close()
    assert all(torch.equal(ref[1][k], got[k]) for k in got)


@pytest.mark.parametrize("budget, applies", [("72MiB", False), ("512MiB", True)])
def test_overlap_applies_only_with_room_to_spare_in_the_host_budget(tmp_path, budget, applies):
    """Early updates and the backward share the pool: under a budget the step alone nearly
    fills, the optimizer runs after backward (no overlap), as the docs say."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    engine = infinity.initialize(model, _cfg(tmp_path, True, memory={"host_budget": budget},
                                             optimizer={"sub_group_size": "16MiB"}))  # fmt: skip
    assert (engine.overlap is not None) == applies
    engine.backward(engine(torch.randn(2, 1024)).sum())
    assert engine.step()
    engine.close()


@pytest.mark.parametrize("activations", [False, True], ids=["", "activations-on-nvme"])
def test_the_budget_overlap_applies_from_is_the_one_it_applies_from(tmp_path, caplog, activations):
    """``overlap_from`` is the smallest host budget with overlap: at it the optimizer runs under
    backward, a KiB less it does not and the log names the figure, and a budget too small for
    initialize carries it on the error (benchmarks/budget_floor.py reports it). With the
    activation tier in the pool, whose chunks grow with the budget, the figure was the one of
    the budget at hand: too low at the floor (a budget set to it left the overlap off) and far
    too high at 1 GiB (an audit helper's repro). The same figure at every budget now, within a
    few pages of the least (64 KiB less runs without)."""
    model = lambda: nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # noqa: E731
    extra = {"activations": {"tier": "nvme", "min_bytes": "4KiB"}} if activations else {}
    cfg = lambda budget: _cfg(tmp_path, True, memory={"host_budget": budget},  # noqa: E731
                              optimizer={"sub_group_size": "16MiB"}, **extra)  # fmt: skip
    engine = infinity.initialize(model(), cfg("1GiB"))
    start = engine.overlap_from
    engine.close()
    engine = infinity.initialize(model(), cfg(start))
    assert engine.overlap is not None and engine.overlap_from == start
    engine.close()
    with caplog.at_level(logging.INFO, logger="infinity"):
        engine = infinity.initialize(model(), cfg(start - (64 << 10 if activations else 1024)))
    assert engine.overlap is None
    engine.close()
    assert f"a host_budget of {infinity.swap.human_size(start)} or more would run it under backward" in caplog.text
    with pytest.raises(infinity.HostBudgetError) as e:
        infinity.initialize(model(), cfg(4096))
    assert e.value.overlap_from == start
    with pytest.raises(infinity.HostBudgetError) as e:
        infinity.initialize(model(), _cfg(tmp_path, False, memory={"host_budget": 4096}, **extra))
    assert e.value.overlap_from is None  # overlap off: no budget turns it on
