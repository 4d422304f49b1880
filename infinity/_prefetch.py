"""The prefetcher: the predicted order of modules, the reads issued ahead along it, and the
units kept bound after forward for backward.

Owns: the order each pass is predicted to run ([Note: predicted order] in `_schedule`), this
pass's trace of it, how far ahead reads are issued (``prefetch.depth`` modules, at most
``prefetch.bytes``), and which units stay bound after their forward for backward under
``memory.device_budget`` and the pool's room ([Note: kept for backward] in `_schedule`).
Touches: units only through `_runtime.UnitRuntime` (a read started, a unit released), which
holds the kept units themselves (`_runtime.Kept`).
"""

from __future__ import annotations

from torch import nn

from . import _tiled
from ._runtime import UnitRuntime
from ._units import ParamUnit, UnitState


class _Order:
    """A predicted sequence of modules and how far a pass has followed it."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self.pos = 0
        self.valid = True

    def advance(self, module: nn.Module) -> int | None:
        """The position of ``module`` if it is the predicted next one, else None (and stop)."""
        if self.valid and self.pos < len(self.modules) and self.modules[self.pos] is module:
            self.pos += 1
            return self.pos - 1
        self.valid = False
        return None


class Prefetcher:
    """Issues reads ahead along the predicted order and keeps units bound for backward."""

    def __init__(self, runtime: UnitRuntime, module_units: dict[nn.Module, list[ParamUnit]],
                 tiled: dict[nn.Module, list[ParamUnit]], *, depth: int, prefetch_bytes: int | None,
                 keep: bool, keep_limit: int, device_budget: int | None):  # fmt: skip
        self.runtime = runtime
        self.module_units = module_units
        self.tiled = tiled
        self.depth = depth
        self.prefetch_bytes = prefetch_bytes
        self._itemsize = runtime.transport.dtype.itemsize
        self.forward_order = _Order(list(module_units))  # registration order: see [Note: predicted order]
        self.backward_order = _Order([])
        self._trace: list[nn.Module] = []
        # The order each pass's root module ran last: a model trained through its methods or a
        # backbone then its head runs passes of several roots in turn ([Note: passes begun by a
        # submodule] in `_schedule`), each predicted from its own last run.
        self._orders: dict[nn.Module, _Order] = {}
        self._root: nn.Module | None = None
        self._since_backward: list[nn.Module] = []  # every grad-enabled pass's modules since the last backward
        # Units kept bound after forward for backward, in the order forward left them: at most
        # ``device_budget`` bytes of them (None: no bound but the pool's), and with the compute
        # on the host (the pool buffer is the parameters) while the pool holds at most
        # ``keep_limit`` bytes. See [Note: kept for backward].
        on_host = runtime.device.type == "cpu"
        self.keep_limit = keep_limit if on_host else None
        self.device_budget = device_budget
        self.keep = (keep and not runtime.always_ready and device_budget != 0
                     and (keep_limit > 0 if on_host else device_budget is not None))  # fmt: skip

    # -- the orders -------------------------------------------------------------------------
    def begin_forward(self, root: nn.Module) -> None:
        self._trace, self._root = [], root
        if root in self._orders:
            self.forward_order = self._orders[root]
        self.forward_order.pos, self.forward_order.valid = 0, True
        self._prefetch(self.forward_order, 0)

    def forward_arrived(self, module: nn.Module) -> int | None:
        """``module``'s forward begins: traced; its position if it is the predicted one."""
        self._trace.append(module)
        return self.forward_order.advance(module)

    def backward_arrived(self, module: nn.Module) -> int | None:
        """``module``'s backward begins: its position if it is the predicted one."""
        return self.backward_order.advance(module) if self.backward_order.valid else None

    def ahead(self, pos: int | None, backward: bool = False) -> None:
        """Reads for the modules after position ``pos`` of the pass's order (none where the
        pass left the prediction)."""
        if pos is not None:
            self._prefetch(self.backward_order if backward else self.forward_order, pos + 1)

    def end_forward(self, backward_due: bool) -> None:
        """The forward ended: the next one predicted to run as this one did; where a backward
        is due, it is predicted to run this one in reverse, and its first reads issued."""
        if self._trace != self.forward_order.modules:
            self.forward_order = _Order(list(self._trace))
        self._orders[self._root] = self.forward_order
        if backward_due:
            # Backward runs the passes since the last one in reverse: the last pass's modules first.
            since = self._since_backward
            since.extend(self._trace)
            del since[: max(0, len(since) - 4 * len(self.module_units))]  # passes whose backward never came
            self.backward_order = _Order(list(reversed(since)))
            self._prefetch(self.backward_order, 0)

    def end_backward(self) -> None:
        self.backward_order = _Order([])
        self._since_backward = []

    def _prefetch(self, order: _Order, start: int) -> None:
        if self.runtime.always_ready or not order.valid:
            return
        budget = self.prefetch_bytes
        for module in order.modules[start : start + self.depth]:
            units = self.module_units.get(module, ())
            if module in self.tiled:
                units = _tiled.ahead(module, units, backward=order is self.backward_order)
            for unit in units:
                if unit.state is UnitState.RELEASED:
                    if budget is not None:
                        budget -= unit.padded_numel * self._itemsize
                        if budget < 0:  # prefetch.bytes: whichever limit comes first
                            return
                    if not self.runtime.start_fetch(unit, wait=False):
                        return  # no free host memory now: the rest is fetched on demand

    # -- kept for backward ------------------------------------------------------------------
    def after_forward(self, unit: ParamUnit) -> None:
        """``unit``'s module's forward ended: kept for backward if backward will use it and
        memory allows, else released (a tile was kept or not by its module's own forward:
        `_tiled`)."""
        if unit.is_tile:
            kept = unit in self.runtime.kept
        else:
            kept = unit.uses > 0 and self.keep_for_backward(unit)
        if not kept:
            self.runtime.release(unit, after_forward=True)

    def keep_for_backward(self, unit: ParamUnit) -> bool:
        """Keep ``unit`` bound after its forward for backward, giving back the units kept
        longest while they hold more than `device_budget` or the pool more than `keep_limit`
        ([Note: kept for backward])."""
        if not self.keep or unit.active > 0 or unit.state is not UnitState.READY:
            return False
        if self.keep_limit is not None and unit.lease is None:
            return False  # on the host, a unit not in a pool buffer (none to keep it in)
        kept = self.runtime.kept
        kept.add(unit)  # the newest: needed first in backward
        while kept and self._over_keep():
            self._let_go(kept.oldest())
        return unit in kept

    def _over_keep(self) -> bool:
        if self.device_budget is not None and self.runtime.kept.nbytes > self.device_budget:
            return True
        return self.keep_limit is not None and self.runtime.pool.in_use_bytes > self.keep_limit

    def take_kept(self, unit: ParamUnit) -> None:
        """``unit`` is in use from now (its backward began): never given back while kept."""
        if self.runtime.kept.discard(unit):
            for c in self.runtime.stats.both():
                c.kept_for_backward += 1

    def _let_go(self, unit: ParamUnit) -> None:
        """Release a kept unit: backward reads it again."""
        self.runtime.kept.discard(unit)
        self.runtime.release(unit, after_forward=True)

    def give_back_kept(self) -> None:
        """The pool is full: release every unit kept for a backward that has not reached it
        in a pool buffer (on a GPU, kept units hold device memory: none is in the pool)."""
        for unit in self.runtime.kept.units():
            if unit.lease is not None:
                self._let_go(unit)
