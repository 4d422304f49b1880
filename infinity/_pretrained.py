"""Hugging Face checkpoint directories in and out, streamed: never the whole model in memory.

Owns: the directory layout transformers reads and writes (``config.json``,
``generation_config.json``, ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``), the shard plan, and the key checks of a load. Touches: the
engine's streamed writer (`_export.write_files`), `Optimizer.load_master` (weights into the
tiers one sub-group at a time), safetensors' lazy ``safe_open`` (one tensor at a time).
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch

from infinity.swap import fsync_dir, write_bytes_atomic

from . import _resources
from ._export import _entries, _Layout, write_files
from ._optim import Piece

logger = logging.getLogger("infinity")

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([KMGT]?i?B)?", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def shard_bytes(size) -> int:
    """``max_shard_size`` as transformers reads it: an int (bytes), or "2GB" (10^9) / "2GiB" (2^30)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = _SIZE.fullmatch(str(size).strip())
    if not m:
        raise ValueError(f"max_shard_size={size!r} is not a size such as 2GB, 500MB or 1GiB")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()]
    if value < 1:
        raise ValueError(f"max_shard_size={size!r} must be at least one byte")
    return int(value)


# -- out ----------------------------------------------------------------------------------------
def save_pretrained(engine, directory, max_shard_size="2GB") -> str:
    """See `Engine.save_pretrained`."""
    directory = os.path.abspath(os.fspath(directory))
    limit = shard_bytes(max_shard_size)
    entries = _entries(engine)
    shards: list[list] = []
    size = 0
    for e in entries:  # in state_dict order; a tensor larger than the limit gets a shard of its own
        if not shards or (size + e.nbytes > limit and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                for i in range(len(shards))]  # fmt: skip
    error = None
    if engine.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            error = e
    engine.dist.agree_on_outcome(error, f"making {directory}")
    module = engine.module

    def configs():
        for attr, name in (("config", "config.json"), ("generation_config", "generation_config.json")):
            cfg = getattr(module, attr, None)
            if cfg is not None and hasattr(cfg, "to_json_string"):
                write_bytes_atomic(os.path.join(directory, name), cfg.to_json_string().encode())

    files = [(os.path.join(directory, n), _Layout(shard)) for n, shard in zip(names, shards)]
    write_files(engine, files, f"save_pretrained to {directory}", done=f"saved {directory}", before_commit=configs)
    if engine.rank == 0:
        # The index comes last: with it, a sharded set is whole. Files of an older save that the
        # new one does not have go (as transformers does).
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                     "weight_map": {e.key: n for n, shard in zip(names, shards) for e in shard}}  # fmt: skip
            write_bytes_atomic(os.path.join(directory, INDEX), json.dumps(index, indent=2).encode())
        for entry in os.listdir(directory):
            stale = (entry == INDEX and len(shards) == 1) or (
                (entry == SINGLE or _SHARD.fullmatch(entry)) and entry not in names
            )
            if stale:
                os.unlink(os.path.join(directory, entry))
        fsync_dir(directory)
    return directory


# -- in -----------------------------------------------------------------------------------------
def checkpoint_files(path: str) -> dict[str, str]:
    """key -> the safetensors file that holds it, from ``path``'s index or single file."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index with a weight_map ({e})") from None
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX}: not a Hugging Face safetensors checkpoint")


def from_pretrained(model_cls, path, config=None, *, optimizer=None, lr_scheduler=None, wrap=None, **model_kwargs):
    """An engine training ``model_cls`` (a transformers model class) with the weights of the
    Hugging Face checkpoint directory ``path`` (``config.json`` and ``model.safetensors``, or
    shards with ``model.safetensors.index.json``; bf16, fp16 or fp32), streamed into the tiers
    of ``config`` one tensor at a time (safetensors' lazy ``safe_open``): the model is built
    with `infinity.build` and never whole in memory. ``optimizer``, ``lr_scheduler``: as
    `infinity.initialize` takes them; ``model_kwargs`` go to ``model_cls``'s constructor.

    ``wrap``: a callable taking the built model and returning the model to train, such as
    ``lambda m: peft.get_peft_model(m, lora_config)``; ``engine.module`` is what it returns. The
    base streams in from the checkpoint under the names it had before wrapping; what the wrapper
    adds keeps the wrapper's own initialisation (see [Note: wrapping a built model] in
    `_wrap`)."""
    import infinity

    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json: not a Hugging Face checkpoint directory")
    files = checkpoint_files(path)
    hf_config = model_cls.config_class.from_pretrained(path)
    from ._build import build

    with build(config, init=False):  # the checkpoint gives every value: no initialisation to run
        model = model_cls(hf_config, **model_kwargs)
    names = None
    if wrap is not None:
        from . import _wrap

        model, names = _wrap.apply(model, wrap)
    engine = infinity.initialize(model, config, optimizer=optimizer, lr_scheduler=lr_scheduler)
    try:
        engine.pretrained_bytes_read = load_weights(engine, files, path, names=names)
        engine._stats.start_step()  # the load counts in stats()["total"], not in the first step
    except BaseException:
        engine.close()
        raise
    logger.info("%s: %.1f MB read into the tiers (rank %d)", path, engine.pretrained_bytes_read / 1e6, engine.rank)
    return engine


def load_weights(engine, files: dict[str, str], where: str, names: dict[str, str] | None = None) -> None:
    """Stream the checkpoint's tensors into the engine's tiers, one optimizer sub-group (or
    frozen unit) at a time; buffers into the module; return the bytes of parameters read.
    Keys are checked first: a mis-shaped or missing parameter is an error naming every such
    key; an unexpected key is a warning. ``names``: a wrapped model's key -> the checkpoint's,
    for what the model had before wrapping; the rest is the wrapper's, not loaded."""
    from safetensors import safe_open

    params = engine.parameter_keys()  # key -> [(unit, index)]: a tiled one's tiles
    buffers = {k: v for k, v in engine.module.state_dict(keep_vars=True).items() if k not in params}
    if names is not None:  # see [Note: wrapping a built model] in _wrap
        params = {names[k]: v for k, v in params.items() if k in names}
        buffers = {names[k]: v for k, v in buffers.items() if k in names}
    handles = {}

    def tensor(key, full=True):
        file = files[key]
        if file not in handles:
            handles[file] = safe_open(file, framework="pt")
        return handles[file].get_tensor(key) if full else handles[file].get_slice(key)

    shapes = {k: tuple(tensor(k, full=False).get_shape()) for k in params if k in files}  # headers only
    here = {k: unit.full_shapes[i] for k, [(unit, i), *_] in params.items()}  # the whole parameter's shape
    bad = [f"{k}: {list(shape)} in the checkpoint, {list(here[k])} here" for k, shape in shapes.items()
           if shape != here[k]]  # fmt: skip
    if bad:
        raise ValueError(f"{where}: mis-shaped tensors: " + "; ".join(bad))
    loaded = {(u.index, i) for k in params if k in files for u, i in params[k]}  # (unit, index): a tied one once
    missing = sorted(k for k, pieces in params.items() if any((u.index, i) not in loaded for u, i in pieces))
    if missing:
        raise ValueError(f"{where}: missing from the checkpoint: {', '.join(missing)}")
    unexpected = sorted(k for k in files if k not in params and k not in buffers)
    if unexpected:
        logger.warning("%s: keys the model does not have, not loaded: %s", where, ", ".join(unexpected))
    by_unit: dict[int, list[str]] = {}
    for k, pieces in params.items():
        if k in files:
            for u, i in pieces:
                by_unit.setdefault(u.index, []).append((k, i))
    opt = engine.optimizer
    # Stage 3 with several ranks: each rank reads only the rows that hold its slice of each
    # parameter (bandwidth-centric, as the engine's own reads are).
    sliced = engine.params_sharded and engine.dist.active
    read = 0
    batches = [g.units for g in opt.groups] + [[u] for u in opt.frozen]
    trim = _resources.TrimEvery()
    with torch.no_grad():
        for units in batches:  # one sub-group's tensors in memory at a time
            values = {}
            for u in units:
                for k, i in by_unit.get(u.index, ()):
                    if (u.index, i) in values:
                        continue  # a tied parameter: read once
                    if (sliced or u.is_tile) and u.shapes[i]:  # only the rows it needs
                        values[(u.index, i)] = _mine(tensor(k, full=False), u, i, sliced)
                    else:
                        values[(u.index, i)] = tensor(k)
                    t = values[(u.index, i)]
                    t = t.tensor if isinstance(t, Piece) else t
                    read += t.numel() * t.element_size()
            if values:
                engine.load_weights(values)
            del values
            # safe_open maps the file, and the pages read stay in this process's RSS while it is
            # open: closed per batch, the load holds one batch's pages, not the whole checkpoint.
            handles.clear()
            trim.add(16 * sum(u.numel for u in units))  # see [Note: malloc threshold] in _resources
        for k, buf in buffers.items():
            if k in files:
                buf.copy_(tensor(k))
    return read


def _mine(view, unit, i: int, sliced: bool):
    """The rows of parameter ``i`` that ``unit`` holds (a tile: its rows), only those holding
    this rank's slice of the unit when ``sliced``, as a `Piece` (a safetensors slice ``view``
    reads only what is indexed)."""
    off, n, shape, start = unit.offsets[i], unit.numels[i], unit.shapes[i], unit.starts[i]
    a, b = (max(off, unit.shard.start) - off, min(off + n, unit.shard.stop) - off) if sliced else (0, n)
    if a >= b:  # none of it is this rank's
        return Piece(0, torch.empty(0))
    row = n // shape[0] if shape[0] else 1  # elements per index of the first dimension
    first, last = a // row, -(-b // row)  # rows of the unit's part
    top = start // row  # the part's first row in the parameter
    return Piece(start + first * row, view[top + first : top + last])
