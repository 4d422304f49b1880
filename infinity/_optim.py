"""The optimizer step: AdamW on fp32 master weights where the optimizer states live.

Owns: the sub-groups, the optimizer-state stores, the per-unit step counts, the read-ahead, and
the write-behind of the new low-precision parameters. Touches: the grads (to read them and their
norm), the params store (to write the new parameters), ``dist`` at stages 1 and 2 (to gather
them).

States (master, exp_avg, exp_avg_sq) are kept per sub-group: consecutive units whose fp32
state fits ``optimizer.sub_group_size`` bytes, stored as one flat tensor per kind, so NVMe sees
a few large transfers rather than many small ones. The step streams the sub-groups
(`_store.stream_together`): on nvme group i+1 is read and i-1 written back while AdamW runs on
i, with torch's fused CPU kernel (``torch._fused_adamw_``, about 2.2 G params/s here), and each
unit's new low-precision parameters are written to the params tier as they are made.

Semantics follow ``torch.optim.AdamW``: a parameter without a gradient this step is left alone
(no decay, no moment update), and each keeps its own step count.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from infinity.swap import WriteBehind

from ._grads import GradAccumulator
from ._store import Store, stream_together
from ._units import ParamUnit

KINDS = ("master", "exp_avg", "exp_avg_sq")
READ_AHEAD = 3  # sub-groups; see AdamW.fit_read_ahead


class SubGroup:
    def __init__(self, index: int, units: list[ParamUnit]):
        self.index = index
        self.name = f"optimizer.{index}"
        self.units = units
        self.slices: dict[int, slice] = {}
        pos = 0
        for u in units:
            n = u.shard_numel
            self.slices[u.index] = slice(pos, pos + n)
            pos += n
        self.numel = pos


def make_groups(units: list[ParamUnit], sub_group_bytes: int) -> list[SubGroup]:
    groups, current, size = [], [], 0
    for u in units:
        nbytes = 3 * 4 * u.shard_numel
        if current and size + nbytes > sub_group_bytes:
            groups.append(SubGroup(len(groups), current))
            current, size = [], 0
        current.append(u)
        size += nbytes
    if current:
        groups.append(SubGroup(len(groups), current))
    return groups


class AdamW:
    def __init__(self, units, groups, states: dict[str, Store], param_store: Store, grads: GradAccumulator,
                 config, param_dtype: torch.dtype, device: torch.device, dist=None,
                 params_sharded: bool = True):  # fmt: skip
        self.units = units
        self.groups = groups
        self.states = states  # kind -> Store, all in the optimizer tier
        self.param_store = param_store
        self.grads = grads
        self.cfg = config
        self.param_dtype = param_dtype
        self.device = states["master"].device
        self.dist = dist
        # ZeRO stages 1 and 2 keep whole parameters on every rank: new shards are gathered.
        self.gather_params = not params_sharded and dist is not None and dist.active
        self.steps = {u.index: torch.zeros((), dtype=torch.float32, device=self.device) for u in units}
        self.ahead = READ_AHEAD
        self._param_writes = WriteBehind(2)  # new parameters, each from its own pool copy

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The optimizer's small state: each unit's step count (fp32, in unit order). The
        master weights and moments are per sub-group in ``states`` and are streamed, not here."""
        return {"steps": torch.stack([self.steps[u.index].detach().to("cpu", torch.float32) for u in self.units])}

    def load_state_dict(self, state: dict) -> None:
        steps = state["steps"]
        if steps.numel() != len(self.units):
            raise ValueError(f"optimizer state has {steps.numel()} step counts, this model has {len(self.units)} units")
        for u in self.units:
            self.steps[u.index].fill_(float(steps[u.index]))

    def init_state(self, load=None) -> None:
        """Master weights from the parameters' values as the user made them (``load(param)``
        for those `build` already stored), moments zero; and each unit's low-precision
        parameters into the params tier. One sub-group is in memory at a time."""
        for g in self.groups:
            flats = []
            for u in g.units:
                whole = u.flat(torch.float32, load)
                flat = whole[u.shard]
                kept = flat if not self.gather_params else whole  # see [Note: unit partition]
                self.param_store.put(u.name, kept.to(self.param_dtype, copy=True)).result()
                flats.append(flat)
            master = torch.cat(flats)
            del flats
            for kind, value in (("master", master), ("exp_avg", torch.zeros_like(master)),
                                ("exp_avg_sq", torch.zeros_like(master))):  # fmt: skip
                self.states[kind].put(g.name, value).result()

    # -- the step ---------------------------------------------------------------------------
    def step(self, loss_scale: float = 1.0) -> bool:
        """One AdamW step over every unit with a gradient; False when skipped (fp16 overflow)."""
        self.grads.flush()
        if not self.grads.all_finite():
            return False
        divide = loss_scale  # gradients are stored multiplied by the loss scale
        if self.cfg.max_grad_norm is not None:
            norm = self.grads.global_norm() / loss_scale
            coef = min(1.0, self.cfg.max_grad_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
            divide = loss_scale / coef
        grad_scale = None if divide == 1.0 else torch.tensor(divide, dtype=torch.float32, device=self.device)
        grads_now = grads_next = None
        try:
            # The next sub-group's gradients are read while this one is updated.
            grads_next = self._read_grads(self.groups[0]) if self.groups else None
            stores = [self.states[k] for k in KINDS]
            items = stream_together(stores, [g.name for g in self.groups], ahead=self.ahead)
            # Iterate the stream itself (not a zip with the groups, which would stop without
            # resuming the generator after its last item, and so skip that item's write-back).
            for i, item in enumerate(items):
                group, grads_now = self.groups[i], grads_next
                grads_next = self._read_grads(self.groups[i + 1]) if i + 1 < len(self.groups) else None
                with record_function("infinity::optimizer.subgroup"):
                    item.write_back = self._update(group, *item.tensors, grad_scale, grads_now)
        except BaseException:
            # Every buffer goes back; the first error is the one raised.
            for pending in (*(grads_now or {}).values(), *(grads_next or {}).values()):
                try:
                    pending.result().release()
                except Exception:  # noqa: BLE001 - a read that failed holds nothing
                    pass
            self._param_writes.discard_errors()
            raise
        self._param_writes.drain()
        return True

    def _read_grads(self, group: SubGroup) -> dict:
        """Issue the reads of ``group``'s gradients (unit index -> store Pending of a lease)."""
        return {u.index: self.grads.store.get(u.name) for u in group.units if u.index in self.grads.has_grad}

    def _update(self, group: SubGroup, master, exp_avg, exp_avg_sq, grad_scale, pending: dict) -> bool:
        """AdamW on ``group``'s units that have a gradient; False when none has (nothing changed)."""
        have = [u for u in group.units if u.index in pending]
        if not have:
            return False
        grads, leases = [], []
        try:
            for u in have:
                lease = pending[u.index].result()
                leases.append(lease)
                value = lease.tensor
                if value.numel() != u.shard_numel:  # stage 1 keeps the whole gradient
                    value = value[u.shard]
                grads.append(value if value.device == master.device else value.to(master.device))
            sl = [group.slices[u.index] for u in have]
            steps = [self.steps[u.index] for u in have]
            torch._foreach_add_(steps, 1.0)
            beta1, beta2 = self.cfg.betas
            torch._fused_adamw_(
                [master[s] for s in sl], grads, [exp_avg[s] for s in sl], [exp_avg_sq[s] for s in sl], [], steps,
                lr=self.cfg.lr, beta1=beta1, beta2=beta2, weight_decay=self.cfg.weight_decay, eps=self.cfg.eps,
                amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=None,
            )  # fmt: skip
        finally:
            for lease in leases:
                lease.release()
        for u, s in zip(have, sl):
            if self.gather_params:
                self._gather_new_params(u, master[s])
            else:
                # A copy (even in fp32): master is a stream buffer that may be reused before
                # this write is done.
                self._param_writes.add(self.param_store.put(u.name, master[s], copy=True))
        return True

    def _gather_new_params(self, unit: ParamUnit, master: torch.Tensor) -> None:
        """Stages 1 and 2: every rank updated its slice; all gather the whole parameters."""
        shard = master.to(self.param_dtype, copy=True)
        lease = self.param_store.writable(unit.name)
        full = lease.tensor
        with record_function("infinity::gather"):
            try:
                self.dist.all_gather(full, shard.to(full.device), f"parameter gather of {unit.name}")
                pending = self.param_store.put(unit.name, full)
            except BaseException:
                lease.release()
                raise
        self._param_writes.add(pending, lease)

    # -- host memory ------------------------------------------------------------------------
    def host_bytes_needed(self) -> int:
        """Pool bytes the step holds at most: the stream's sub-groups (``ahead`` read ahead,
        one in hand, one written behind), the gradients of one sub-group and the next one's,
        and three parameter write-behinds; each only where its store uses the pool."""
        largest = max(g.numel for g in self.groups)
        need = 0
        if self.states["master"].uses_pool:
            need += (self.ahead + 2) * 3 * 4 * largest
        if self.grads.store.uses_pool:
            need += 2 * 4 * largest
        if self.param_store.uses_pool:
            need += 3 * self.param_dtype.itemsize * max(u.shard_numel for u in self.units)
        return need

    def fit_read_ahead(self, budget: int) -> int:
        """Read as many sub-groups ahead as ``budget`` allows, from `READ_AHEAD` (3 measured
        best here: step time over the I/O floor 1.3 at 1, 1.2 at 2, 1.0-1.1 at 3;
        benchmarks/engine_bench.py) down to 1; returns the pool bytes the step then needs."""
        for ahead in range(READ_AHEAD, 0, -1):
            self.ahead = ahead
            if self.host_bytes_needed() <= budget:
                break
        return self.host_bytes_needed()
