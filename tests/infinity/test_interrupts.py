"""Ctrl-C at any point of backward(), step() or save_checkpoint(): the engine is left either
consistent or refusing to train with a message that says what to do, never silently
inconsistent. Interrupts are injected at fixed points (deterministic), as KeyboardInterrupt."""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import sys
import types

import pytest
import torch
from torch import nn

import infinity
import infinity._checkpoint
import infinity.swap._space
from infinity import _runtime, _schedule, _tiled

sys.path.insert(0, os.path.dirname(__file__))
from _common import config  # noqa: E402

NVME = ("nvme", "nvme", "nvme")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _cfg(path, overlap=True, keep=True):
    os.makedirs(path, exist_ok=True)
    return config(path, NVME, optimizer={"overlap": overlap, "sub_group_size": "1KiB"}, prefetch={"keep": keep})


class _Interrupt(torch.autograd.Function):
    """Identity forward; its backward raises KeyboardInterrupt when ``armed``."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _Interrupt.armed:
            _Interrupt.armed = False
            raise KeyboardInterrupt
        return grad


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _mlp()

    def forward(self, x):
        # Interrupted after the head's gradient is stored, before the first layers' arrive.
        h = self.inner[1](self.inner[0](x))
        h = _Interrupt.apply(h)
        for layer in list(self.inner)[2:]:
            h = layer(h)
        return h


def _loss(engine, step):
    x, y = _batch(step)
    return ((engine(x) - y) ** 2).mean()


@pytest.mark.parametrize("overlap", [True, False])
def test_an_interrupted_backward_refuses_the_step_until_zero_grad(tmp_path, overlap):
    ref = infinity.initialize(_Model(), _cfg(tmp_path / "ref", overlap))
    for step in range(2):
        ref.backward(_loss(ref, step))
        ref.step()
    expected = ref.gathered_weights()
    ref.close()

    engine = infinity.initialize(_Model(), _cfg(tmp_path / "a", overlap))
    engine.backward(_loss(engine, 0))
    engine.step()
    _Interrupt.armed = True
    with pytest.raises(KeyboardInterrupt):
        engine.backward(_loss(engine, 1))
    with pytest.raises(RuntimeError, match="last backward failed part-way .*call engine.zero_grad"):
        engine.step()
    engine.zero_grad()
    engine.backward(_loss(engine, 1))
    engine.step()
    got = engine.gathered_weights()
    engine.close()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_an_interrupted_step_refuses_to_train_on(tmp_path, monkeypatch):
    """A Ctrl-C in the middle of the step leaves some sub-groups updated and others not: the
    engine says so and asks for the last checkpoint, rather than training on inconsistent state."""
    os.makedirs(tmp_path / "a")
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a", False))
    x, y = _batch(0)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.backward(((engine(x) - y) ** 2).mean())
    _ctrl_c_in_the_second_subgroup_update(engine, monkeypatch)
    with pytest.raises(RuntimeError, match="optimizer step failed part-way .*load the last checkpoint"):
        engine(x)
    with pytest.raises(RuntimeError, match="optimizer step failed part-way"):  # no checkpoint of a half step
        engine.save_checkpoint(tmp_path / "ckpt", tag="half")
    engine.load_checkpoint(tmp_path / "ckpt")
    engine.backward(((engine(x) - y) ** 2).mean())
    assert engine.step() is True
    engine.close()




def _train(engine, steps, start=0) -> None:
    for step in range(start, start + steps):
        engine.backward(_loss(engine, step))
        engine.step()


def test_a_ctrl_c_after_the_update_counts_the_step(tmp_path, monkeypatch):
    """A real SIGINT once the step's update is done (here in its heap trim): the step is whole
    (counted, its gradients dropped, the schedule stepped) and the KeyboardInterrupt comes at
    its end. It came in the middle: the weights updated, the step uncounted, and the step the
    user redid updated them twice (an audit helper's repro)."""
    ref = infinity.initialize(_mlp(), _cfg(tmp_path / "ref", False))
    _train(ref, 3)
    expected = ref.gathered_weights()
    ref.close()
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a", False))
    _train(engine, 1)
    real = infinity._resources.trim_malloc

    def trim(*args):
        monkeypatch.setattr(infinity._resources, "trim_malloc", real)
        signal.raise_signal(signal.SIGINT)
        real(*args)

    monkeypatch.setattr(infinity._resources, "trim_malloc", trim)
    with pytest.raises(KeyboardInterrupt):
        _train(engine, 1, start=1)
    assert engine.stats()["steps"] == 2
    _train(engine, 1, start=2)
    got = engine.gathered_weights()
    engine.close()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize("error", [KeyboardInterrupt, functools.partial(OSError, 28, "No space left on device")],
                         ids=["ctrl-c", "enospc"])  # fmt: skip
def test_a_write_failed_in_the_step_then_load_checkpoint_trains_on_exactly(tmp_path, monkeypatch, error):
    """A write of the step that fails (a full disk, a Ctrl-C) drops its tensor's record from the
    swap space; the engine refuses and asks for the last checkpoint, whose load then failed
    looking up that tensor's shape ("no tensor 'optimizer.0/exp_avg' in swap space"): stuck
    for good (an audit helper's repro). The load now writes it again, and training goes on as
    from the checkpoint."""
    ref = infinity.initialize(_mlp(), _cfg(tmp_path / "ref", False))
    _train(ref, 1)
    ref.save_checkpoint(tmp_path / "ckpt")
    _train(ref, 2, start=1)
    expected = ref.gathered_weights()
    ref.close()
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a", False))
    engine.backward(_loss(engine, 0))
    real = infinity.swap._space.Transfer

    class Failing(real):
        def __init__(self, *args, name="", write=False, **kwargs):
            if write and name.endswith("exp_avg"):
                raise error()
            super().__init__(*args, name=name, write=write, **kwargs)

    monkeypatch.setattr(infinity.swap._space, "Transfer", Failing)
    with pytest.raises((KeyboardInterrupt, OSError)):
        engine.step()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="optimizer step failed part-way .*load the last checkpoint"):
        engine(_batch(1)[0])
    engine.load_checkpoint(tmp_path / "ckpt")
    _train(engine, 2, start=1)
    got = engine.gathered_weights()
    engine.close()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_ctrl_c_right_after_the_checkpoint_root_is_locked_leaves_it_unlocked(tmp_path, monkeypatch):
    """A Ctrl-C as the flock on the checkpoint root's lock file returns: the lock went with the
    interrupt. It stayed held by a leaked descriptor, and every later save to that root from
    this process was refused as "in use by another save", naming this very process (an audit
    helper's repro)."""
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a", False))
    _train(engine, 1)
    real = fcntl.flock

    def flock_then_ctrl_c(fd, op):
        real(fd, op)
        monkeypatch.setattr(infinity._checkpoint, "fcntl", fcntl)
        raise KeyboardInterrupt  # where a SIGINT lands as the call returns

    monkeypatch.setattr(infinity._checkpoint, "fcntl", types.SimpleNamespace(
        flock=flock_then_ctrl_c, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB))  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(tmp_path / "ckpt")
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.load_checkpoint(tmp_path / "ckpt")
    engine.close()


def test_an_interrupted_save_leaves_the_engine_training_and_the_next_save_whole(tmp_path, monkeypatch):
    """A save only reads the engine's state: interrupted, the engine trains on as before, and
    the next save (which collects the interrupted one's leftovers) resumes bit-exactly."""
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a"))
    engine.backward(_loss(engine, 0))
    engine.step()
    import infinity._checkpoint as ck

    real = ck.write_json_atomic

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "write_json_atomic", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(tmp_path / "ckpt", tag="one")
    monkeypatch.setattr(ck, "write_json_atomic", real)
    assert infinity.checkpoint.list_checkpoints(tmp_path / "ckpt") == []
    engine.save_checkpoint(tmp_path / "ckpt", tag="two")
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".lock", "latest", "two"]
    engine.backward(_loss(engine, 1))
    engine.step()
    after = engine.gathered_weights()
    engine.close()
    resumed = infinity.initialize(_mlp(), _cfg(tmp_path / "b"))
    resumed.load_checkpoint(tmp_path / "ckpt")
    resumed.backward(_loss(resumed, 1))
    resumed.step()
    assert all(torch.equal(after[k], v) for k, v in resumed.gathered_weights().items())
    resumed.close()


# -- Ctrl-C during a parameter fetch or a forward: a real SIGINT at a fixed point ------------


def _sigint_at(monkeypatch, owner, name: str, *, call: int, at: str) -> list:
    """Wrap ``owner.name`` so that its ``call``-th call (counted from now) delivers a real
    SIGINT at its start or its end, as a Ctrl-C landing there would. Returns the list of
    calls, for the test to check the window was reached."""
    real = getattr(owner, name)
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(name)
        if at == "start" and len(calls) == call:
            signal.raise_signal(signal.SIGINT)
        out = real(*args, **kwargs)
        if at == "end" and len(calls) == call:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(owner, name, wrapped)
    return calls


def _reference(tmp_path, steps: int) -> dict:
    ref = infinity.initialize(_mlp(), _cfg(tmp_path / "ref"))
    for step in range(steps):
        ref.backward(_loss(ref, step))
        ref.step()
    out = ref.gathered_weights()
    ref.close()
    return out


# The windows of a fetch: its read's future consumed but the unit not yet bound; bound but not
# yet known to the saved-tensor hooks; and a release cut between its steps.
_FETCH_WINDOWS = [
    ("ParamUnit.bind", "start"),
    ("ParamUnit.bind", "end"),
    ("ParamUnit.unbind", "end"),
    ("Lease.release", "end"),
]


@pytest.mark.parametrize("where,at", _FETCH_WINDOWS, ids=[f"{w}-{a}" for w, a in _FETCH_WINDOWS])
def test_a_ctrl_c_in_a_parameter_fetch_leaves_the_engine_loadable_and_exact(tmp_path, monkeypatch, where, at):
    """After the interrupt, load_checkpoint works and training goes on bit-exactly as the
    uninterrupted run; close() then frees the swap directory for a new engine."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    expected = _reference(tmp_path, 3)
    # prefetch.keep off: forward releases each unit after use, so the windows are in forward
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a", keep=False))
    engine.backward(_loss(engine, 0))
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    owner, name = where.split(".")
    module = infinity._units if owner == "ParamUnit" else infinity._store
    calls = _sigint_at(monkeypatch, getattr(module, owner), name, call=2, at=at)
    with pytest.raises(KeyboardInterrupt):
        engine.backward(_loss(engine, 1))
    monkeypatch.undo()
    assert len(calls) >= 2
    engine.load_checkpoint(tmp_path / "ckpt")
    for step in (1, 2):
        engine.backward(_loss(engine, step))
        engine.step()
    got = engine.gathered_weights()
    engine.close()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    again = infinity.initialize(_mlp(), _cfg(tmp_path / "a"))  # the directory lock was freed
    again.close()


@pytest.mark.parametrize("where,at", _FETCH_WINDOWS[:2], ids=[f"{w}-{a}" for w, a in _FETCH_WINDOWS[:2]])
def test_close_after_a_ctrl_c_in_a_parameter_fetch_frees_the_swap_directory(tmp_path, monkeypatch, where, at):
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a"))
    _sigint_at(monkeypatch, infinity._units.ParamUnit, where.split(".")[1], call=2, at=at)
    with pytest.raises(KeyboardInterrupt):
        _loss(engine, 0)
    monkeypatch.undo()
    engine.close()
    again = infinity.initialize(_mlp(), _cfg(tmp_path / "a"))
    again.backward(_loss(again, 0))
    again.step()
    again.close()


class _CtrlCInForward(nn.Module):
    """The MLP, with a real SIGINT between its layers when ``armed``."""

    armed = False

    def __init__(self):
        super().__init__()
        self.inner = _mlp()

    def forward(self, x):
        h = self.inner[1](self.inner[0](x))
        if _CtrlCInForward.armed:
            _CtrlCInForward.armed = False
            signal.raise_signal(signal.SIGINT)
        for layer in list(self.inner)[2:]:
            h = layer(h)
        return h


@pytest.mark.parametrize("call", ["engine", "module"])
def test_a_ctrl_c_inside_forward_ends_the_pass(tmp_path, monkeypatch, call):
    """torch runs a module's always-called forward hooks on an Exception, not on a
    KeyboardInterrupt: the pass the engine began must still end, so that the next forward
    checks again that the engine is usable (here: refused after an interrupted step), and
    training resumes exactly from the checkpoint. ``module``: called as transformers' Trainer
    calls it, ``engine.module(...)``, with no engine code around the call."""
    ref = infinity.initialize(_CtrlCInForward(), _cfg(tmp_path / "ref"))
    for step in range(2):
        ref.backward(_loss(ref, step))
        ref.step()
    expected = ref.gathered_weights()
    ref.close()

    engine = infinity.initialize(_CtrlCInForward(), _cfg(tmp_path / "a", False))
    engine.save_checkpoint(tmp_path / "ckpt")
    _CtrlCInForward.armed = True
    with pytest.raises(KeyboardInterrupt):
        (engine if call == "engine" else engine.module)(_batch(0)[0])
    engine.backward(_loss(engine, 0))  # a later forward and backward still work
    _ctrl_c_in_the_second_subgroup_update(engine, monkeypatch)
    with pytest.raises(RuntimeError, match="optimizer step failed part-way .*load the last checkpoint"):
        _loss(engine, 0)
    engine.load_checkpoint(tmp_path / "ckpt")
    for step in range(2):
        engine.backward(_loss(engine, step))
        engine.step()
    got = engine.gathered_weights()
    engine.close()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize("plain", [False, True], ids=["engine.backward", "loss.backward"])
def test_after_an_interrupted_backward_the_next_backward_ends_and_is_counted(tmp_path, caplog, plain):
    """A backward that raised never runs the end-of-pass callback it queued with autograd; the
    next backward must still end its pass (and be counted: with overlap, the step compares the
    count with optimizer.gradient_accumulation_steps, and warned of "0 backward passes")."""
    engine = infinity.initialize(_Model(), _cfg(tmp_path / "a"))
    _Interrupt.armed = True
    with pytest.raises(KeyboardInterrupt):
        engine.backward(_loss(engine, 0))
    engine.zero_grad()
    if plain:
        _loss(engine, 0).backward()
    else:
        engine.backward(_loss(engine, 0))
    assert not engine.scheduler.in_backward
    with caplog.at_level("WARNING", logger="infinity"):
        engine.step()
    engine.close()
    assert "backward passes" not in caplog.text


def test_after_a_plain_backward_raised_forward_and_step_refuse_until_zero_grad(tmp_path):
    """A ``loss.backward()`` that raised never runs the end it queued with autograd: its units
    hold part of its gradients and its pass is still open (a next forward would be taken for a
    recomputation inside it, and fail in autograd on released parameters). The next forward
    and the step say so, until zero_grad ends it; the redone step is then exact."""
    ref = infinity.initialize(_Model(), _cfg(tmp_path / "ref"))
    ref.backward(_loss(ref, 0))
    ref.step()
    expected = ref.gathered_weights()
    ref.close()

    engine = infinity.initialize(_Model(), _cfg(tmp_path / "a"))
    _Interrupt.armed = True
    with pytest.raises(KeyboardInterrupt):
        _loss(engine, 0).backward()
    with pytest.raises(RuntimeError, match=r"last backward raised part-way .*call engine.zero_grad"):
        _loss(engine, 0)
    with pytest.raises(RuntimeError, match=r"last backward raised part-way .*call engine.zero_grad"):
        engine.step()
    engine.zero_grad()
    _loss(engine, 0).backward()
    engine.step()
    got = engine.gathered_weights()
    engine.close()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_ctrl_c_while_prefetches_are_given_back_leaves_the_engine_loadable(tmp_path, monkeypatch):
    """A grad-enabled forward leaves the first units of its backward prefetched; a save gives
    them back first. A Ctrl-C as one of those reads is given back (its lease released, the unit
    not yet marked released) must not leave a unit fetching with no read."""
    expected = _reference(tmp_path, 2)
    # prefetch.keep off: the units backward needs first are prefetched, not kept from forward
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a", keep=False))
    engine.backward(_loss(engine, 0))
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    _loss(engine, 5)  # a forward whose backward never runs
    assert any(u.state is infinity._units.UnitState.FETCHING for u in engine.units)
    _sigint_at(monkeypatch, infinity._store.Lease, "release", call=1, at="end")
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(tmp_path / "ckpt", tag="again")
    monkeypatch.undo()
    engine.load_checkpoint(tmp_path / "ckpt")
    engine.backward(_loss(engine, 1))
    engine.step()
    got = engine.gathered_weights()
    engine.close()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    again = infinity.initialize(_mlp(), _cfg(tmp_path / "a"))
    again.close()


def test_a_forward_whose_backward_never_runs_then_a_save_trains_on_exactly(tmp_path):
    """A loss computed and dropped before a save: the save releases every unit and the
    gradient uses that forward expected; the next step must still be exact."""
    expected = _reference(tmp_path, 2)
    engine = infinity.initialize(_mlp(), _cfg(tmp_path / "a"))
    engine.backward(_loss(engine, 0))
    engine.step()
    _loss(engine, 5)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.backward(_loss(engine, 1))
    engine.step()
    got = engine.gathered_weights()
    engine.close()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def _ctrl_c_in_the_second_subgroup_update(engine, monkeypatch) -> None:
    """engine.step() interrupted after its first sub-group was updated: a half step."""
    calls = []
    real = engine.optimizer.updater._update

    def interrupted(index, *args):
        calls.append(index)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(index, *args)

    monkeypatch.setattr(engine.optimizer.updater, "_update", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()


# -- Ctrl-C at every line of backward's gradient hooks: a real SIGINT from a trace function -----

_SCHEDULE = _schedule.__file__
_RUNTIME = _runtime.__file__
_TILED = _tiled.__file__
# From a parameter's gradient arriving (or a tile's being made) to the unit's hand-over.
_HOOK_PATH = {
    _SCHEDULE: {"hook"},
    _RUNTIME: {"grad_arrived", "_took_whole", "tile_grad", "_grad_buffer", "_unclaimed", "_gather_grad",
               "finish_unit_backward"},
    _TILED: {"backward"},
}  # fmt: skip


def _interrupt_at_line(k: int):
    """A trace function that raises a real SIGINT at the k-th line (or call) run in the hook
    path; ``seen`` lists (function, line) of each one it counted."""
    seen = []

    def trace(frame, event, arg):
        code = frame.f_code
        if code.co_name not in _HOOK_PATH.get(code.co_filename, ()):
            return None
        if event in ("call", "line"):
            seen.append((code.co_name, frame.f_lineno))
            if len(seen) == k:
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)  # KeyboardInterrupt from here, or held
        return trace

    return trace, seen


def _tiled_mlp() -> nn.Module:
    """The MLP with a middle layer of 2112 fp32 parameters: two tiles at 4KiB."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 4))


def _bias_free_mlp() -> nn.Module:
    """Every module's parameters one tensor: each unit's gradient is all of it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU(), nn.Linear(32, 32, bias=False),
                         nn.LayerNorm(32, bias=False), nn.Linear(32, 4, bias=False))  # fmt: skip


def _hook_cfg(path, overlap: bool, states: str, tiled: bool, tiers=NVME) -> dict:
    os.makedirs(path, exist_ok=True)
    memory = {"tile_size": "4KiB"} if tiled else {}
    return config(path, tiers, optimizer={"overlap": overlap, "sub_group_size": "1KiB", "state_dtype": states},
                  memory=memory)  # fmt: skip


def _sweep_hook_path(tmp_path, *, overlap: bool, states: str, tiled: bool = False, plain: bool = False,
                     every: bool, tiers=NVME, model=None,
                     expect=("hook", "grad_arrived", "_gather_grad", "finish_unit_backward")) -> int:  # fmt: skip
    """Interrupt step 1's backward at each line of the hook path in turn (``every``), or at the
    first run of each of its lines; then zero_grad, redo it and step: bit-identical to the
    uninterrupted run each time. ``expect``: functions the path runs. Returns how many points
    were interrupted."""
    model = model or (_tiled_mlp if tiled else _mlp)
    cfg = functools.partial(_hook_cfg, overlap=overlap, states=states, tiled=tiled, tiers=tiers)
    ref = infinity.initialize(model(), cfg(tmp_path / "ref"))
    for step in range(2):
        ref.backward(_loss(ref, step))
        ref.step()
    expected = ref.gathered_weights()
    ref.close()

    engine = infinity.initialize(model(), cfg(tmp_path / "a"))
    engine.backward(_loss(engine, 0))
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    trace, path = _interrupt_at_line(0)  # k = 0: never raises; records the path's lines
    sys.settrace(trace)
    try:
        _loss(engine, 1).backward()
    finally:
        sys.settrace(None)
    engine.zero_grad()
    assert {name for name, _ in path} >= set(expect), path
    if every:
        points = range(1, len(path) + 1)
    else:
        first = {}
        for k, at in enumerate(path, 1):
            first.setdefault(at, k)
        points = sorted(first.values())
    for k in points:
        engine.load_checkpoint(tmp_path / "ckpt")
        loss = _loss(engine, 1)
        trace, seen = _interrupt_at_line(k)
        sys.settrace(trace)
        try:
            with pytest.raises(KeyboardInterrupt):
                loss.backward() if plain else engine.backward(loss)
        finally:
            sys.settrace(None)
        engine.zero_grad()
        assert not any(p.grad is not None for u in engine.units for p in u.params), f"line {k} ({seen[-1]})"
        engine.backward(_loss(engine, 1))
        engine.step()
        got = engine.gathered_weights()
        assert all(torch.equal(expected[n], got[n]) for n in expected), f"interrupt at line {k} ({seen[-1]})"
    engine.close()
    return len(points)


_STATES = [(True, "fp32"), (False, "fp32"), (True, "int8"), (False, "int8")]


@pytest.mark.parametrize("overlap,states", _STATES, ids=[f"overlap={o}-{s}" for o, s in _STATES])
def test_a_ctrl_c_in_the_gradient_hooks_then_zero_grad_redoes_the_step_exactly(tmp_path, overlap, states):
    """A SIGINT at the first run of each line from a gradient's arrival to its hand-over:
    nothing is left behind (a gradient left in a parameter would be added to the redone
    step's, with no error)."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert _sweep_hook_path(tmp_path, overlap=overlap, states=states, every=False) > 15


@pytest.mark.parametrize("plain", [False, True], ids=["engine.backward", "loss.backward"])
def test_a_ctrl_c_in_a_tiles_gradients_then_zero_grad_redoes_the_step_exactly(tmp_path, plain):
    """The same through a tiled Linear, whose tiles' gradients come from its Function; and
    through a plain ``loss.backward()``, which ends its pass only through its own callback."""
    assert _sweep_hook_path(tmp_path, overlap=True, states="fp32", tiled=True, plain=plain, every=False) > 15


@pytest.mark.parametrize("overlap", [True, False])
def test_a_ctrl_c_where_a_gradient_becomes_the_tier_s_tensor_then_zero_grad_redoes_the_step_exactly(tmp_path, overlap):
    """The same where every gradient takes the short way (`UnitRuntime._took_whole`: each unit
    one parameter, the grads tier on the compute device, the optimizer states in host memory,
    early updates under backward or not): nothing gathered, the tier's tensor adopted."""
    tiers = ("device", "device", "cpu")
    n = _sweep_hook_path(tmp_path, overlap=overlap, states="fp32", every=False, tiers=tiers, model=_bias_free_mlp,
                         expect=("hook", "grad_arrived", "_took_whole"))  # fmt: skip
    assert n > 10


# Every line, not only each line's first run: two opposite corners of the variants the sampled
# sweeps above cover (the eight took 2m40s of the suite's time on 2 cores).
_EVERY = [(True, "int8", True), (False, "fp32", False)]


@pytest.mark.slow
@pytest.mark.parametrize("overlap,states,tiled", _EVERY, ids=[f"overlap={o}-{s}-{'tiled' if t else 'whole'}"
                                                              for o, s, t in _EVERY])  # fmt: skip
def test_a_ctrl_c_at_every_line_of_the_gradient_hooks_then_zero_grad_redoes_the_step_exactly(
    tmp_path, overlap, states, tiled
):
    _sweep_hook_path(tmp_path, overlap=overlap, states=states, tiled=tiled, every=True)


def test_a_ctrl_c_in_a_gradient_hook_then_load_checkpoint_redoes_the_step_exactly(tmp_path):
    """A load drops what an interrupted backward left as zero_grad does: the gradient still on
    the parameter whose hook was cut, and the pass a plain ``loss.backward()`` left open."""
    ref = infinity.initialize(_mlp(), _hook_cfg(tmp_path / "ref", True, "fp32", False))
    for step in range(2):
        ref.backward(_loss(ref, step))
        ref.step()
    expected = ref.gathered_weights()
    ref.close()

    engine = infinity.initialize(_mlp(), _hook_cfg(tmp_path / "a", True, "fp32", False))
    engine.backward(_loss(engine, 0))
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    loss = _loss(engine, 1)
    trace, seen = _interrupt_at_line(1)  # the first parameter's hook, before it takes the gradient
    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            loss.backward()
    finally:
        sys.settrace(None)
    assert seen == [("hook", seen[0][1])]
    assert any(p.grad is not None for u in engine.units for p in u.params)
    engine.load_checkpoint(tmp_path / "ckpt")
    assert not any(p.grad is not None for u in engine.units for p in u.params)
    engine.backward(_loss(engine, 1))
    engine.step()
    got = engine.gathered_weights()
    engine.close()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
