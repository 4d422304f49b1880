"""Hugging Face checkpoint directories in and out, streamed: never the whole model in memory.

Owns: `infinity.from_pretrained` and the key checks of a load. Touches: `_safetensors` (which
files, and the tensors one at a time), `_hf_save` (`engine.save_pretrained`: the directory
written and replaced all at once), `engine.optimizer.load_master` (weights into the tiers one
sub-group at a time).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

import torch
from torch import nn

from . import _resources, _statedict
from ._hf_save import save_pretrained  # noqa: F401 - where engine.save_pretrained imports it
from ._substates import Piece
from ._safetensors import Shards, check_dtypes, checkpoint_files

logger = logging.getLogger("infinity")


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
    model_cls = _concrete(model_cls, path)
    hf_config = model_cls.config_class.from_pretrained(path)
    from ._build import build

    dtype = _checkpoint_dtype(hf_config) or _first_float_dtype(files)
    with build(config, init=False), _default_dtype(dtype):
        # (the checkpoint gives every value: no initialisation to run) In the checkpoint's dtype,
        # as transformers' from_pretrained makes it: what export and save_pretrained write.
        model = model_cls(hf_config, **model_kwargs)
    _keep_in_fp32(model, dtype)
    if os.path.isfile(os.path.join(path, "generation_config.json")) and getattr(model, "generation_config", None):
        # As transformers' from_pretrained: the checkpoint's generation settings (its eos ids,
        # sampling), not the defaults config.json gives, which a save_pretrained then wrote over them.
        model.generation_config = type(model.generation_config).from_pretrained(path)
    model.eval()  # as transformers' from_pretrained returns it: dropout off until train()
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


def _concrete(model_cls, path: str):
    """``model_cls``, or the class an auto class (``AutoModelForCausalLM``) picks for the
    checkpoint's config, as its from_pretrained does (it failed: "no attribute 'config_class'")."""
    mapping = getattr(model_cls, "_model_mapping", None)
    if mapping is None:
        return model_cls
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    try:
        return mapping[type(hf_config)]
    except KeyError:
        raise ValueError(f"{path}: {model_cls.__name__} has no model class for a {type(hf_config).__name__} "
                         f"(model_type {getattr(hf_config, 'model_type', '?')!r})") from None


def _checkpoint_dtype(hf_config) -> torch.dtype | None:
    """The floating-point dtype ``hf_config`` names (``dtype``, ``torch_dtype`` before
    transformers 5), or None."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


_FLOATS = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _first_float_dtype(files: dict[str, str]) -> torch.dtype | None:
    """The dtype of the checkpoint's first floating-point tensor, where its config names none:
    transformers' ``dtype="auto"`` takes it so (a bf16 checkpoint whose config.json names no
    dtype was built, trained and saved in fp32, twice its size: an audit helper's repro)."""
    shards = Shards(files)
    try:
        for key in files:
            dtype = _FLOATS.get(shards.header(key)[0])
            if dtype is not None:
                return dtype
    finally:
        shards.close()
    return None


def _keep_in_fp32(model: nn.Module, dtype: torch.dtype | None) -> None:
    """The parameters transformers' from_pretrained keeps in fp32 in a model of ``dtype`` (its
    ``_keep_in_fp32_modules`` in fp16, its ``_keep_in_fp32_modules_strict`` in fp16 and bf16:
    T5's ``wo``), made fp32 here too: made in ``dtype``, a T5 checkpoint of fp16 weights and fp32
    ``wo`` was saved back with ``wo`` rounded to fp16, without a step (an audit helper's repro).
    The engine computes them in ``precision.param_dtype``, as it says at initialize."""
    plan = getattr(model, "_get_dtype_plan", None)
    if dtype is None or not callable(plan):
        return
    keep = [name for name, kept in plan(dtype).items() if kept == torch.float32]
    if not keep:
        return
    pattern = re.compile("|".join(re.escape(name) for name in keep))
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32 and pattern.search(name):
            p.data = p.data.to(torch.float32)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None):
    """torch's default dtype is ``dtype`` inside (None: left as it is)."""
    if dtype is None:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def load_weights(engine, files: dict[str, str], where: str, names: dict[str, str] | None = None) -> None:
    """Stream the checkpoint's tensors into the engine's tiers, one optimizer sub-group (or
    frozen unit) at a time; buffers into the module; return the bytes of parameters read.
    Keys are checked first: a mis-shaped or missing parameter is an error naming every such
    key; an unexpected key is a warning. ``names``: a wrapped model's key -> the checkpoint's,
    for what the model had before wrapping; the rest is the wrapper's, not loaded."""
    params = _statedict.parameter_keys(engine)  # key -> [(unit, index)]: a tiled one's tiles
    buffers = {k: v for k, v in engine.module.state_dict(keep_vars=True).items() if k not in params}
    if names is not None:  # see [Note: wrapping a built model] in _wrap
        params = {names[k]: v for k, v in params.items() if k in names}
        buffers = {names[k]: v for k, v in buffers.items() if k in names}
    shards = Shards(files)

    def tensor(key, full=True):
        return shards.tensor(key) if full else shards.slice(key)

    headers = {k: shards.header(k) for k in [*params, *buffers] if k in files}  # (dtype, shape): headers only
    shapes = {k: headers[k][1] for k in params if k in files}
    here = {k: unit.records[i].full_shape for k, [(unit, i), *_] in params.items()}  # the whole parameter's shape
    bad = [f"{k}: {list(shape)} in the checkpoint, {list(here[k])} here" for k, shape in shapes.items()
           if shape != here[k]]  # fmt: skip
    if bad:
        raise ValueError(f"{where}: mis-shaped tensors: " + "; ".join(bad))
    check_dtypes(headers, buffers, where)
    loaded = {(u.index, i) for k in params if k in files for u, i in params[k]}  # (unit, index): a tied one once
    missing = sorted(k for k, pieces in params.items() if any((u.index, i) not in loaded for u, i in pieces))
    if missing:
        raise ValueError(f"{where}: missing from the checkpoint: {', '.join(missing)}")
    unexpected = sorted(k for k in files if k not in params and k not in buffers)
    if unexpected:
        logger.warning("%s: keys the model does not have, not loaded: %s", where, ", ".join(unexpected))
    _refuse_untied(params, files, tensor, where)
    shards.close()
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
                    if (sliced or u.is_tile) and u.records[i].shape:  # only the rows it needs
                        values[(u.index, i)] = _mine(tensor(k, full=False), u, i, sliced)
                    else:
                        values[(u.index, i)] = tensor(k)
                    t = values[(u.index, i)]
                    t = t.tensor if isinstance(t, Piece) else t
                    read += t.numel() * t.element_size()
            if values:
                _statedict.load_weights(engine, values)
            del values
            # safe_open maps the file, and the pages read stay in this process's RSS while it is
            # open: closed per batch, the load holds one batch's pages, not the whole checkpoint.
            shards.close()
            trim.add(16 * sum(u.numel for u in units))  # see [Note: malloc threshold] in _resources
        for k, buf in buffers.items():
            if k in files:
                buf.copy_(tensor(k))
    return read


def _refuse_untied(params: dict, files: dict, tensor, where: str) -> None:
    """The model ties parameters that the checkpoint holds under several keys with different
    values (a hand-merged or older save of a tied GPT-2 with its own ``lm_head.weight``): the
    load read one and dropped the other with nothing said, where transformers keeps them apart
    (an audit helper's repro: other logits). Refused, naming both keys. Keys with equal values
    (or only one of them in the checkpoint, as transformers saves a tied model) load."""
    tied: dict[int, list[str]] = {}  # tied keys share their pieces list
    for k, pieces in params.items():
        if k in files:
            tied.setdefault(id(pieces), []).append(k)
    for keys in (keys for keys in tied.values() if len(keys) > 1):
        first = tensor(keys[0])
        for other in keys[1:]:
            if not torch.equal(first, tensor(other)):
                raise ValueError(
                    f"{where}: {keys[0]!r} and {other!r} hold different values, but the model ties them (one "
                    "parameter: tie_word_embeddings=True in its config), so one would be dropped. Set "
                    "tie_word_embeddings=False in the checkpoint's config.json to load both, or remove the key not "
                    "meant from the checkpoint"
                )


def _mine(view, unit, i: int, sliced: bool):
    """The rows of parameter ``i`` that ``unit`` holds (a tile: its rows), only those holding
    this rank's slice of the unit when ``sliced``, as a `Piece` (a safetensors slice ``view``
    reads only what is indexed)."""
    r = unit.records[i]
    off, n, shape, start = r.offset, r.numel, r.shape, r.start
    a, b = (max(off, unit.shard.start) - off, min(off + n, unit.shard.stop) - off) if sliced else (0, n)
    if a >= b:  # none of it is this rank's
        return Piece(0, torch.empty(0))
    row = n // shape[0] if shape[0] else 1  # elements per index of the first dimension
    first, last = a // row, -(-b // row)  # rows of the unit's part
    top = start // row  # the part's first row in the parameter
    return Piece(start + first * row, view[top + first : top + last])
