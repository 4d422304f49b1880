"""What the scheduler tells the parts that act around a pass (`PassListener`).

Owns nothing: the interface of the parts the scheduler (`_schedule.Scheduler`) tells when a
forward begins and ends and when a backward ends, given to it once at initialize (the
activation tier, `_activations.ActivationTier`; the backward passes since the last step,
`_accumulation.Accumulation`, which arms the optimizer under backward). Apart from the
scheduler so that they need not import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._units import ParamUnit


class PassListener:
    """What the scheduler tells of each pass to the parts that act around it (the activation
    tier, the backward passes' count that arms the optimizer under backward), in the order they
    were given; each overrides what it needs."""

    def begin_forward(self) -> None:
        """A grad-enabled or no-grad forward of the root begins."""

    def end_forward(self, expected: list[ParamUnit] | None) -> None:
        """The forward ended; ``expected``: where a backward is due, the units it will bring
        gradients to (None: no backward due)."""

    def end_backward(self) -> None:
        """The backward ended (or failed part-way): every gradient handed on."""
