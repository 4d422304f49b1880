"""A checkpoint's weights, consolidated offline: no engine, no GPU, no model code.

Owns: the ``state_dict`` entry of a checkpoint's meta.json (what `Engine.export` would write
under each key), and `CheckpointWeights`, which reads a checkpoint's units one at a time and
stands in for the engine where the export's writers read weights. Touches: the checkpoint's
readers (`_saved.Sources`: every saved rank's slice, checked against its checksum) and
the writers (`_export.export_safetensors`, `_hf_save.save_pretrained`), reused as they are.

[Note: consolidated checkpoint]
A checkpoint holds every unit's fp32 master weights (frozen units: their parameters, in the
saving run's ``param_dtype``), sliced over the saving ranks, and meta.json names the units'
parameters and shapes. `Engine.export` writes more than that: every key of the module's
``state_dict()`` in its order (a tied parameter under each of its keys), each parameter in the
dtype the model was made in, and the persistent buffers. So save_checkpoint records, beside the
units, the module's keys: for a parameter, the qualified name of the one it is (its owner's:
the unit's module path and the parameter's name there), its full shape and its dtype; for a
persistent buffer, its dtype and shape (its values are not in the checkpoint). Consolidating
then writes what the export would, bit for bit: the masters cast to each key's dtype. A
checkpoint saved before it was recorded gets its parameters under their qualified names, in
fp32 (what the masters are, not necessarily what the model was made in); tied aliases are
then unknown, and the result says so.
"""

from __future__ import annotations

import json
import logging
import math
import os

import torch

from . import _dist
from ._saved import BUFFER_PREFIX, Sources
from ._substates import state_key
from ._units import lay_out
from .checkpoint import LATEST_NAME, CheckpointError, load_meta, resolve

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
           "uint8": torch.uint8, "bool": torch.bool}  # fmt: skip
_PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
logger = logging.getLogger("infinity")

_NONE = torch.empty(0, device="meta")  # a parameter left out (frozen, excluded): no key names it


class BuffersNotSaved(ValueError):
    """The model has persistent buffers, and a checkpoint holds no buffer values."""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def qualified(path: str, name: str) -> str:
    """A unit's parameter ``name`` as the module's ``named_parameters`` calls it."""
    return name if path == "<root>" else f"{path}.{name}"


def state_dict_layout(engine) -> list[dict] | None:
    """meta.json's ``state_dict``: the module's keys in order (see [Note: consolidated
    checkpoint]). A value that is not a tensor (extra state) is left out, as no file holds it.
    None, with a warning, where the module's state_dict cannot be listed: the checkpoint is
    saved all the same, and consolidates as one of an older version does."""
    try:
        return _layout_of(engine)
    except Exception as e:  # noqa: BLE001 - a save must not fail for what only the offline tool reads
        logger.warning("checkpoint: the module's state_dict keys are not recorded (%s: %s); infinity-consolidate "
                       "will write its parameters under their own names", type(e).__name__, e)  # fmt: skip
        return None


def _layout_of(engine) -> list[dict]:
    params: dict[int, tuple[str, tuple, torch.dtype]] = {}  # id(param) -> (qualified name, full shape, dtype)
    for u in engine.units:
        for r in u.records:
            params.setdefault(id(r.param), (qualified(u.path, r.name), r.full_shape, r.dtype))
    out = []
    for key, value in engine.module.state_dict(keep_vars=True).items():  # placeholders: gathers nothing
        if id(value) in params:
            name, shape, dtype = params[id(value)]
            out.append({"key": key, "param": name, "shape": list(shape), "dtype": _name(dtype)})
        elif isinstance(value, torch.Tensor):
            out.append({"key": key, "buffer": True, "shape": list(value.shape), "dtype": _name(value.dtype)})
    return out


class _Unit:
    """A saved unit as the writers see an engine's `ParamUnit`: its name, its size and its
    parameters' records (`_units.ParamRecord`, each parameter a placeholder), where each piece
    is in the unit's flat tensor and in the whole parameter."""

    def __init__(self, entry: dict, world: int, pieces: list[tuple[torch.Tensor, torch.dtype, tuple, int]]):
        """``pieces``: per parameter of ``entry``, (its placeholder, its dtype, the whole
        parameter's shape, where the piece begins in it)."""
        self.name, self.numel = entry["name"], entry["numel"]
        # (requires_grad False: a saved unit trains nothing; the writers read where pieces lie)
        self.records = lay_out((name, p, full_shape, shape, start, False, dtype)
                               for (name, shape), (p, dtype, full_shape, start) in zip(entry["params"], pieces))  # fmt: skip
        self.padded_numel = -(-self.numel // world) * world


class _Module:
    """What the writers ask of the model: its keys (placeholders) and its configs."""

    def __init__(self, entries: dict[str, torch.Tensor], config=None, generation_config=None):
        self._entries = entries
        self.config, self.generation_config = config, generation_config

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        return dict(self._entries)


class JsonConfig:
    """A config.json as it is (its ``to_json_string`` is the file's text): written beside the
    weights unchanged but for the dtype of the weights written (`set_dtype`), with no
    transformers needed."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, encoding="utf-8") as f:
                self.text = f.read()
            data = json.loads(self.text)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path}: not a JSON config: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a JSON config: a {type(data).__name__}, not an object")

    def to_json_string(self) -> str:
        return self.text

    def set_dtype(self, name: str) -> None:
        """Say the weights are ``name`` ("float32", ...): the text again with ``dtype`` (and
        ``torch_dtype``, where the file has it) set, as transformers' save_pretrained sets it."""
        data = json.loads(self.text)
        if data.get("dtype", data.get("torch_dtype")) == name:
            return
        data["dtype"] = name
        if "torch_dtype" in data:
            data["torch_dtype"] = name
        self.text = json.dumps(data, indent=2, sort_keys=True) + "\n"


class _Alone(_dist.Dist):
    """The one rank of an offline consolidation, whatever the environment says (a tool run
    inside a torchrun job must not join its process group): every collective is a no-op."""

    def __init__(self):
        self.timeout, self._meetings, self._met = 0, "", {}
        self.rank, self.world_size, self.local_rank, self.store = 0, 1, 0, None


class CheckpointWeights:
    """A checkpoint's weights with the engine's interface to them (``units``, ``module``,
    ``unit_weights``, ``rank``, ``dist``), so that `_export.export_safetensors` and
    `_hf_save.save_pretrained` write them as they write an engine's.

    ``dtype``: every floating-point parameter written in it, else each in the dtype the model
    was made in. Persistent buffers are written as saved (rank 0's); ``buffers``: for a
    checkpoint that holds none (version 1), "refuse" raises where the model has some, "skip"
    writes the parameters alone and names them in ``missing``. ``exclude_frozen``: leave out the parameters of frozen units."""

    rank = 0
    dist = _Alone()

    def __init__(self, path, tag: str = LATEST_NAME, *, dtype: torch.dtype | None = None, buffers: str = "refuse",
                 exclude_frozen: bool = False, config=None, generation_config=None, aio_engine=None):  # fmt: skip
        if buffers not in ("refuse", "skip"):
            raise ValueError(f"{buffers=} is not 'refuse' or 'skip'")
        self.where = resolve(path, tag)
        self.meta = load_meta(self.where)
        self.world = self.meta["world_size"]
        self.notes: list[str] = []  # what the result lacks or how it differs from an export, for the user
        self.missing: list[str] = []  # keys of the module not written (persistent buffers)
        self.on_unit = None  # called with (units done, unit) as each unit has been handed on
        self._src = Sources(self.where, self.world, aio_engine, spaces=self.meta.get("spaces"))
        try:
            self._build(dtype, buffers, exclude_frozen, config, generation_config)
        except BaseException:
            self.close()
            raise

    def _buffer(self, entry: dict) -> torch.Tensor:
        """A persistent buffer's saved values (rank 0's, in its own dtype), checked as read."""
        key, shape = entry["key"], entry.get("shape")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"{self.where}: buffers: {entry!r} is not {{key, shape, dtype}}")
        value = self._src.reader(0).read(BUFFER_PREFIX + key, verify=True)
        if value.numel() != math.prod(shape):
            raise CheckpointError(f"{self.where}: buffer {key!r} holds {value.numel()} elements, its shape {shape}")
        return value.reshape(shape)

    def _build(self, dtype, buffers, exclude_frozen, config, generation_config) -> None:
        saved = self.meta["units"]
        layout = self._layout()
        known = {e["param"]: e for e in layout or () if "param" in e}
        names = {}  # qualified name -> [full shape, dtype, elements seen so far]
        pieces = []  # per unit: the qualified names of its parameters
        for i, u in enumerate(saved):
            path = _path(u["name"], [p[0] for p in u["params"]], known)
            first_row = u["name"][len(path) + 1 :] if u["name"] != path else None  # a tile's "<module>#<row>"
            mine = []
            for p in u["params"]:
                if not (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)
                        and all(isinstance(d, int) and d >= 0 for d in p[1])):  # fmt: skip
                    raise CheckpointError(f"{self.where}: units[{i}]: parameter {p!r} is not [name, shape]")
                q = qualified(path, p[0])
                rows_before = names[q][0][0] if q in names else 0
                if first_row is not None and int(first_row) != rows_before:
                    raise CheckpointError(f"{self.where}: units[{i}] {u['name']!r} starts at row {first_row} of "
                                          f"{q!r}, and the units before it hold {rows_before} rows")  # fmt: skip
                if q in names:  # the next rows of a tiled parameter ([Note: tiles] in `_units`)
                    if not p[1] or p[1][1:] != names[q][0][1:]:
                        raise CheckpointError(f"{self.where}: units[{i}] {u['name']!r}: parameter {q!r} {p[1]} is "
                                              f"not rows of the {names[q][0]} an earlier unit holds")  # fmt: skip
                    names[q][0][0] += p[1][0]
                else:
                    names[q] = [list(p[1]), None, 0]
                mine.append(q)
            if sum(math.prod(p[1]) for p in u["params"]) != u["numel"]:
                raise CheckpointError(f"{self.where}: units[{i}] {u['name']!r}: its parameters do not hold its "
                                      f"{u['numel']} elements")  # fmt: skip
            pieces.append(mine)
        for q, (shape, _, _) in names.items():
            if q in known and known[q]["shape"] != shape:
                raise CheckpointError(f"{self.where}: parameter {q!r} is {known[q]['shape']} in state_dict, its "
                                      f"units hold {shape}")  # fmt: skip
            names[q][1] = _DTYPES[known[q]["dtype"]] if q in known else torch.float32
            if dtype is not None and names[q][1].is_floating_point:
                names[q][1] = dtype
        frozen = self._frozen(saved)
        skipped = {q for k in frozen for q in pieces[k]} if exclude_frozen else set()
        if skipped:
            self.notes.append(f"{len(skipped)} frozen parameter(s) left out (--exclude-frozen-parameters)")
        placeholders = {q: torch.empty(0, device="meta") for q in names if q not in skipped}
        entries: dict[str, torch.Tensor] = {}
        if layout is None:
            entries = dict(placeholders)
            self.notes.append(
                "this checkpoint does not list the model's state_dict keys (saved by an older infinity): the "
                "parameters are written under their own names, in float32 unless --dtype is given; tied aliases "
                "and persistent buffers, if the model has any, are not written"
            )
        else:
            saved_buffers = {b["key"]: b for b in self.meta.get("buffers") or ()}  # version 2 on
            for e in layout:
                if "param" in e:
                    if e["param"] not in names:
                        raise CheckpointError(f"{self.where}: state_dict key {e['key']!r} is parameter "
                                              f"{e['param']!r}, which no unit holds")  # fmt: skip
                    if e["param"] in placeholders:
                        entries[e["key"]] = placeholders[e["param"]]
                elif e["key"] in saved_buffers:
                    entries[e["key"]] = self._buffer(saved_buffers[e["key"]])
                else:
                    self.missing.append(e["key"])
            if self.missing and buffers == "refuse":
                raise BuffersNotSaved(
                    f"{self.where}: the model has persistent buffers whose values the checkpoint does not hold "
                    f"(saved by an older infinity, checkpoint version {self.meta['version']}): "
                    f"{', '.join(self.missing)}. Write the parameters alone (--skip-buffers: a model made from "
                    "its config then keeps the buffers it is made with), or export them from a live engine "
                    "(engine.export / engine.save_pretrained)"
                )
            if self.missing:
                self.notes.append(f"persistent buffers not written (not in the checkpoint): {', '.join(self.missing)}")
        self.module = _Module(entries, config, generation_config)
        self.units, self._kinds = [], []
        for k, (u, qs) in enumerate(zip(saved, pieces)):
            if qs and all(q in skipped for q in qs):
                continue
            numels = [math.prod(shape) for _, shape in u["params"]]
            starts = []  # where each piece begins in its whole parameter: after the rows before it
            for q, n in zip(qs, numels):
                starts.append(names[q][2])
                names[q][2] += n
            unit = _Unit(u, self.world, [(placeholders.get(q, _NONE), names[q][1], tuple(names[q][0]), start)
                                         for q, start in zip(qs, starts)])  # fmt: skip
            self.units.append(unit)
            self._kinds.append(("param", _PARAM_DTYPES[self.meta["param_dtype"]]) if k in frozen
                               else ("master", torch.float32))  # fmt: skip

    def _layout(self) -> list[dict] | None:
        layout = self.meta.get("state_dict")
        if layout is None:
            return None
        where = os.path.join(self.where, "meta.json")
        if not isinstance(layout, list):
            raise CheckpointError(f"{where}: state_dict: not a list")
        for i, e in enumerate(layout):
            ok = (isinstance(e, dict) and isinstance(e.get("key"), str) and isinstance(e.get("dtype"), str)
                  and (e.get("dtype") in _DTYPES or "param" not in e)  # a buffer's is only named
                  and isinstance(e.get("shape"), list) and all(isinstance(d, int) and d >= 0 for d in e["shape"])
                  and (isinstance(e.get("param"), str) or e.get("buffer") is True))  # fmt: skip
            if not ok:
                raise CheckpointError(f"{where}: state_dict[{i}]: {e!r} is not {{key, param or buffer, shape, dtype}}")
        return layout

    def _frozen(self, saved: list[dict]) -> set[int]:
        """The units saved without master weights: frozen (no optimizer state), their parameters
        are the weights (as `Engine.unit_weights` takes them)."""
        tensors = self._src.reader(0).manifest.tensors
        return {k for k, u in enumerate(saved) if state_key(u["name"], "master") not in tensors}

    def unit_weights(self, rank0_only: bool = False):
        """Yield ``(unit, full)`` per unit in order, as `Engine.unit_weights` does: ``full`` 1-D
        fp32 of ``unit.padded_numel``, read from every saved rank's slice (each checked against
        its checksum) and dropped before the next unit is read."""
        for k, (unit, (kind, dtype)) in enumerate(zip(self.units, self._kinds)):
            buf = torch.empty(unit.padded_numel, dtype=dtype)
            # Every slice whole (padded: the last one's tail is the zeros it was saved with).
            self._src.read(unit.name, unit.numel, kind, dtype, 0, unit.padded_numel, buf)
            full = buf if dtype == torch.float32 else buf.to(torch.float32)
            del buf
            yield unit, full
            del full
            if self.on_unit is not None:
                self.on_unit(k + 1, unit)

    def close(self) -> None:
        self._src.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _path(unit: str, params: list[str], known: dict) -> str:
    """The module path of the saved unit ``unit``: itself, or a tile's "<module>#<first row>"
    without its row; the state_dict layout, where the checkpoint has one, decides."""
    path, mark, row = unit.rpartition("#")
    if not (mark and row.isdigit()):
        return unit
    if known and params and qualified(unit, params[0]) in known:
        return unit  # a module whose own name ends in "#<digits>"
    return path


def to_state_dict(weights: CheckpointWeights) -> dict[str, torch.Tensor]:
    """Every key's tensor, whole, in memory (for ``torch.save``: the model's size in RAM): the
    parameters (tied aliases under each of their keys) and the persistent buffers as saved."""
    tensors: dict[int, torch.Tensor] = {}
    for unit, full in weights.unit_weights():
        for r in unit.records:
            if id(r.param) not in tensors:
                tensors[id(r.param)] = torch.empty(r.full_shape, dtype=r.dtype)
            tensors[id(r.param)].view(-1)[r.in_param] = full[r.in_unit]
    out = {}
    for key, p in weights.module.state_dict().items():
        if id(p) in tensors:
            out[key] = tensors[id(p)]
        elif p.device.type != "meta":  # a buffer's values (a parameter's stand-in is on meta)
            out[key] = p
    return out
