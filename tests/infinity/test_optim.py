"""engine.optimizer is a torch.optim.Optimizer: parameter groups, four optimizers, LR schedulers.

Each runs against the matching torch.optim class on the same model, data and schedule, with
params, grads and optimizer state all on nvme. Tolerance 1e-5: the engine runs torch's fused
CPU kernels, torch.optim its default (foreach) ones; the same arithmetic up to float rounding.
"""

import copy
import functools
import logging
import math
import os
import sys

import pytest
import torch
from torch import nn

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import Plain, config, make_model, train  # noqa: E402

NVME = ("nvme", "nvme", "nvme")
STEPS = 10


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def _groups(model):
    """As transformers' Trainer makes them: no weight decay on biases and norm weights."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and not n.startswith("3.")]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and not n.startswith("3."))]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def _warmup_cosine(step, warmup=3, total=STEPS):
    # transformers' get_cosine_schedule_with_warmup, written out so it runs without transformers
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.99), "eps": 1e-7}),
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.01,
                                      "initial_accumulator_value": 0.1, "eps": 1e-10}),
}  # fmt: skip


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _loss(model, step):
    x, y = _batch(step)
    return ((model(x) - y) ** 2).mean()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_with_groups_and_a_schedule_matches_torch(tmp_path, name):
    cls, kwargs = OPTIMIZERS[name]
    model = _model()
    ref = copy.deepcopy(model)
    ref_opt = cls(_groups(ref), **kwargs)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _warmup_cosine)
    engine = infinity.initialize(model, config(tmp_path, NVME), optimizer=cls(_groups(model), **kwargs),
                                 lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine))  # fmt: skip
    assert isinstance(engine.optimizer, torch.optim.Optimizer)
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [kwargs["weight_decay"], 0.0]
    for step in range(STEPS):
        loss = _loss(engine, step)
        engine.backward(loss)
        engine.step()
        ref_loss = _loss(ref, step)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ref_sched.step()
        assert abs(loss.item() - ref_loss.item()) < 1e-5, (step, loss.item(), ref_loss.item())
        assert [g["lr"] for g in engine.optimizer.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    got = engine.gathered_weights()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), atol=1e-5, rtol=0)
    engine.close()


def test_adagrad_starts_every_sum_at_the_constructor_s_value_as_torch_does(tmp_path, caplog):
    """torch's Adagrad fills every parameter's sum from its constructor's
    initial_accumulator_value and never reads a group's: a group that sets its own trained
    0.22 off torch in 5 steps, the engine starting that group's sums at the group's value.
    It now starts them where torch does, and says that the group's value is not used."""
    model = _model()
    ref = copy.deepcopy(model)

    def make(m):
        groups = _groups(m)
        groups[1]["initial_accumulator_value"] = 0.3
        return torch.optim.Adagrad(groups, lr=0.05, initial_accumulator_value=0.1)

    ref_opt = make(ref)
    with caplog.at_level(logging.WARNING, logger="infinity"):
        engine = infinity.initialize(model, config(tmp_path, NVME), optimizer=make(model))
    assert "param_groups [1] set initial_accumulator_value 0.3, which torch's Adagrad does not use" in caplog.text
    with engine:
        train(engine, 5)  # (the batches `_loss` makes)
        got = engine.gathered_weights()
    train(Plain(ref, ref_opt), 5)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("form", ["groups", "class", "class-kwargs", "partial", "config-type"])
def test_the_shapes_users_pass_an_optimizer_in(tmp_path, form):
    model = _model()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    cfg = config(tmp_path, NVME, optimizer={"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0})
    spec = {
        "groups": [{"params": list(model.parameters())}],
        "class": None,
        "class-kwargs": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        "partial": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
        "config-type": None,
    }[form]
    if form == "class":
        spec = torch.optim.SGD
        ref_opt = torch.optim.SGD(ref.parameters())  # torch's own defaults, as the engine takes them
    with infinity.initialize(model, cfg, optimizer=spec) as engine:
        assert engine.optimizer.kind == "sgd"
        for step in range(3):
            engine.backward(_loss(engine, step))
            engine.step()
            ref_opt.zero_grad()
            _loss(ref, step).backward()
            ref_opt.step()
        got = engine.gathered_weights()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("make", [
    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS),
    lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
    lambda opt: pytest.importorskip("transformers").get_cosine_schedule_with_warmup(opt, 3, STEPS),
], ids=["OneCycleLR", "CosineAnnealingLR", "transformers-cosine"])  # fmt: skip
def test_torch_and_transformers_schedulers_work_on_engine_optimizer_unmodified(tmp_path, make):
    model = _model()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_sched = make(ref_opt)
    engine = infinity.initialize(model, config(tmp_path, NVME, optimizer={"lr": 1e-2}))
    sched = make(engine.optimizer)  # built by the user on engine.optimizer, stepped by the user
    for step in range(STEPS):
        engine.backward(_loss(engine, step))
        engine.optimizer.step()
        sched.step()
        ref_opt.zero_grad()
        _loss(ref, step).backward()
        ref_opt.step()
        ref_sched.step()
        assert engine.optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    got = engine.gathered_weights()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), atol=1e-5, rtol=0)
    engine.close()


def test_a_resumed_run_continues_the_schedule_bit_exactly(tmp_path):
    def run(engine, start, stop):
        for step in range(start, stop):
            engine.backward(_loss(engine, step))
            engine.step()

    def make(swap):
        (tmp_path / swap).mkdir()
        model = _model()
        return infinity.initialize(model, config(tmp_path / swap, NVME), optimizer=_groups(model),
                                   lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup_cosine))  # fmt: skip

    straight = make("a")
    run(straight, 0, STEPS)
    first = make("b")
    run(first, 0, 5)
    first.save_checkpoint(tmp_path / "ck")
    first.close()
    resumed = make("c")
    resumed.load_checkpoint(tmp_path / "ck")
    assert resumed.lr_scheduler.last_epoch == 5
    run(resumed, 5, STEPS)
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [g["lr"] for g in straight.optimizer.param_groups]
    a, b = straight.gathered_weights(), resumed.gathered_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    straight.close()
    resumed.close()


def test_a_changed_hyperparameter_takes_effect_at_the_next_step(tmp_path):
    model = _model()
    with infinity.initialize(model, config(tmp_path, NVME, optimizer={"weight_decay": 0.0})) as engine:
        engine.backward(_loss(engine, 0))
        engine.step()
        before = engine.gathered_weights()
        engine.optimizer.param_groups[0]["lr"] = 0.0
        engine.backward(_loss(engine, 1))
        engine.step()
        after = engine.gathered_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_frozen_parameters_are_left_alone_even_beside_trained_ones(tmp_path):
    model = _model()
    model[0].bias.requires_grad_(False)  # in the same unit as the trained model[0].weight
    frozen = model[0].bias.detach().clone()
    with infinity.initialize(model, config(tmp_path, NVME, optimizer={"weight_decay": 0.5})) as engine:
        for step in range(3):
            engine.backward(_loss(engine, step))
            engine.step()
        got = engine.gathered_weights()
    assert torch.equal(got["0.bias"], frozen)
    assert not torch.equal(got["0.weight"], _model()[0].weight.detach())


@pytest.mark.parametrize("tiers", [NVME, ("device",) * 3], ids=["nvme", "device"])
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.5),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.5),
], ids=["adamw", "sgd"])  # fmt: skip
def test_a_frozen_parameter_in_a_torch_optimizers_group_is_left_alone(tmp_path, tiers, make):
    """``AdamW(model.parameters())`` holds a frozen weight beside its trained bias: torch skips
    it (no .grad); the engine stepped it on a zero gradient, and weight decay and momentum moved
    it (an audit helper: 1.75e-3 in 5 AdamW steps, 6.1e-2 SGD), silently."""
    model, ref = _model(), _model()
    for m in (model, ref):
        m[0].weight.requires_grad_(False)  # in the same unit as the trained model[0].bias
    opt = make(ref.parameters())
    with infinity.initialize(model, config(tmp_path, tiers), optimizer=make(model.parameters())) as engine:
        for step in range(3):
            engine.backward(_loss(engine, step))
            engine.step()
            _loss(ref, step).backward()
            opt.step()
            opt.zero_grad()
        got = engine.gathered_weights()
    assert torch.equal(got["0.weight"], _model()[0].weight.detach())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("spec, message", [
    (lambda m: torch.optim.RMSprop(m.parameters()), "RMSprop cannot run on offloaded state.*AdamW, Adam, SGD, Adagrad"),
    (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), r"AdamW\(amsgrad=True\) is not supported"),
    (lambda m: [{"params": list(m.parameters()), "momentum": 0.9}], "'momentum'.* not hyperparameters of 'adamw'"),
    (lambda m: [nn.Parameter(torch.zeros(3))], "not a parameter of the model"),
])  # fmt: skip
def test_an_optimizer_the_engine_cannot_run_is_a_clear_error(tmp_path, spec, message):
    model = _model()
    with pytest.raises(ValueError, match=message):
        infinity.initialize(model, config(tmp_path, NVME), optimizer=spec(model))
    with infinity.initialize(_model(), config(tmp_path, NVME)):  # the directory was let go of
        pass


def test_a_torch_optimizer_run_as_it_is_is_refused_with_several_ranks():
    """The engine steps a torch optimizer it does not implement on whole parameters, so only
    with one rank: several are refused before any state is laid out, naming the optimizer."""
    from types import SimpleNamespace

    from infinity._algorithms import ALGORITHMS
    from infinity._substates import SubGroupStates

    foreign = torch.optim.RMSprop([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="optimizer RMSprop: the engine runs a torch optimizer it does not "
                                         "implement itself only with one rank"):  # fmt: skip
        SubGroupStates(ALGORITHMS["torch"], [], units=[], groups=[], stores={}, param_store=None,
                       param_dtype=torch.float32, dist=SimpleNamespace(active=True), foreign=foreign)  # fmt: skip


def test_add_param_group_after_initialize_is_refused(tmp_path):
    with infinity.initialize(_model(), config(tmp_path, NVME)) as engine:
        with pytest.raises(ValueError, match="fixed at initialize"):
            engine.optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_a_frozen_unit_has_no_optimizer_state_and_survives_checkpoint_and_export(tmp_path):
    def make(swap):
        (tmp_path / swap).mkdir()
        model = _model()
        model[2].requires_grad_(False)  # a whole frozen module: a unit without optimizer state
        return infinity.initialize(model, config(tmp_path / swap, NVME))

    def run(engine, start, stop):
        for step in range(start, stop):
            engine.backward(_loss(engine, step))
            engine.step()

    straight = make("a")
    assert [u.name for u in straight.optimizer.frozen] == ["2"]
    assert "2/master" not in straight.space.names() and "0/param" in straight.space.names()
    run(straight, 0, 6)
    first = make("b")
    run(first, 0, 3)
    first.save_checkpoint(tmp_path / "ck")
    first.close()
    resumed = make("c")
    resumed.load_checkpoint(tmp_path / "ck")
    run(resumed, 3, 6)
    a, b = straight.gathered_weights(), resumed.gathered_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["2.weight"], _model()[2].weight.detach())  # frozen: as made
    fresh = _model()
    fresh.load_state_dict(resumed.state_dict())
    assert all(torch.equal(fresh.state_dict()[k], a[k]) for k in a)
    straight.close()
    resumed.close()


DEVICE = ("device", "device", "device")


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
], ids=["RMSprop", "NAdam", "AdamW-amsgrad"])  # fmt: skip
def test_with_every_tier_on_the_device_any_torch_optimizer_runs_and_resumes(tmp_path, make):
    model = _model()
    ref = copy.deepcopy(model)
    ref_opt = make(_groups(ref))
    engine = infinity.initialize(model, config(tmp_path, DEVICE), optimizer=make(_groups(model)),
                                 lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup_cosine))  # fmt: skip
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _warmup_cosine)
    assert engine.optimizer.kind == "torch"
    for step in range(4):
        engine.backward(_loss(engine, step))
        engine.step()
        ref_opt.zero_grad()
        _loss(ref, step).backward()
        ref_opt.step()
        ref_sched.step()
    got = engine.gathered_weights()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), atol=1e-6, rtol=0)  # the same optimizer: rounding only
    engine.save_checkpoint(tmp_path / "ck")
    other = _model()
    again = infinity.initialize(other, config(tmp_path, DEVICE), optimizer=make(_groups(other)),
                                lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup_cosine))  # fmt: skip
    again.load_checkpoint(tmp_path / "ck")
    for e in (engine, again):
        for step in range(4, 7):
            e.backward(_loss(e, step))
            e.step()
    a, b = engine.gathered_weights(), again.gathered_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    engine.close()
    again.close()


def test_a_refused_lr_scheduler_leaves_the_model_as_it_was(tmp_path):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match="lr_scheduler"):
        infinity.initialize(model, config(tmp_path, NVME), lr_scheduler="cosine")
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)  # nothing moved to the tiers


def test_reduce_lr_on_plateau_is_refused_at_initialize_and_works_stepped_by_hand(tmp_path):
    """engine.step() has no metric to give ReduceLROnPlateau.step(metrics): passed as
    lr_scheduler= it was accepted and every step then raised. It is refused at initialize,
    saying how to use it; built on engine.optimizer and stepped with the metric by hand, it
    lowers the lr the next step uses (against torch.optim.AdamW with the same schedule, 1e-5)."""
    plateau = functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, factor=0.5, patience=0)
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau.*engine\.optimizer.*\.step\(metric\)"):
        infinity.initialize(_model(), config(tmp_path, NVME), lr_scheduler=plateau)
    engine = infinity.initialize(_model(), config(tmp_path, NVME))
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    scheds = plateau(engine.optimizer), plateau(ref_opt)
    for step in range(4):
        engine.backward(_loss(engine, step))
        engine.step()
        _loss(ref, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for s in scheds:
            s.step(1.0)  # a flat metric: the lr halves after every step but the first
    assert engine.optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 1e-2 / 8
    got, want = engine.gathered_weights(), dict(ref.named_parameters())
    assert all(torch.allclose(got[k], want[k], atol=1e-5) for k in want)
    engine.close()


def test_zero_grad_keeping_zeros_says_the_engine_sets_them_to_none(tmp_path, caplog):
    """torch's zero_grad(set_to_none=False) keeps zero gradients, so its next step moves a
    parameter no gradient reached (moments, weight decay); the engine's gradients are always
    none, and it says so once rather than differ silently."""
    engine = infinity.initialize(make_model(), config(tmp_path, ("device",) * 3))
    try:
        engine.optimizer.zero_grad()
        engine.optimizer.zero_grad(set_to_none=True)
        assert "set_to_none=False" not in caplog.text
        engine.optimizer.zero_grad(set_to_none=False)
        engine.optimizer.zero_grad(set_to_none=False)
        assert caplog.text.count("set_to_none=False") == 1
    finally:
        engine.close()


# -- torch optimizers' semantics kept (found by an audit: each was a silent difference) ------
_TIERS = [("nvme", "nvme", "nvme"), ("device", "device", "cpu")]


def _against_torch(tmp_path, tiers, make_opt, steps=4, between=None, engine_kwargs=None):
    """The engine given ``make_opt(model)``'s optimizer, against that optimizer on a copy;
    ``between(opt, step)`` runs after each step on both sides' optimizers (the engine's side: the
    optimizer given to initialize). Returns the largest weight difference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    plain = copy.deepcopy(model)
    theirs, ours = make_opt(plain), make_opt(model)
    with infinity.initialize(model, config(tmp_path, tiers), optimizer=ours, **(engine_kwargs or {})) as engine:
        for step in range(steps):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(x).pow(2).mean())
            engine.step()
            plain(x).pow(2).mean().backward()
            theirs.step()
            theirs.zero_grad()
            if between is not None:
                between(ours, step)
                between(theirs, step)
        weights = engine.gathered_weights()
    return max((weights[n] - p.detach()).abs().max().item() for n, p in plain.named_parameters())


@pytest.mark.parametrize("tiers", _TIERS)
def test_adam_with_decoupled_weight_decay_runs_as_adamw(tmp_path, tiers):
    """torch's Adam(decoupled_weight_decay=True) is AdamW; it ran as Adam's L2 decay (0.09 off)."""
    make = functools.partial(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.1,
                                                        decoupled_weight_decay=True))  # fmt: skip
    assert _against_torch(tmp_path, tiers, make) < 1e-6


@pytest.mark.parametrize("tiers", _TIERS)
def test_a_schedule_made_on_the_optimizer_given_to_initialize_reaches_the_steps(tmp_path, tiers):
    """``sched = LambdaLR(opt)`` then ``initialize(..., optimizer=opt)`` and ``sched.step()``:
    the engine copied the groups, kept lr 0.01, and the weights went 13% apart."""
    scheds = {}

    def make(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        scheds[id(opt)] = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        return opt

    assert _against_torch(tmp_path, tiers, make, between=lambda opt, step: scheds[id(opt)].step()) < 1e-6


def test_a_torch_option_set_by_hand_between_steps_is_refused(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    with infinity.initialize(model, config(tmp_path, _TIERS[0])) as engine:
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
        engine.optimizer.param_groups[0]["maximize"] = True
        engine.backward(engine(torch.randn(2, 8)).sum())
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['maximize'\] = True"):
            engine.step()


def test_optimizer_state_dicts_that_would_lose_the_moments_are_refused(tmp_path):
    """A state_dict carries the step counts but not the moments (they live in the tiers): an
    engine's own from an earlier step, or a torch AdamW's, loaded silently on zero moments.
    The engine's own, as it is now (accelerate's AcceleratedOptimizer round trip), loads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    plain = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(plain.parameters())
    plain(torch.randn(2, 8)).sum().backward()
    torch_opt.step()
    with infinity.initialize(model, config(tmp_path, _TIERS[0])) as engine:
        engine.optimizer.load_state_dict(engine.optimizer.state_dict())
        earlier = engine.optimizer.state_dict()
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
        with pytest.raises(ValueError, match="holds step counts .* engine.load_checkpoint"):
            engine.optimizer.load_state_dict(earlier)
        with pytest.raises(ValueError, match=r"holds per-parameter state \(moments, steps\)"):
            engine.optimizer.load_state_dict(torch_opt.state_dict())


@pytest.mark.parametrize("make_opt", [functools.partial(torch.optim.NAdam, lr=1e-2),
                                      functools.partial(torch.optim.Adam, lr=1e-2, amsgrad=True)],
                         ids=["NAdam", "Adam-amsgrad"])  # fmt: skip
def test_a_torch_optimizer_run_as_it_is_resumes_through_its_state_dict(tmp_path, make_opt):
    """A torch optimizer the engine runs as it is (every tier on the device) keeps its moments
    itself: engine.optimizer.state_dict() through torch.save into a fresh engine's
    load_state_dict (accelerate's save_state / load_state) resumes it, as torch's own round trip
    does. The moments were dropped silently: 3.0e-2 off torch after 3 more steps (NAdam), 4.4e-2
    (Adam with amsgrad); a torch optimizer's own state_dict loads the same way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    plain = copy.deepcopy(model)
    train(Plain(plain, make_opt(plain.parameters())), 6)
    tiers = ("device", "device", "device")
    first = copy.deepcopy(model)
    with infinity.initialize(first, config(tmp_path, tiers), optimizer=make_opt(first.parameters())) as engine:
        train(engine, 3)
        torch.save({"opt": engine.optimizer.state_dict(), "model": engine.module.state_dict()}, tmp_path / "saved.pt")
    for source in ("engine", "torch"):
        saved = torch.load(tmp_path / "saved.pt", weights_only=False)  # (a load shares its tensors, as torch's does)
        torch.manual_seed(1)  # other initial weights: the load must replace them
        fresh = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        opt = make_opt(fresh.parameters())
        with infinity.initialize(fresh, config(tmp_path, tiers), optimizer=opt) as engine:
            engine.module.load_state_dict(saved["model"])
            if source == "engine":
                engine.optimizer.load_state_dict(saved["opt"])
            else:  # torch's own format: what the saving engine's torch optimizer holds
                engine.optimizer.load_state_dict({"state": saved["opt"]["state"],
                                                  "param_groups": saved["opt"]["param_groups"]})  # fmt: skip
            train(engine, 3, start=3)
            for (name, mine), theirs in zip(engine.gathered_weights().items(), plain.parameters()):
                assert torch.equal(mine, theirs.detach()), (source, name, (mine - theirs).abs().max().item())


@pytest.mark.parametrize("tiers", _TIERS)
def test_clips_combine_as_torch_s_sequential_clips(tmp_path, tiers):
    """[optimizer] max_grad_norm with a larger clip of the user's: the config's still clips
    (the user's replaced it); two clips in a row: the smaller holds, and the second returns the
    norm the first left (it returned the unclipped one)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    cfg = config(tmp_path, tiers, optimizer={"max_grad_norm": 0.05})
    with infinity.initialize(model, cfg) as engine:
        for step in range(3):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(x).pow(2).mean())
            torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 10.0)
            engine.step()
            plain(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)  # what the config asks, then 10: no-op
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 10.0)
            opt.step()
            opt.zero_grad()
        x = torch.randn(6, 8)
        engine.backward(engine(x).pow(2).mean())
        plain(x).pow(2).mean().backward()
        first = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.01)
        second = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 10.0)
        assert float(first) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01)), rel=1e-5)
        assert float(second) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 10.0)), rel=1e-4)
        weights = engine.gathered_weights()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_sgd_momentum_turned_on_with_dampening_after_steps_without_is_refused(tmp_path):
    """torch starts a momentum buffer at the gradient when momentum is turned on; the engine's
    buffer held zeros from the steps without it, so with dampening its first was (1 -
    dampening) of the gradient (0.006 off). Refused; with dampening 0 both agree."""
    def make(m):
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.0, dampening=0.0)

    def turn_on(opt, step):
        if step == 0:
            opt.param_groups[0]["momentum"] = 0.9

    assert _against_torch(tmp_path, _TIERS[0], make, between=turn_on) < 1e-6
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0, dampening=0.5)
    with infinity.initialize(model, config(tmp_path, _TIERS[1]), optimizer=opt) as engine:
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
        engine.optimizer.param_groups[0]["momentum"] = 0.9
        engine.backward(engine(torch.randn(2, 8)).sum())
        with pytest.raises(ValueError, match=r"momentum turned on \(0.9\) with dampening 0.5"):
            engine.step()


def _plain_sgd_and_engine(tmp_path, tiers):
    """The same model twice: plain with torch's SGD, and in an engine with the same SGD."""
    model = _model()
    plain = copy.deepcopy(model)
    engine = infinity.initialize(model, config(tmp_path, tiers), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return plain, torch.optim.SGD(plain.parameters(), lr=0.1), engine


def _same_weights(engine, plain) -> None:
    got = engine.gathered_weights()
    for n, p in plain.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("tiers", _TIERS)
def test_a_clip_asked_goes_with_the_gradients_dropped_or_skipped(tmp_path, tiers):
    """A clip asked of gradients that zero_grad() then dropped, or of a step skipped for a
    non-finite gradient, clips nothing after: torch's clip scaled those gradients and went with
    them. The engine kept it for the next step (1.5e-2 off plain SGD's update of the same
    size; an audit helper's repros)."""
    plain, opt, engine = _plain_sgd_and_engine(tmp_path, tiers)
    with engine:
        _loss(engine.module, 0).backward()
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.01)
        engine.optimizer.zero_grad()  # the micro-batch dropped, its clip with it
        _loss(engine.module, 1).backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        engine.module(torch.full((8, 16), float("inf"))).sum().backward()
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.01)
        assert engine.step() is False  # skipped, its clip with it
        _loss(engine.module, 2).backward()
        engine.step()
        for step in (1, 2):  # plain: the two steps, unclipped
            _loss(plain, step).backward()
            opt.step()
            opt.zero_grad()
        _same_weights(engine, plain)


@pytest.mark.parametrize("tiers", _TIERS)
def test_the_modules_zero_grad_drops_the_engines_gradients(tmp_path, tiers):
    """``model.zero_grad()`` (nn.Module's) between a backward and the step drops that
    micro-batch, as in plain PyTorch: the parameters have no .grad (the gradients are in the
    tiers), so torch's dropped nothing and the step trained on both (an audit helper's repro).
    A submodule's zero_grad cannot drop part of them: refused while there are gradients,
    nothing to do while there are none."""
    plain, opt, engine = _plain_sgd_and_engine(tmp_path, tiers)
    with engine:
        engine.module[0].zero_grad()  # no gradients yet: nothing to drop
        _loss(engine.module, 0).backward()
        with pytest.raises(RuntimeError, match=r"Linear.zero_grad\(\) over part .* engine.zero_grad\(\)"):
            engine.module[4].zero_grad()
        engine.module.zero_grad()
        _loss(engine.module, 1).backward()
        engine.optimizer.step()
        _loss(plain, 0).backward()
        plain.zero_grad()
        _loss(plain, 1).backward()
        opt.step()
        _same_weights(engine, plain)


def test_a_forward_for_backward_after_a_clip_is_refused_until_the_step(tmp_path):
    """A clip between micro-batches: plain PyTorch clips the sum so far and adds the next
    micro-batch's unclipped; the engine would clip the whole at the step (2e-3 off plain AdamW
    in 4 micro-batches; an audit helper's repro). Refused before anything changes; a no-grad
    forward (an evaluation) passes; after the step, training goes on as plain PyTorch's."""
    plain, opt, engine = _plain_sgd_and_engine(tmp_path, ("device", "device", "cpu"))
    with engine:
        _loss(engine.module, 0).backward()
        norm = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.01)
        with torch.no_grad():
            engine.module(torch.randn(2, 16))
        with pytest.raises(RuntimeError, match="after clip_grad_norm_ .*sync_gradients"):
            engine.module(torch.randn(2, 16))
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        _loss(engine.module, 1).backward()
        engine.optimizer.step()
        _loss(plain, 0).backward()
        assert float(norm) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01)), rel=1e-5)
        opt.step()
        opt.zero_grad()
        _loss(plain, 1).backward()
        opt.step()
        _same_weights(engine, plain)


@pytest.mark.parametrize("overlap", [True, False])
def test_tensor_betas_filled_in_place_before_the_step_take_effect(tmp_path, overlap):
    """Betas given as tensors (torch allows it) and filled in place between backward and the
    step: the update made early under backward with the old beta1 was committed, since its
    snapshot of the hyperparameters held the live tensors (an audit helper: 1.02e-2 off torch
    with the overlap on); it is taken again, as a changed lr's is."""
    def make(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.999)))

    model, ref = _model(), _model()
    opt = make(ref)
    cfg = config(tmp_path, ("cpu",) * 3, optimizer={"overlap": overlap})
    with infinity.initialize(model, cfg, optimizer=make(model)) as engine:
        for step in range(4):
            engine.backward(_loss(engine, step))
            _loss(ref, step).backward()
            if step == 2:
                engine.optimizer.param_groups[0]["betas"][0].fill_(0.5)
                opt.param_groups[0]["betas"][0].fill_(0.5)
            engine.step()
            opt.step()
            opt.zero_grad()
        got = engine.gathered_weights()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
