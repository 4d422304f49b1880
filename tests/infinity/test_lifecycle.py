"""An engine's life around the user's model: initialize twice, drop without close."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
from torch import nn

import infinity

sys.path.insert(0, os.path.dirname(__file__))
from _common import config, make_model, train  # noqa: E402

NVME = ("nvme", "nvme", "nvme")


@pytest.mark.parametrize("closed", [True, False])
def test_a_module_given_to_an_engine_is_refused_by_a_second_initialize(tmp_path, closed):
    """Its parameters are the engine's placeholders (empty): a second engine would train them."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model = make_model()
    engine = infinity.initialize(model, config(tmp_path / "a", NVME))
    train(engine, 1)
    if closed:
        engine.close()
    with pytest.raises(ValueError, match="already given to infinity.initialize .*'0.weight'.*build the model again"):
        infinity.initialize(model, config(tmp_path / "b", NVME))
    engine.close()


def test_an_engine_dropped_with_its_model_unlocks_its_swap_directory(tmp_path, caplog):
    """Without close(), once nothing refers to the engine or its model, the garbage collector
    closes its swap space: a new engine opens the same directory in the same process."""
    import gc

    (tmp_path / "a").mkdir()
    model = make_model()
    engine = infinity.initialize(model, config(tmp_path / "a", NVME))
    train(engine, 1)
    del engine, model
    gc.collect()
    assert "garbage-collected without engine.close()" in caplog.text
    again = infinity.initialize(make_model(), config(tmp_path / "a", NVME))
    train(again, 1)
    again.close()


def test_a_second_engine_on_the_directory_of_a_live_one_names_the_cause(tmp_path):
    """The first engine was dropped, but its model (whose hooks hold it) is alive: its swap
    directory is still in use, and the message says so and what to do."""
    (tmp_path / "a").mkdir()
    model = make_model()
    infinity.initialize(model, config(tmp_path / "a", NVME))  # dropped at once, model kept
    with pytest.raises(RuntimeError, match="another swap space of this process .*engine.close\\(\\).*while its model is alive"):
        infinity.initialize(make_model(), config(tmp_path / "a", NVME))
    del model


@pytest.mark.parametrize("keep", [True, False])
def test_what_close_leaves_on_disk(tmp_path, keep):
    """keep = true: the swap files, no larger than the state they hold; false: nothing the
    space made (the directory the user named stays)."""
    model = make_model()
    (tmp_path / "swap").mkdir()
    cfg = config(tmp_path / "swap", NVME)
    cfg["nvme"]["keep"] = keep
    engine = infinity.initialize(model, cfg)
    train(engine, 2)
    state = sum(u.numel for u in engine.units) * (4 + 4 + 12)  # params, grads, master and two moments (fp32)
    engine.close()
    files = [p for p in (tmp_path / "swap").rglob("*") if p.is_file()]
    if keep:
        used = sum(p.stat().st_blocks * 512 for p in files)
        assert 0 < used <= state + 64 * 4096 * len(files)  # alignment of each tensor to 4 KiB
    else:
        assert files == [] and (tmp_path / "swap").is_dir()


# -- threads: one inside an engine at a time (see infinity/_owner.py) --------------------------


class _Gate(nn.Module):
    """The model of `make_model`; while ``engine_inside`` is set, its forward says it is
    running and waits to be let through, so that another thread calls in meanwhile."""

    def __init__(self):
        super().__init__()
        self.inner = make_model()
        self.inside, self.go = threading.Event(), threading.Event()
        self.hold = False

    def forward(self, x):
        if self.hold:
            self.hold = False
            self.inside.set()
            assert self.go.wait(30)
        return self.inner(x)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _train_step(engine, step: int) -> None:
    x, y = _batch(step)
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()


def test_a_second_thread_is_refused_while_one_is_inside_and_the_engine_stays_exact(tmp_path):
    """Thread A is inside a forward; every entry point called from thread B meanwhile raises a
    RuntimeError naming both threads and changes nothing: A's step and the next ones are
    bit-exact to a run without B, and close() frees the swap directory."""
    (tmp_path / "a").mkdir()
    (tmp_path / "ref").mkdir()
    ref = infinity.initialize(_Gate(), config(tmp_path / "ref", NVME))
    for step in range(3):
        _train_step(ref, step)
    expected = ref.gathered_weights()
    ref.close()

    model = _Gate()
    engine = infinity.initialize(model, config(tmp_path / "a", NVME))
    _train_step(engine, 0)
    errors = []
    model.hold = True
    a = threading.Thread(target=lambda: _train_step(engine, 1), name="trainer-A")
    a.start()
    assert model.inside.wait(30)
    x, y = _batch(5)
    calls = {
        "forward": lambda: engine(x),
        "module": lambda: engine.module(x),
        "backward": lambda: engine.backward(torch.ones((), requires_grad=True)),
        "step": engine.step,
        "optimizer.step": engine.optimizer.step,
        "zero_grad": engine.zero_grad,
        "save_checkpoint": lambda: engine.save_checkpoint(tmp_path / "ckpt"),
        "load_checkpoint": lambda: engine.load_checkpoint(tmp_path / "ckpt"),
        "export": lambda: engine.export(tmp_path / "w.safetensors"),
        "state_dict": engine.state_dict,
        "gathered_weights": engine.gathered_weights,
        "close": engine.close,
    }

    def intrude():
        for name, call in calls.items():
            try:
                call()
            except RuntimeError as e:
                errors.append((name, str(e)))

    b = threading.Thread(target=intrude, name="intruder-B")
    b.start()
    b.join(60)
    model.go.set()
    a.join(60)
    assert [name for name, _ in errors] == list(calls)
    for name, message in errors:
        assert "'intruder-B'" in message and "'trainer-A' is inside forward" in message, (name, message)
    _train_step(engine, 2)
    got = engine.gathered_weights()
    engine.close()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    again = infinity.initialize(make_model(), config(tmp_path / "a", NVME))  # the lock was freed
    again.close()


def test_any_thread_may_use_an_engine_no_other_is_inside(tmp_path):
    """Ownership lasts a call: an engine made on the main thread trains from a worker thread,
    and the main thread (as the atexit handler does) closes it after."""
    (tmp_path / "a").mkdir()
    engine = infinity.initialize(make_model(), config(tmp_path / "a", NVME))
    failed = []

    def work():
        try:
            train(engine, 2)
        except BaseException as e:  # noqa: BLE001 - carried to the main thread, which fails the test
            failed.append(e)

    worker = threading.Thread(target=work, name="worker")
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the worker's two steps did not finish in 60 s"
    if failed:
        raise failed[0]
    train(engine, 1, start=2)
    engine.close()
    again = infinity.initialize(make_model(), config(tmp_path / "a", NVME))
    again.close()


def test_the_engine_state_goes_open_refusing_open_closed():
    """`_lifecycle.Lifecycle`: closed until opened; refusing (saying why) until a checkpoint
    restores it; closed for good, which a late refusal does not reopen."""
    from infinity._lifecycle import EngineState, Lifecycle

    life = Lifecycle()
    with pytest.raises(RuntimeError, match="closed"):
        life.check_open()
    life.open()
    life.check_usable()
    life.refuse("load the last checkpoint")
    assert life.state is EngineState.REFUSING
    life.check_open()  # still open: closing, stats and loads work
    with pytest.raises(RuntimeError, match="^load the last checkpoint$"):
        life.check_usable()
    life.restore()
    life.check_usable()
    assert life.close() is True and life.close() is False
    life.refuse("too late")
    assert life.state is EngineState.CLOSED
    with pytest.raises(RuntimeError, match="closed"):
        life.check_usable()


def test_a_parameter_added_after_a_forward_is_refused_at_the_next_forward(tmp_path):
    """The step after a forward that passed the check does not walk the module again
    (`_lifecycle.TrainingGuard`): a parameter added after that forward had no part in it and
    gets no update; the next forward refuses it, naming it."""
    engine = infinity.initialize(make_model(), config(tmp_path, ("device",) * 3))
    try:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        engine.backward(engine(x).pow(2).mean())
        engine.module.extra = nn.Linear(2, 2)
        engine.step()
        with pytest.raises(RuntimeError, match=r"'extra.weight' of engine.module is not one the engine manages"):
            engine(x)
        with pytest.raises(RuntimeError, match="not one the engine manages"):
            engine.step()  # no forward passed since the last step: the step walks the module itself
    finally:
        engine.close()


@pytest.mark.parametrize("tiers", [("device",) * 3, ("nvme",) * 3])
def test_a_parameter_frozen_or_unfrozen_after_initialize_is_refused_naming_it(tmp_path, tiers):
    """A module's parameters are stepped together: one frozen after initialize got a zero
    gradient and still moved (momentum, weight decay), where plain PyTorch leaves it alone (a
    review: 2e-2 in a Trainer that froze the weights mid-run, nothing said). The next forward
    refuses it, naming it; set back, training goes on. A forward without grad gives no
    parameter a gradient, and is not refused (peft's disable_adapter() turns requires_grad off
    around the forwards it runs, as TRL's reference log-probabilities do under no_grad); the
    step after it is, if the change is still there."""
    engine = infinity.initialize(make_model(), config(tmp_path, tiers))
    try:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        name, p = next(iter(engine.module.named_parameters()))
        p.requires_grad_(False)
        match = rf"parameter '{name}': requires_grad is False now, True at infinity.initialize"
        with pytest.raises(RuntimeError, match=match):
            engine(x)
        with torch.no_grad():
            engine(x)
        with pytest.raises(RuntimeError, match=match):
            engine.step()  # the change is still there
        p.requires_grad_(True)
        loss = engine(x).pow(2).mean()
        p.requires_grad_(False)  # as peft's disable_adapter() around a no-grad forward
        with torch.no_grad():
            engine(x)
        p.requires_grad_(True)
        engine.backward(loss)
        assert engine.step()
    finally:
        engine.close()


@pytest.mark.parametrize("tiers", [("nvme", "cpu", "cpu"), ("nvme", "cpu", "nvme"), ("cpu",) * 3],
                         ids=["nvme-cpu-cpu", "nvme-cpu-nvme", "cpu"])  # fmt: skip
def test_autograd_grad_over_the_parameters_gives_torchs_gradients_and_leaves_none_behind(tmp_path, tiers):
    """torch.autograd.grad(loss, params) (and backward(inputs=params)) take the parameters as
    the graph's inputs, not reading their values: with the parameters released after forward
    (tiers.params = "nvme") the placeholders refused the call as a read outside the forward
    (an audit helper's repro), where every other placement gave torch's gradients."""
    model, ref = make_model().eval(), make_model().eval()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    with infinity.initialize(model, config(tmp_path, tiers, optimizer={"lr": 1e-2, "weight_decay": 0.01})) as engine:
        params = list(engine.module.parameters())
        got = torch.autograd.grad(engine(x).pow(2).mean(), params)
        want = torch.autograd.grad(ref(x).pow(2).mean(), list(ref.parameters()))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        engine(x).pow(2).mean().backward(inputs=params)  # a backward of them alone: a micro-batch
        ref(x).pow(2).mean().backward(inputs=list(ref.parameters()))
        assert engine.step()
        opt.step()
        weights = engine.gathered_weights()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(weights[k], v, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tiers", [("cpu",) * 3, ("device", "device", "cpu")], ids=["cpu", "device-device-cpu"])
def test_a_grad_set_by_hand_is_refused_at_the_step_and_zero_grad_drops_it(tmp_path, tiers):
    """Gradients written to p.grad by hand (torch.autograd.grad(loss, params), then p.grad = g:
    a custom clipper, a MAML-style update) reach no engine: its hooks take what backward makes.
    The step left them unused and the next backward added into them, silently (an audit
    helper's repro: no update, then 9e-4 off plain PyTorch). Now the step refuses, naming the
    parameter, and before a forward too; engine.zero_grad() drops them (as torch's does), and
    training goes on exactly as plain PyTorch's."""
    model, ref = make_model().eval(), make_model().eval()  # (eval: no dropout, which draws from the RNG)
    cfg = config(tmp_path, tiers, optimizer={"type": "sgd", "momentum": 0.9, "weight_decay": 0.0})
    opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    with infinity.initialize(model, cfg) as engine:
        params = list(engine.module.parameters())
        for p, g in zip(params, torch.autograd.grad(engine(x).pow(2).mean(), params)):
            p.grad = g
        with pytest.raises(RuntimeError, match=r"parameter '.*weight' has a \.grad the engine's backward did not make"):
            engine.step()
        with pytest.raises(RuntimeError, match=r"has a \.grad the engine's backward did not make"):
            engine(x)
        engine.zero_grad()
        assert all(p.grad is None for p in params)
        for _ in range(2):
            engine.backward(engine(x).pow(2).mean())
            assert engine.step()
            ref(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        got = engine.gathered_weights()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tiers", [("cpu",) * 3, ("nvme", "cpu", "cpu")], ids=["cpu", "nvme-cpu-cpu"])
def test_a_backward_that_gives_no_parameter_a_gradient_is_no_micro_batch(tmp_path, tiers):
    """Input saliency (torch.autograd.grad(loss, x)) before each micro-batch's engine.backward
    in DeepSpeed's loop (optimizer.accumulation = "engine"): the saliency pass gives no
    parameter a gradient, so it is not counted, and the step is neither refused (it was: "this
    step's gradients came from a plain loss.backward()", an audit helper's repro) nor off by a
    micro-batch. Against plain PyTorch, SGD with momentum, two micro-batches a step."""
    model, ref = make_model().eval(), make_model().eval()  # (eval: no dropout, which draws from the RNG)
    cfg = config(tmp_path, tiers, optimizer={"type": "sgd", "momentum": 0.9, "weight_decay": 0.0,
                                             "gradient_accumulation_steps": 2, "accumulation": "engine"})  # fmt: skip
    opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 16, generator=g) for _ in range(4)]
    with infinity.initialize(model, cfg) as engine:
        updated = []
        for x in batches:
            xs = x.clone().requires_grad_(True)
            (saliency,) = torch.autograd.grad(engine(xs).pow(2).mean(), xs)
            assert saliency.abs().sum() > 0
            engine.backward(engine(x).pow(2).mean())
            updated.append(engine.step())
        got = engine.gathered_weights()
    assert updated == [False, True, False, True]
    for i, x in enumerate(batches):
        (ref(x).pow(2).mean() / 2).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7)


def test_a_forward_after_close_says_the_engine_was_closed(tmp_path):
    """With the parameters on nvme the module holds placeholders once its engine is closed: a
    forward (generate, an evaluation) after close() was refused as a read outside the module,
    pointing at GatheredParameters (an audit helper's repro). It says the engine was closed."""
    engine = infinity.initialize(make_model(), config(tmp_path, ("nvme",) * 3))
    engine.close()
    with pytest.raises(RuntimeError, match=r"read \(.*\) after its infinity engine was closed"):
        engine.module(torch.randn(2, 16))
