"""Whether an engine can be used, and the checks before each pass and step.

Owns: the engine's one state (`EngineState`: open, refusing to train until a checkpoint
loads, closed) with why it refuses, and the guard that the module still holds only what the
engine manages and is run by no DistributedDataParallel. Touches: the module (read only),
`_wrap.refuse_changed`, `_ddp.refuse_wrapped`, `_inplace.InPlaceWrites` (what was written in
place before a pass or step goes into the master weights).
"""

from __future__ import annotations

import enum
from typing import Callable

import torch
from torch import nn

from . import _ddp, _wrap
from ._inplace import InPlaceWrites


class EngineState(enum.Enum):
    OPEN = "open"
    REFUSING = "refusing"  # training would be silently wrong (a step or load failed part-way)
    CLOSED = "closed"


class Lifecycle:
    """One engine's state: closed until `open`, refusing after `refuse` until `restore`."""

    def __init__(self):
        self.state = EngineState.CLOSED
        self.why: str | None = None  # what to do, while REFUSING

    @property
    def closed(self) -> bool:
        return self.state is EngineState.CLOSED

    def open(self) -> None:
        self.state = EngineState.OPEN

    def refuse(self, why: str) -> None:
        """Refuse to train (``why`` says what to do) until a checkpoint loads (`restore`)."""
        if self.state is not EngineState.CLOSED:
            self.state, self.why = EngineState.REFUSING, why

    def restore(self) -> None:
        """A checkpoint loaded whole: training may go on."""
        if self.state is EngineState.REFUSING:
            self.state, self.why = EngineState.OPEN, None

    def close(self) -> bool:
        """Closed from here; whether it was not before (the caller then closes what it holds)."""
        was = self.state is not EngineState.CLOSED
        self.state = EngineState.CLOSED
        return was

    def check_open(self) -> None:
        if self.state is EngineState.CLOSED:
            raise RuntimeError("this infinity engine is closed")

    def check_usable(self) -> None:
        self.check_open()
        if self.state is EngineState.REFUSING:
            raise RuntimeError(self.why)


# The engine clips the step's whole gradient once, at the step (its gradients are in the tiers,
# not in .grad): a clip between micro-batches, which plain PyTorch applies to the sum so far
# before the next micro-batch adds its own unclipped, would have clipped the whole instead
# (2e-3 off plain AdamW in 4 micro-batches; an audit helper's repro). Refused before anything changes.
CLIP_THEN_BACKWARD = (
    "a forward with gradients enabled after clip_grad_norm_ (torch.nn.utils', accelerate's or the engine's) "
    "and before the step: plain PyTorch clips the gradients summed so far and adds the next micro-batch's "
    "unclipped, while the engine clips the step's whole gradient once, at step(); clip once a step, after "
    "the last micro-batch's backward (accelerate: under `if accelerator.sync_gradients:`), or call "
    "engine.zero_grad() to drop this step's gradients and the clip"
)


class TrainingGuard:
    """Before each forward and step: the engine usable (``lifecycle``), ``module`` still
    holding only the parameters the engine manages, each as trainable as it was and of the
    dtype it was (``managed``: their ids, requires_grad and dtype at initialize; peft applied to
    engine.module would train nothing, a parameter frozen after it would still move, one cast
    would be dropped or train apart), run by no DistributedDataParallel ([Note: no DDP
    around the engine] in `_ddp`); what was written in place into bound parameters carried
    into the master weights (``writes``: [Note: in-place writes to bound parameters]).

    The walk over the module runs at a step only when no forward passed it since the last
    step: a parameter added after that forward had no part in it, and the next forward
    refuses it. A forward for backward after a clip asked this step is refused: see
    `CLIP_THEN_BACKWARD`."""

    def __init__(self, lifecycle: Lifecycle, module: nn.Module, managed: dict[int, tuple[bool, torch.dtype]],
                 rebind: Callable[[], None], writes: InPlaceWrites, clip_asked: Callable[[], object] | None = None):
        self.lifecycle = lifecycle
        self.module = module
        self.managed = managed
        self.rebind = rebind  # points the bound parameters at the engine's memory again (after a cast)
        self.writes = writes  # in-place writes to bound parameters, carried into the masters
        self.clip_asked = clip_asked  # the clip asked of the next step (`Engine.clip_grad_norm_`), or None
        self._walked = False  # a forward's check passed since the last step

    def before_forward(self) -> None:
        if self.clip_asked is not None and torch.is_grad_enabled() and self.clip_asked() is not None:
            raise RuntimeError(CLIP_THEN_BACKWARD)
        self._walked = False
        grad = torch.is_grad_enabled()
        self._check(walk=True, requires_grad=grad)
        self._walked = grad  # (one without grad compared no requires_grad: the step walks again)

    def before_step(self) -> None:
        self._check(walk=not self._walked)
        self._walked = False

    def _check(self, walk: bool, requires_grad: bool = True) -> None:
        self.lifecycle.check_usable()
        if walk:
            try:
                _wrap.refuse_changed(self.module, self.managed, requires_grad=requires_grad)
            except _wrap.ParameterCast:
                self.rebind()  # the cast made copies: the parameters are the engine's again, as the refusal says
                raise
        _ddp.refuse_wrapped(self.module)
        self.writes.carry()  # [Note: in-place writes to bound parameters] in `_inplace`
