"""The optimizer: ``engine.optimizer``, a `torch.optim.Optimizer` whose update runs where the
optimizer states live.

Owns: the parameter groups (the user's parameters and hyperparameters, which LR schedulers
change between steps) and what ``torch.optim`` offers around them: ``step()`` and
``zero_grad()`` (the engine's), ``state_dict()`` / ``load_state_dict()`` (the groups'
hyperparameters and the per-unit step counts). Touches: the three parts it is built from and
hands its parameter groups to: the algorithm (`_algorithms`: state kinds, hyperparameters,
kernel), the per-sub-group state (`_substates`: stores, keys, step counts, loads) and the
streamed update (`_update`: the step, clipping, the read-ahead); the rest of the engine reaches
them through the attributes here.
"""

from __future__ import annotations

import logging

import torch

from . import _algorithms
from ._grads import GradAccumulator
from ._substates import SubGroupStates
from ._update import StreamedUpdate

logger = logging.getLogger("infinity")


class Optimizer(torch.optim.Optimizer):
    """The engine's optimizer, ``engine.optimizer``: a `torch.optim.Optimizer` whose
    ``param_groups`` hold the user's parameters and hyperparameters, so LR schedulers work on
    it unmodified; ``step()`` is ``engine.step()`` and ``zero_grad()`` is ``engine.zero_grad()``.
    Its state lives in the optimizer tier, not in ``state``."""

    _infinity_engine_optimizer = True  # its step is the engine's (see engine._refuse_foreign_step)

    def __init__(self, substates: SubGroupStates, defaults: dict, *, grads: GradAccumulator, max_grad_norm,
                 engine_step, engine_zero_grad, plan=None):  # fmt: skip
        """``substates``: the sub-groups' states, made with this optimizer's parameter groups
        (`_algorithms.resolve`'s), which torch's constructor completes in place; ``plan``: the
        engine's `_admission.Plan`, made before this (the step's read-ahead, its held gradients)."""
        self._ready = False
        super().__init__(substates.param_groups, defaults)
        # One list of groups: torch's constructor filled in each of the same dicts (LR
        # schedulers change them in place) but keeps them in a list of its own.
        self.param_groups = substates.param_groups
        self.algorithm = substates.algorithm
        self.substates = substates
        self.updater = StreamedUpdate(substates, self.param_groups, grads, max_grad_norm, plan)
        # What the rest of the engine reads of them, fixed at initialize (the objects are shared).
        sub = self.substates
        self.units, self.frozen = sub.units, sub.frozen
        self.groups = sub.groups  # SubGroups of the trainable units
        self.states = sub.stores  # kind -> Store, all in the optimizer tier: algorithm.kind_names
        self.param_store, self.param_dtype, self.device = sub.param_store, sub.param_dtype, sub.device
        self.gather_params, self.steps, self.foreign = sub.gather_params, sub.steps, sub.foreign
        self.one_copy = sub.one_copy  # the parameters are the master weights: [Note: one copy of the fp32 weights]
        self.grads = grads
        self._engine_step = engine_step  # the engine's: what step() and zero_grad() run
        self._engine_zero_grad = engine_zero_grad
        self._told_set_to_none = False  # zero_grad(set_to_none=False) said once
        self._told_state_dict = False  # state_dict() without the states said once
        self.step_was_skipped = False  # the last step() was skipped (an fp16 overflow, a non-finite gradient)
        # SGD groups without momentum at initialize: their buffers start as zeros, where torch
        # starts one at the gradient when momentum is turned on (see `_refuse_momentum_turned_on`).
        self._momentum_off = [self.kind == "sgd" and float(g.get("momentum", 0) or 0) == 0 for g in self.param_groups]
        self._ready = True

    # -- torch.optim.Optimizer --------------------------------------------------------------
    def step(self, closure=None):
        """The engine's step (``engine.step()``): returns False when it was skipped (an fp16
        overflow or a non-finite gradient). The gradients are dropped after it, as DeepSpeed's
        step drops them (torch's keeps them until ``zero_grad()``)."""
        if closure is not None:
            raise ValueError("engine.optimizer.step(closure) is not supported: run forward and backward, then step()")
        _algorithms.refuse_flags(self.algorithm, self.param_groups)
        self._refuse_momentum_turned_on()
        stepped = self._engine_step()
        self.step_was_skipped = stepped is False  # what accelerate's AcceleratedOptimizer calls it
        return stepped

    def _refuse_momentum_turned_on(self) -> None:
        """SGD's momentum turned on, with dampening, in a group that stepped without it: torch
        starts the buffer at the gradient, the engine's buffer holds the zeros of the steps
        without momentum, so its first would be (1 - dampening) of it (0.006 off in 4 steps)."""
        for i, (off, g) in enumerate(zip(self._momentum_off, self.param_groups)):
            if off and float(g["momentum"]) != 0 and float(g["dampening"]) != 0 and self._any_stepped():
                raise ValueError(
                    f"engine.optimizer.param_groups[{i}]: momentum turned on ({g['momentum']}) with dampening "
                    f"{g['dampening']} after the group stepped without momentum: torch starts its buffer at the "
                    "gradient, the engine's would start from zeros; set momentum > 0 at initialize, or dampening=0"
                )

    def _unit_steps(self) -> torch.Tensor:
        """Each unit's step count, in order, fp32 on the host."""
        return torch.stack([self.steps[u.index].detach().to("cpu", torch.float32) for u in self.units])

    def _any_stepped(self) -> bool:
        """Whether any unit has stepped (this run, or the checkpoint loaded)."""
        return any(float(t) > 0 for t in self.steps.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``engine.zero_grad()``: forget the gradients accumulated since the last step. The
        engine's gradients are always set to none: with ``set_to_none=False`` a unit no
        gradient reaches in the next step does not step, where torch's optimizer would step its
        parameters on zeros (their moments and weight decay moving them); said once."""
        if set_to_none is False and not self._told_set_to_none:
            self._told_set_to_none = True
            logger.warning("engine.optimizer.zero_grad(set_to_none=False): the engine sets the gradients to none; a "
                           "parameter no gradient reaches in a step does not step (torch's optimizer would step it "
                           "on a zero gradient)")  # fmt: skip
        self._engine_zero_grad()

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_ready", False):
            raise ValueError("the engine's parameter groups are fixed at initialize: pass every group there")
        super().add_param_group(param_group)

    def state_dict(self) -> dict:
        """`checkpoint_state`, for a caller outside the engine (accelerate's save_state, a plain
        ``torch.save``): once steps are taken with the moments in the tiers, it holds none of
        them, so a resume from it is refused at its load (accelerate's load_state), a whole
        run's checkpoints later: said at the first such call (an audit helper's repro)."""
        if self.foreign is None and not self._told_state_dict and self._any_stepped():
            self._told_state_dict = True
            logger.warning(
                "engine.optimizer.state_dict() holds the groups' hyperparameters and step counts, not the optimizer "
                "states (they live in the engine's tiers): a resume from it (accelerate's load_state) is refused. "
                "Checkpoint with engine.save_checkpoint and resume with engine.load_checkpoint. (Said once.)")  # fmt: skip
        return self.checkpoint_state()

    def checkpoint_state(self) -> dict:
        """The groups' hyperparameters (JSON-able, parameters as indices as torch does) and each
        unit's step count. The master weights and states live in ``states`` and are streamed by
        checkpoints, not here. A torch optimizer run as it is keeps its state itself: its
        per-parameter state is here too, as torch's own ``state_dict()`` gives it ("state", the
        tensors themselves, for accelerate's save_state and a plain ``torch.save``), and named
        ("torch_state", for the checkpoint's JSON, whose tensors `foreign_tensors` gives)."""
        out = {
            "type": self.kind,
            "param_groups": [_json_group(g) for g in self.param_groups],
            "unit_steps": self._unit_steps(),
        }
        if self.foreign is not None:
            state = self.foreign.state_dict()["state"]
            out["state"] = state
            out["torch_state"] = {
                str(idx): {key: ({"tensor": f"torch_optimizer/{idx}/{key}", "shape": list(v.shape),
                                  "dtype": str(v.dtype).removeprefix("torch.")}
                                 if isinstance(v, torch.Tensor) else v) for key, v in st.items()}
                for idx, st in state.items()
            }  # fmt: skip
        return out

    def foreign_tensors(self):
        """(name, tensor) of every tensor in the state of a torch optimizer run as it is."""
        if self.foreign is None:
            return
        for idx, st in self.foreign.state_dict()["state"].items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    yield f"torch_optimizer/{idx}/{key}", v

    def load_foreign_state(self, state: dict) -> None:
        """The per-parameter state of a torch optimizer run as it is (index -> key -> value)."""
        groups = self.foreign.state_dict()["param_groups"]
        self.foreign.load_state_dict({"state": {int(k): v for k, v in state.items()}, "param_groups": groups})

    def load_state_dict(self, state: dict) -> None:
        """The hyperparameters of what `state_dict` gave. Step counts other than the engine's
        own now, and a torch optimizer's state, are refused: the moments they go with live in the
        tiers, restored by ``engine.load_checkpoint`` only (restored alone, bias correction
        resumed at step N on moments of zero). A torch optimizer run as it is (every tier on the
        device) keeps its state itself: what its `state_dict` gave loads whole, as torch's does."""
        if self.foreign is not None:
            self._load_foreign(state)
            return
        steps = state.get("unit_steps")
        # accelerate's AcceleratedOptimizer loads the state_dict it just took: the same steps.
        restores = steps is not None and not torch.equal(torch.as_tensor(steps).cpu(), self._unit_steps())
        if restores or state.get("state"):
            what = "step counts" if restores else "per-parameter state (moments, steps)"
            raise ValueError(
                f"engine.optimizer.load_state_dict: the dict holds {what} but the engine's optimizer states live "
                "in its tiers, and a state_dict holds neither them nor a way to fill them (accelerate's "
                "save_state/load_state go through it): save with engine.save_checkpoint and resume with "
                "engine.load_checkpoint; a dict of param_groups alone loads their hyperparameters"
            )
        if "param_groups" in state:
            self.load_hyperparameters(state.get("type", self.kind), state["param_groups"])

    def _load_foreign(self, state: dict) -> None:
        """`load_state_dict` for a torch optimizer run as it is: its groups' hyperparameters and
        its per-parameter state, from this engine's `state_dict` or from the torch optimizer's
        own (an optimizer of the same class over the same parameters, as torch loads it)."""
        kind = state.get("type", self.kind)
        if kind != self.kind:
            raise ValueError(f"engine.optimizer.load_state_dict: the dict is of optimizer {kind!r}; this engine runs "
                             f"{type(self.foreign).__name__} as it is ({self.kind!r})")  # fmt: skip
        if "param_groups" in state:
            self.load_hyperparameters(self.kind, state["param_groups"])
        if "state" in state:
            self.load_foreign_state(state["state"])

    def load_hyperparameters(self, kind: str, groups: list[dict]) -> None:
        if kind != self.kind or len(groups) != len(self.param_groups):
            raise ValueError(f"saved optimizer {kind!r} with {len(groups)} parameter group(s); this engine's is "
                             f"{self.kind!r} with {len(self.param_groups)}")  # fmt: skip
        for mine, saved in zip(self.param_groups, groups):
            for key, value in saved.items():
                if key != "params":
                    mine[key] = tuple(value) if key == "betas" else value

    def hyperparameters(self) -> list[dict]:
        """Every parameter group's hyperparameters as they are now (comparable with ``==``)."""
        return [_json_group(g) for g in self.param_groups]

    # -- the parts it is made of -----------------------------------------------------------
    @property
    def kind(self) -> str:
        """The algorithm's name ("adamw", ..., "torch"), as the config and state_dict name it."""
        return self.algorithm.name

    @property
    def kinds(self) -> tuple[str, ...]:
        """The state kinds stored per sub-group: "master" and the algorithm's own."""
        return self.algorithm.kind_names

    def record(self, unit):
        """``unit``'s `_substates.StateRecord`: its keys and byte sizes ([Note: state keys])."""
        return self.substates.record(unit)

    def init_state(self, prepare=None, done=None) -> None:
        """See `SubGroupStates.init_state`."""
        self.substates.init_state(prepare, done)

    def load_master(self, values: dict) -> None:
        """See `SubGroupStates.load_master`."""
        self.substates.load_master(values)

    def update(self, loss_scale: float = 1.0, overlap=None) -> bool:
        """See `StreamedUpdate.update`."""
        return self.updater.update(loss_scale, overlap)

    def apply(self, index: int, master, states, grads: dict, divide: float, steps: dict, first: set) -> None:
        """See `StreamedUpdate.apply` (what the overlap runs early)."""
        self.updater.apply(index, master, states, grads, divide, steps, first)

    # What the engine sets and reads between steps, kept by the update.
    clip_next = property(lambda self: self.updater.clip_next, lambda self, v: setattr(self.updater, "clip_next", v),
                         doc="Clip the next step to this (`Engine.clip_grad_norm_`), then forget it.")  # fmt: skip
    clipped_last = property(lambda self: self.updater.clipped_last, doc="Whether the last step clipped.")
    max_grad_norm = property(lambda self: self.updater.max_grad_norm, doc="Clip every step to this (the config's).")
    read_ahead = property(lambda self: self.updater.read_ahead,
                          doc="How far the step reads ahead (`_update.ReadAhead`), as the memory plan fitted it.")  # fmt: skip


def _json_group(group: dict) -> dict:
    """A parameter group's hyperparameters as JSON holds them (tuples as lists, tensors as
    floats, also inside them: betas of tensors). Values, not the live tensors: the overlap
    compares a snapshot with the step's, and a tensor filled in place between them must differ."""
    return {key: _json_value(value) for key, value in group.items() if key != "params"}


def _json_value(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    return value
