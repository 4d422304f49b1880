"""The backward passes since the last step: how many, whether their gradients are whole, and
when the optimizer may run under the last one.

Owns: the count of backward passes since the last step, why the accumulated gradients are not
whole (a backward that failed part-way), the one-time warning when steps follow another
number of passes than configured, and, where the engine counts the micro-batches (DeepSpeed's
semantics), which step() calls update and what backward divides the loss by. Touches: the overlap (armed for the step's last micro-batch
when the scheduler says a forward ended: a `_pass.PassListener`; told when a backward ended),
the optimizer's ``clipped_last`` (read).
"""

from __future__ import annotations

import logging

from ._pass import PassListener
from ._schedule import LOST_BACKWARD

logger = logging.getLogger("infinity")


class Accumulation(PassListener):
    """``want``: ``optimizer.gradient_accumulation_steps``; ``overlap``: the optimizer under
    backward (`_overlap`, `_overlap_host`) or None; ``optimizer``: `_optim.Optimizer`. A
    listener of the passes only where there is an overlap to arm."""

    def __init__(self, want: int, overlap, optimizer, *, counts: bool = False):
        self.want = want
        self.overlap = overlap
        self.optimizer = optimizer
        # ``counts``: optimizer.accumulation = "engine" ([Note: DeepSpeed's accumulation] in
        # `_deepspeed`): the loss is divided by ``want``, and a step is due every ``want`` calls.
        self.counts = counts
        self.calls = 0  # step() calls since the last update, where the engine counts
        self.plain_backward = False  # a backward since the last update was not engine.backward's
        self.passes = 0  # backward passes since the last step
        self.incomplete: str | None = None  # why the step's gradients are not whole
        self._told = False

    def end_forward(self, expected) -> None:
        """A forward ended; where a backward is due (``expected``: the units it brings gradients
        to), arm the overlap when this is the step's last micro-batch (and the last step did not
        clip: an early update would then likely be discarded)."""
        if expected is None:
            return
        if self.passes + 1 == self.want and not self.optimizer.clipped_last:
            self.overlap.arm(expected)
        else:
            self.overlap.disarm()

    @property
    def loss_divisor(self) -> int:
        """What backward divides the loss by: the micro-batches of a step where the engine counts."""
        return self.want if self.counts else 1

    def next_is_boundary(self) -> bool:
        """Whether the next engine.step() call updates (DeepSpeed's
        ``is_gradient_accumulation_boundary``)."""
        return not self.counts or self.calls + 1 >= self.want

    def due(self) -> bool:
        """An engine.step() call: whether it updates (always, unless the engine counts the
        micro-batches and this is not the last of a step). Where it counts, the micro-batches'
        backward must be engine.backward's, which divides the loss: a plain loss.backward()
        would make the step's gradient their sum, not their mean, silently."""
        if not self.counts:
            return True
        if self.plain_backward:
            raise RuntimeError(
                "optimizer.accumulation = \"engine\" (a DeepSpeed config): engine.step() counts the micro-batches "
                "and engine.backward(loss) divides each loss by gradient_accumulation_steps, as DeepSpeed's do, but "
                "this step's gradients came from a plain loss.backward(), which divides nothing. Call "
                "engine.backward(loss) (or, for a loop that counts the micro-batches itself, as accelerate's does, "
                "step with engine.optimizer.step() and set optimizer.accumulation = \"caller\")")  # fmt: skip
        self.calls += 1
        if self.calls < self.want:
            return False
        self.calls = 0
        return True

    def backward_ended(self, through_engine: bool = True) -> None:
        """A backward pass ended (``through_engine``: inside engine.backward)."""
        self.passes += 1
        self.plain_backward |= not through_engine
        if self.overlap is not None:
            self.overlap.backward_ended()

    def failed(self, why: str) -> None:
        """A backward failed part-way: some units have its gradient and some not. A step on
        them would train on part of a gradient, silently: refused until `reset`."""
        self.incomplete = why

    def check_whole(self, backward_lost: bool) -> None:
        """Before a step: raise when the gradients accumulated since the last step are not
        whole (``backward_lost``: a plain ``loss.backward()`` raised part-way, whose end never
        ran); say once when the step follows another number of passes than configured (the
        optimizer then runs after backward; the results are the same)."""
        if backward_lost and not self.incomplete:
            self.incomplete = LOST_BACKWARD
        if self.incomplete:
            raise RuntimeError(f"{self.incomplete}: the gradients accumulated since the last step are "
                               "incomplete; call engine.zero_grad() and run this step's micro-batches again")  # fmt: skip
        if self.overlap is not None and self.passes != self.want and not self._told:
            self._told = True
            logger.warning("optimizer.gradient_accumulation_steps = %d, but this step follows %d backward passes: "
                           "set it to the number of micro-batches per step to overlap the optimizer with the "
                           "last one's backward", self.want, self.passes)  # fmt: skip

    def stepped(self) -> None:
        self.passes = 0
        self.plain_backward = False

    def reset(self) -> None:
        """The gradients were dropped (``zero_grad``, a checkpoint loaded): the step's
        micro-batches start over, also where the engine counts them (``calls``: a redone step
        counted from where the dropped one stopped updated one micro-batch early, on part of its
        gradient, and every later step boundary was off by as many)."""
        if self.counts and self.calls:  # each time: a loop that zeroes every micro-batch never updates
            logger.warning("engine.zero_grad() dropped the gradients of %d of this step's %d micro-batches "
                           "(optimizer.accumulation = \"engine\"): the step starts over from its first micro-batch. "
                           "A DeepSpeed loop calls only engine.step(), which zeroes the gradients when it updates",
                           self.calls, self.want)  # fmt: skip
        self.calls = 0
        self.passes = 0
        self.plain_backward = False
        self.incomplete = None
