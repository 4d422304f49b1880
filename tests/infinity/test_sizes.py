"""What an engine's parameters say about their size, and torch.nn.utils' clipping over them.

Counts are compared with the same model's before initialize (exact). Clipping through
``torch.nn.utils.clip_grad_norm_(engine.module.parameters(), n)`` is compared with the same call
in plain PyTorch: SGD, so a clip that did not happen would move the weights by the unclipped
gradient; norms and weights within 1e-6 (the engine sums the squares in another order and
scales by the inverse of the coefficient: rounding).
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn

import infinity
from infinity import _sizes

sys.path.insert(0, os.path.dirname(__file__))
from _common import config as _config  # noqa: E402

NVME = ("nvme", "nvme", "nvme")
DEVICE = ("device", "device", "device")  # every parameter bound, a plain Parameter, at all times


class _Model(nn.Module):
    """An embedding, a body, and a head tied to the embedding, or untied and large enough to be
    cut into tiles at a 4 KiB tile size (200 x 16 fp32 is 12800 bytes)."""

    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(200, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 200, bias=not tied)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.embed(ids))))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 200, (4, 6), generator=g), torch.randint(0, 200, (4, 6), generator=g)


def _loss(model, step: int):
    ids, target = _batch(step)
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten())


def _engine(tmp_path, engines, model, tiers=NVME, **sections):
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    engine = infinity.initialize(model, _config(tmp_path, tiers, memory={"tile_size": 4096}, **sections), optimizer=sgd)
    engines.append(engine)
    return engine


# -- sizes ([Note: sizes of placeholders]) ---------------------------------------------------
@pytest.mark.parametrize("tiers", [NVME, DEVICE], ids=["nvme", "device"])
@pytest.mark.parametrize("tied", [False, True], ids=["tiled", "tied"])
def test_every_parameter_counts_the_elements_the_model_had(tmp_path, engines, tiers, tied):
    torch.manual_seed(0)
    model = _Model(tied)
    want = {name: (p.numel(), p.shape) for name, p in model.named_parameters()}
    total = sum(p.numel() for p in model.parameters())
    engine = _engine(tmp_path, engines, model, tiers)
    if tiers == NVME:
        assert tied or sum(u.path == "head" for u in engine.units) > 1  # the head is in tiles
    params = dict(engine.module.named_parameters())
    assert {name: (p.numel(), p.ds_shape) for name, p in params.items()} == want
    assert all(p.nelement() == torch.numel(p) == p.ds_numel == p.numel() for p in params.values())
    assert sum(p.numel() for p in engine.module.parameters()) == total


def test_a_placeholder_keeps_its_empty_shape_and_refuses_reads(tmp_path, engines):
    torch.manual_seed(0)
    engine = _engine(tmp_path, engines, _Model(tied=False))
    w = engine.module.body.weight
    assert w.shape == (0,) and w.numel() == 256  # the count is not the storage's
    out = torch.empty(w.numel())
    with pytest.raises(RuntimeError, match=r"'body\.weight'.*GatheredParameters"):
        out.copy_(w.view(-1))  # a size read from the count cannot read data that is not there


def test_sizes_survive_training_steps(tmp_path, engines):
    torch.manual_seed(0)
    model = _Model(tied=False)
    want = {name: p.numel() for name, p in model.named_parameters()}
    engine = _engine(tmp_path, engines, model)
    for step in range(2):
        engine.backward(_loss(engine, step))
        engine.step()
    assert {name: p.numel() for name, p in engine.module.named_parameters()} == want


# -- clipping ([Note: clipping managed parameters]) ------------------------------------------
def _clipped_pair(tmp_path, engines, tiers, frozen: bool):
    torch.manual_seed(0)
    model = _Model(tied=False)
    if frozen:
        model.body.requires_grad_(False)
    ref = copy.deepcopy(model)
    return _engine(tmp_path, engines, model, tiers), ref


@pytest.mark.parametrize("tiers", [NVME, DEVICE], ids=["nvme", "device"])
@pytest.mark.parametrize("which", ["all", "trained"])
def test_clip_grad_norm_over_the_engine_parameters_clips_as_plain_pytorch(tmp_path, engines, tiers, which):
    engine, ref = _clipped_pair(tmp_path, engines, tiers, frozen=which == "trained")
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)

    def params(model):  # a generator (as model.parameters()), or the trained ones in a list
        return model.parameters() if which == "all" else [p for p in model.parameters() if p.requires_grad]

    for step in range(3):
        engine.backward(_loss(engine, step))
        got = torch.nn.utils.clip_grad_norm_(params(engine.module), 0.1)
        engine.step()
        opt.zero_grad()
        _loss(ref, step).backward()
        want = torch.nn.utils.clip_grad_norm_(params(ref), 0.1)
        opt.step()
        assert want > 0.1  # every step clips
        assert got.item() == pytest.approx(want.item(), rel=1e-6), step
    weights = engine.gathered_weights()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), atol=1e-6, rtol=0)


def test_the_deprecated_clip_grad_norm_is_the_engine_norm_too(tmp_path, engines):
    torch.manual_seed(0)
    engine = _engine(tmp_path, engines, _Model(tied=False))
    engine.backward(_loss(engine, 0))
    with pytest.warns(FutureWarning):
        got = torch.nn.utils.clip_grad_norm(engine.module.parameters(), 0.1)
    assert got.item() == pytest.approx(engine.grad_norm(), rel=1e-6) and engine.optimizer.clip_next == 0.1


def test_clip_grad_norm_to_inf_reads_the_norm_and_leaves_the_configured_clipping(tmp_path, engines):
    torch.manual_seed(0)
    model = _Model(tied=False)
    ref = copy.deepcopy(model)
    engine = _engine(tmp_path, engines, model, optimizer={"max_grad_norm": 0.1})
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    engine.backward(_loss(engine, 0))
    got = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), float("inf"))  # Trainer's read of the norm
    engine.step()
    _loss(ref, 0).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    opt.step()
    assert want > 0.1 and got.item() == pytest.approx(want.item(), rel=1e-6)
    weights = engine.gathered_weights()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), atol=1e-6, rtol=0)


def test_clip_grad_norm_with_error_if_nonfinite_raises_on_an_infinite_norm(tmp_path, engines):
    torch.manual_seed(0)
    engine = _engine(tmp_path, engines, _Model(tied=False))
    engine.backward(_loss(engine, 0) * float("inf"))
    with pytest.raises(RuntimeError, match="error_if_nonfinite"):
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0, error_if_nonfinite=True)


def test_clip_grad_norm_over_part_of_the_trained_parameters_is_refused(tmp_path, engines):
    torch.manual_seed(0)
    engine = _engine(tmp_path, engines, _Model(tied=False))
    engine.backward(_loss(engine, 0))
    some = [engine.module.body.weight, engine.module.body.bias]
    with pytest.raises(ValueError, match=r"part of .*'embed\.weight'.*engine\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(some, 0.1)
    assert engine.optimizer.clip_next is None  # nothing asked of the next step


def test_clip_grad_norm_of_another_norm_type_is_refused(tmp_path, engines):
    torch.manual_seed(0)
    engine = _engine(tmp_path, engines, _Model(tied=False))
    engine.backward(_loss(engine, 0))
    with pytest.raises(ValueError, match=r"norm_type=inf.*L2"):
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.1, norm_type=float("inf"))


def test_clip_grad_value_over_the_engine_parameters_is_refused(tmp_path, engines):
    torch.manual_seed(0)
    engine = _engine(tmp_path, engines, _Model(tied=False))
    engine.backward(_loss(engine, 0))
    with pytest.raises(RuntimeError, match=r"clip_grad_value_.*engine\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_value_(engine.module.parameters(), 0.01)


def test_clip_grads_with_norm_over_the_engine_parameters_is_refused(tmp_path, engines):
    torch.manual_seed(0)
    engine = _engine(tmp_path, engines, _Model(tied=False))
    engine.backward(_loss(engine, 0))
    with pytest.raises(RuntimeError, match=r"engine\.clip_grad_norm_"):
        torch.nn.utils.clip_grads_with_norm_(engine.module.parameters(), 0.1, torch.tensor(1.0))


def test_a_clip_grad_norm_taken_before_import_infinity_raises_rather_than_return_zero(tmp_path, engines):
    torch.manual_seed(0)
    engine = _engine(tmp_path, engines, _Model(tied=False))
    engine.backward(_loss(engine, 0))
    torch_own = _sizes._torch_clip_grad_norm_  # what `from torch.nn.utils import clip_grad_norm_` had bound
    with pytest.raises(RuntimeError, match=r"imported before infinity.*engine\.clip_grad_norm_"):
        torch_own(engine.module.parameters(), 0.1)


def test_the_engine_parameters_beside_others_with_gradients_are_refused(tmp_path, engines):
    torch.manual_seed(0)
    engine = _engine(tmp_path, engines, _Model(tied=False))
    engine.backward(_loss(engine, 0))
    other = nn.Parameter(torch.ones(3))
    other.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"1 that it does not"):
        torch.nn.utils.clip_grad_norm_([*engine.module.parameters(), other], 0.1)


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_other_parameters_clip_as_torch_does(clip):
    torch.manual_seed(0)
    model = _Model(tied=False)
    _loss(model, 0).backward()
    ref = copy.deepcopy(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        q.grad = p.grad.clone()  # deepcopy leaves .grad behind
    if clip == "norm":
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        want = _sizes._torch_clip_grad_norm_(ref.parameters(), 0.1)
        assert torch.equal(got, want)
    else:
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        _sizes._torch_clip_grad_value_(ref.parameters(), 1e-3)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_an_empty_generator_still_warns_as_torch_does():
    with pytest.warns(UserWarning, match="empty generator"):
        torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)


# -- .grad by hand ([Note: .grad of a managed parameter]) --------------------------------------
@pytest.mark.parametrize("tiers", [NVME, ("cpu", "cpu", "cpu"), DEVICE], ids=["nvme", "cpu", "device"])
def test_setting_grad_is_refused_while_the_engine_holds_gradients(tmp_path, engines, tiers):
    """``p.grad = None`` over the parameters between backward and the step (to drop a
    micro-batch) did nothing, and the step trained on it, silently. With gradients waiting for
    the step it raises, naming the parameter and engine.zero_grad; without (before the first
    backward, after the step or zero_grad) it is torch's no-op. Reads find None (accelerate's
    and the Trainer's clipping read every ``.grad``)."""
    torch.manual_seed(0)
    engine = _engine(tmp_path, engines, _Model(tied=False), tiers)
    params = list(engine.module.parameters())
    for p in params:
        p.grad = None  # nothing to drop yet
    for step in range(2):
        engine.backward(_loss(engine, step))
        for p in params:
            assert p.grad is None
            with pytest.raises(RuntimeError, match=r"parameter '[\w.#]+': \.grad set.*engine\.zero_grad\(\)"):
                p.grad = None
        if step == 0:
            engine.step()
        else:
            engine.zero_grad()
        for p in params:
            p.grad = None
