"""The optimizer step: AdamW on fp32 master weights where the optimizer states live.

States (master, exp_avg, exp_avg_sq) are kept per sub-group: consecutive units whose fp32
state fits ``optimizer.sub_group_size`` bytes, stored as one flat tensor per kind, so NVMe sees
a few large transfers rather than many small ones. On nvme the step streams the sub-groups
(`infinity.swap.stream`): group i+1 is read and i-1 written back while AdamW runs on i, with
torch's fused CPU kernel (``torch._fused_adamw_``, about 2.2 G params/s here), and each unit's
new low-precision parameters are written to the params tier as they are made.

Semantics follow ``torch.optim.AdamW``: a parameter without a gradient this step is left alone
(no decay, no moment update), and each keeps its own step count.
"""

from __future__ import annotations

import time

import torch

from infinity.swap import stream

from ._grads import GradAccumulator
from ._store import Pending, Store
from ._units import ParamUnit

KINDS = ("master", "exp_avg", "exp_avg_sq")


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
    def __init__(self, units, groups, stores: dict[str, Store], param_store: Store, grads: GradAccumulator,
                 config, param_dtype: torch.dtype, stats, device: torch.device, dist=None,
                 params_sharded: bool = True):  # fmt: skip
        self.units = units
        self.groups = groups
        self.stores = stores  # kind -> Store, all in the optimizer tier
        self.param_store = param_store
        self.grads = grads
        self.cfg = config
        self.param_dtype = param_dtype
        self.stats = stats
        self.device = stores["master"].device
        self.dist = dist
        # ZeRO stages 1 and 2 keep whole parameters on every rank: new shards are gathered.
        self.gather_params = not params_sharded and dist is not None and dist.active
        self.steps = {u.index: torch.zeros((), dtype=torch.float32, device=self.device) for u in units}
        # Sub-groups read ahead of the one being updated: 3 measured best here (step time over
        # the I/O floor 1.3 at 1, 1.2 at 2, 1.0-1.1 at 3; benchmarks/engine_bench.py). The
        # engine lowers it when the host budget cannot hold that many.
        self.ahead = 3
        self._param_writes: list[tuple[Pending, object]] = []  # (write-behind, its pool buffer)
        self.pool = param_store.space.pool if param_store.space is not None else None
        self._param_itemsize = param_dtype.itemsize

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
                self.stores[kind].put(g.name, value).result()

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
        if self.stores["master"].resident:
            for g in self.groups:
                self._update(g, *(self.stores[k].tensor(g.name) for k in KINDS), grad_scale)
        else:
            self._step_streamed(grad_scale)
        while self._param_writes:
            self._finish_param_write()
        return True

    def _step_streamed(self, grad_scale) -> None:
        store = self.stores["master"]
        names = [tuple(f"{g.name}/{k}" for k in KINDS) for g in self.groups]
        start = time.perf_counter()
        moved = 0
        # Iterate the stream itself (not a zip with the groups, which would stop without resuming
        # the generator after its last item, and so skip that item's write-back).
        grads_next = self._read_grads(self.groups[0]) if self.groups else None
        for i, item in enumerate(stream(store.space, names, ahead=self.ahead)):
            group, grads_now = self.groups[i], grads_next
            # The next sub-group's gradients are read while this one is updated (on nvme).
            grads_next = self._read_grads(self.groups[i + 1]) if i + 1 < len(self.groups) else None
            if not self._update(group, *item.tensors, grad_scale, grads=grads_now):
                item.write_back = False
            else:
                moved += 3 * 4 * group.numel
        # The stream overlaps reads and writes; its wall time is the optimizer's I/O time.
        elapsed = time.perf_counter() - start
        for c in self.stats.both():
            t = c.tiers["nvme"]
            t.read_bytes += moved
            t.write_bytes += moved
            t.read_busy.seconds += elapsed
            t.write_busy.seconds += elapsed

    def _read_grads(self, group: SubGroup) -> dict:
        """Issue the reads of ``group``'s gradients (unit index -> store Pending)."""
        return {u.index: self.grads.store.get(u.name) for u in group.units if u.index in self.grads.has_grad}

    def _update(self, group: SubGroup, master, exp_avg, exp_avg_sq, grad_scale, grads: dict | None = None) -> bool:
        pending = grads if grads is not None else self._read_grads(group)
        have = [u for u in group.units if u.index in pending]
        if not have:
            return False
        grads, leases = [], []
        for u in have:
            value = pending[u.index].result()
            if not self.grads.store.resident:
                leases.append(value)
                value = value.view(torch.float32, (u.padded_numel if self.grads.grads_full else u.shard_numel,))
            if value.numel() != u.shard_numel:  # stage 1 keeps the whole gradient
                value = value[u.shard]
            grads.append(value if value.device == master.device else value.to(master.device))
        sl = [group.slices[u.index] for u in have]
        steps = [self.steps[u.index] for u in have]
        torch._foreach_add_(steps, 1.0)
        beta1, beta2 = self.cfg.betas
        try:
            torch._fused_adamw_(
                [master[s] for s in sl], grads, [exp_avg[s] for s in sl], [exp_avg_sq[s] for s in sl], [], steps,
                lr=self.cfg.lr, beta1=beta1, beta2=beta2, weight_decay=self.cfg.weight_decay, eps=self.cfg.eps,
                amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=None,
            )  # fmt: skip
        finally:
            for lease in leases:
                lease.release()
        if self.gather_params:
            self._gather_new_params(have, sl, master)
            return True
        for u, s in zip(have, sl):
            if self.param_store.resident:  # straight into the resident parameters: one copy,
                # blocking: master is a stream buffer the pool may hand out once this returns
                self.param_store.tensor(u.name).copy_(master[s])
                continue
            # A copy even in fp32, into a pool buffer (aligned: written directly), since master
            # may be reused before this write-behind is done.
            lease = self.pool.acquire(u.shard_numel * self._param_itemsize)
            new = lease.view(self.param_dtype, (u.shard_numel,))
            new.copy_(master[s])
            self._write_param(u, new, lease)
        return True

    def _write_param(self, unit: ParamUnit, tensor: torch.Tensor, lease) -> None:
        """Write behind a unit's new parameters from ``lease``, at most 2 writes in flight."""
        self._param_writes.append((self.param_store.put(unit.name, tensor), lease))
        while len(self._param_writes) > 2:
            self._finish_param_write()

    def _gather_new_params(self, have, sl, master) -> None:
        """Stages 1 and 2: every rank updated its slice; all gather the whole parameters."""
        for u, s in zip(have, sl):
            shard = master[s].to(self.param_dtype, copy=True)
            if self.param_store.resident:
                full = self.param_store.tensor(u.name)
                self.dist.all_gather(full, shard.to(full.device), f"parameter gather of {u.name}")
                continue
            lease = self.pool.acquire(u.padded_numel * self._param_itemsize)
            full = lease.view(self.param_dtype, (u.padded_numel,))
            self.dist.all_gather(full, shard, f"parameter gather of {u.name}")
            self._write_param(u, full, lease)

    def _finish_param_write(self) -> None:
        pending, lease = self._param_writes.pop(0)
        try:
            pending.result()
        finally:
            if lease is not None:
                lease.release()

    def host_bytes_needed(self) -> int:
        """Pool bytes the step holds at most on nvme: the stream's sub-groups (``ahead`` read
        ahead, one in hand, one written behind), the gradients of one sub-group, and three
        parameter write-behinds."""
        if self.stores["master"].resident and self.grads.store.resident and self.param_store.resident:
            return 0
        largest = max(g.numel for g in self.groups)
        need = 0
        if not self.stores["master"].resident:
            need += (self.ahead + 2) * 3 * 4 * largest
        if not self.grads.store.resident:  # this sub-group's gradients and the next one's
            need += 2 * 4 * largest
        if not self.param_store.resident:
            need += 3 * self._param_itemsize * max(u.shard_numel for u in self.units)
        return need
