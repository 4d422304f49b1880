"""The parts of an engine that exist before any tensor is written, and the memory plan made from them.

Owns: `lay_out` (from the module and the config: the units, the stores, the optimizer's
sub-groups and records, the transport, in a `_layout.Layout`) and `plan_memory` (the host
budget's plan and the disk's footprint from that layout, with the checks that refuse a
placement the machine cannot hold). `Engine._setup` calls both, then makes the components
that run with the plan; the estimate (`_estimate`) calls the same two and stops, so its
figures are the engine's own ([Note: estimate from the engine's own plan]).
Touches: `_units`, `_store`, `_algorithms`, `_substates`, `_onecopy`, `_transport` (made),
`_admission`, `_footprint`, `_resources` (called), `_refusals` (what `initialize` refuses first).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from . import _activations, _admission, _footprint, _onecopy, _refusals, _resources
from ._algorithms import resolve
from ._layout import Layout
from ._store import Store
from ._substates import SubGroupStates, make_groups
from ._transport import Transport
from ._units import build_units
from .config import TierConfig

logger = logging.getLogger("infinity")


@dataclasses.dataclass(frozen=True)
class Parts:
    """What `lay_out` made: the layout, and what the components made after the plan need of it."""

    layout: Layout
    module_units: dict  # module -> the units it holds parameters of (`_units.build_units`)
    tiled: dict  # module -> its tiles
    defaults: dict  # the optimizer's defaults (`_algorithms.resolve`)
    params_sharded: bool  # partition.stage 3: each rank keeps a slice of each parameter (at one rank, all of it)
    gather: bool  # whole parameters gathered from the ranks' slices (stage 3 over several ranks)


def device_of(dist) -> torch.device:
    """Where the model computes: the rank's own GPU (``dist``: `_dist.Dist`), else the host."""
    return torch.device("cuda", dist.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def lay_out(module: nn.Module, cfg: TierConfig, *, device: torch.device, dist, space, pool, stats,
            optimizer_spec=None) -> Parts:  # fmt: skip
    """Refuse what `initialize` cannot train (before anything is made), then flatten
    ``module``'s parameters into units over the ranks of ``dist`` (`_dist.Dist`), make the
    tiers' stores (in ``space`` for nvme), resolve the optimizer (``optimizer_spec``, as
    `initialize` takes it) into sub-groups and their state records, and make the transport
    (over ``pool``). Nothing is written: a model made in `infinity.build` stays on the meta
    device."""
    dtype = cfg.precision.torch_dtype
    # ZeRO stages; at world size 1 they coincide (a shard is the whole).
    params_sharded = cfg.partition.stage == 3
    grads_full = cfg.partition.stage == 1 and dist.active
    _refusals.refuse_managed(module)
    _refusals.refuse_meta_buffers(module)
    _refusals.refuse_non_float(module)
    _say_mixed_dtypes(module, dtype)
    tiers = cfg.tiers
    all_device = tiers.params == tiers.grads == tiers.optimizer == "device"
    # Nothing moves with every tier on the device: tiles would only add work.
    tile_bytes = None if all_device else cfg.memory.tile_size
    units, module_units, tiled = build_units(module, dist.world_size, dist.rank, tile_bytes)
    if not units:
        raise ValueError("the module has no parameters: there is nothing to offload or train")
    if tiled:
        logger.info("memory.tile_size=%d: %s", tile_bytes, ", ".join(
            f"{tiles[0].path} in {len(tiles)} tiles" for tiles in tiled.values()))  # fmt: skip
    param_store = Store(tiers.params, "param", device=device, space=space, stats=stats, keep_in_pool=cfg.memory.keep_params)
    grad_store = Store(tiers.grads, "grad", device=device, space=space, stats=stats)
    gather = params_sharded and dist.active
    released = (f"at partition.stage 3 with {dist.world_size} ranks each rank holds a slice of the weight between uses"
                if gather else None if param_store.in_place_on(device) else
                f"with tiers.params = {tiers.params!r} the weight is released after each use")  # fmt: skip
    _refusals.refuse_modules(module, released=released)
    params = list({id(p): p for u in units for p in u.params}.values())  # a tiled one is in each tile
    algorithm, param_groups, defaults, foreign = resolve(optimizer_spec, params, cfg.optimizer, all_device=all_device)
    states = {k: Store(tiers.optimizer, k, device=device, space=space, stats=stats) for k in algorithm.kind_names}
    trainable = [u for u in units if u.trainable]  # frozen units get no optimizer state
    # See [Note: one copy of the fp32 weights] in `_onecopy`.
    one_copy = _onecopy.applies(tiers.params, tiers.optimizer, dtype, not params_sharded and dist.active, algorithm)
    groups = make_groups(trainable, cfg.optimizer.sub_group_size, algorithm, align=_onecopy.ALIGN if one_copy else 1)
    if one_copy:
        states["master"] = _onecopy.MasterView(param_store, groups, stats)
    transport = Transport(device, dtype, pool, dist, stats)
    substates = SubGroupStates(algorithm, param_groups, units=units, groups=groups, stores=states,
                               param_store=param_store, param_dtype=dtype, dist=dist,
                               params_sharded=params_sharded, foreign=foreign, one_copy=one_copy)  # fmt: skip
    layout = Layout(units, device, dtype, param_store, grad_store, substates, transport, space, dist, grads_full)
    return Parts(layout, module_units, tiled, defaults, params_sharded, gather)


def plan_memory(cfg: TierConfig, layout: Layout) -> tuple[_admission.Plan, _footprint.Footprint | None]:
    """The host budget's plan ([Note: traffic classes] in `_admission`) and the disk the swap
    space takes ([Note: disk footprint]; None without one), for ``layout``. Refuses a host
    budget the pipelines cannot run in, a placement the machine's memory cannot hold (see
    `_resources`) or a state the drives cannot: called before anything is written."""
    plan = _admission.make_plan(layout, cfg, activations_in_pool=_activations.in_pool(cfg))
    units, st = layout.units, layout.states
    # State the resident tiers keep in host memory: the cpu tier, and the device tier on a
    # machine without a GPU.
    shard = sum(u.shard_numel for u in units)
    full = sum(u.padded_numel for u in units)
    kinds = {
        "params": (layout.param_store, (full if st.gather_params else shard) * layout.dtype.itemsize),
        "grads": (layout.grad_store, (full if layout.grads_full else shard) * 4),
        "optimizer": (st.stores["master"], sum(g.record.state_bytes(st.kinds) for g in st.groups)),
    }
    host = torch.device("cpu")
    resident = {k: n for k, (store, n) in kinds.items() if store.in_place_on(host)}
    _resources.check_host_memory(resident, max(plan.needs.values()))
    footprint = _footprint.fit(layout, cfg, plan) if layout.space is not None else None
    _admission.finish(plan, layout, footprint)
    return plan, footprint


def _say_mixed_dtypes(module: nn.Module, dtype: torch.dtype) -> None:
    """Say which parameters a low ``precision.param_dtype`` casts where the model kept them in
    another float dtype beside parameters of that one: transformers' ``from_pretrained(...,
    dtype=torch.bfloat16)`` keeps a model's ``_keep_in_fp32_modules`` (T5's ``wo``) in fp32, and
    the engine runs every parameter in ``param_dtype``, as DeepSpeed's bf16 does, which no error
    would show (an audit helper found it silent). With ``fp32`` the same holds of parameters the
    model holds in another float dtype (a bf16 submodule, a float64 one): cast to fp32, saying
    nothing, they trained otherwise than plain PyTorch (an audit helper's repro)."""
    params = [(n, p) for n, p in module.named_parameters() if p.is_floating_point()]
    kept = list(getattr(module, "_keep_in_fp32_modules", None) or ())
    if dtype == torch.float32:
        other = [n for n, p in params if p.dtype != dtype]
        if other:
            logger.warning(
                "precision.param_dtype = \"fp32\" computes every parameter in float32, also the %d the model holds in "
                "another dtype (%s%s: %s); set precision.param_dtype to theirs where the model is in one dtype",
                len(other), ", ".join(repr(n) for n in other[:3]), ", ..." if len(other) > 3 else "",
                ", ".join(sorted({str(p.dtype).removeprefix("torch.") for _, p in params if p.dtype != dtype})),
            )  # fmt: skip
        return
    if any(p.dtype == dtype for _, p in params):
        other = [n for n, p in params if p.dtype != dtype]
        what = "the model holds in another dtype"
    else:  # made in one dtype (fp32, say): the cast is the config's plain meaning, but for what the model keeps
        other = [n for n, _ in params if any(k in n.split(".") for k in kept)]
        what = "of the modules the model keeps in fp32"
    if other:
        name = str(dtype).removeprefix("torch.")
        logger.warning(
            "precision.param_dtype computes every parameter in %s, as DeepSpeed's bf16 and fp16 do, also the %d %s "
            "(%s%s)%s; precision.param_dtype = \"fp32\" keeps them in fp32", name, len(other), what,
            ", ".join(repr(n) for n in other[:3]), ", ..." if len(other) > 3 else "",
            f"; transformers keeps the model's _keep_in_fp32_modules {sorted(kept)} in fp32" if kept else "",
        )  # fmt: skip
