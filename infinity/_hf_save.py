"""`engine.save_pretrained`: a Hugging Face checkpoint directory, replaced all at once for readers.

Owns: the shard plan, the shard names, the order of the directory's changes, the collection of
what an earlier (killed) save left, and the files' mode. Touches: the streamed writer
(`_export.write_files`); the reading side's precedence (`_safetensors`).

[Note: save_pretrained's order]
A reader (transformers, `infinity.from_pretrained`) takes ``model.safetensors`` where there is
one, else the files ``model.safetensors.index.json`` names. So that a save killed (SIGKILL,
power loss) between any two of its renames leaves the whole old checkpoint or the whole new one:

1. every file is written under a temporary name and renamed only when whole and fsynced;
2. the shards of a sharded save have names no earlier save used (``model-<save id>-0000i-of-
   0000n.safetensors``), so renaming them changes nothing a reader looks at;
3. the commit is one step: the rename of ``model.safetensors`` (one file: it wins over any
   index), or the rename of the index followed by the unlink of an old ``model.safetensors``
   (sharded: until that unlink, the old single file still wins over the new index);
4. only then go the files the new checkpoint does not name: an old index, old shards, and the
   temporary files of killed saves. A save also removes those temporary files first, to free
   their (preallocated, full-size) space before it allocates its own.

A flock on the directory keeps two saves into it from collecting each other's temporary files.
``config.json`` and ``generation_config.json`` are replaced (atomically) just before the commit.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import json
import logging
import os
import re
import secrets

from infinity.swap import fsync_dir

from ._export import _AtomicFile, _entries, _Layout, write_files
from ._safetensors import INDEX, SINGLE

logger = logging.getLogger("infinity")

# A sharded checkpoint's shards, ours (with a save id) or transformers' (without).
_SHARD = r"model(?:-[0-9a-f]{8})?-\d{5}-of-\d{5}\.safetensors"
_SHARD_NAME = re.compile(_SHARD)
# The temporary files of a save of any of them: ours (`_AtomicFile`: .NAME.tmp-XXXXXXXX) and the
# ones older versions wrote config and index through (.NAME.XXXXXXXX.tmp).
_NAMES = rf"(?:{_SHARD}|{re.escape(SINGLE)}|{re.escape(INDEX)}|config\.json|generation_config\.json)"
_TEMPORARY = re.compile(rf"\.{_NAMES}\.(?:tmp-\w+|\w+\.tmp)")
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


def save_pretrained(engine, directory, max_shard_size="2GB") -> str:
    """See `Engine.save_pretrained` and [Note: save_pretrained's order]."""
    directory = os.path.abspath(os.fspath(directory))
    _refuse_wrapper(engine.module, directory)
    limit = shard_bytes(max_shard_size)
    engine.dist.meet("save_pretrained", f"save_pretrained to {directory}")
    entries = _untied(_entries(engine))
    shards: list[list] = []
    size = 0
    for e in entries:  # in state_dict order; a tensor larger than the limit gets a shard of its own
        if not shards or (size + e.nbytes > limit and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    names = _names(len(shards))  # only rank 0's are used
    lock, error = None, None
    if engine.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            lock = _lock(directory)
            _collect(directory, keep=(), temporary_only=True)
            while len(names) > 1 and any(os.path.lexists(os.path.join(directory, n)) for n in names):
                names = _names(len(shards))  # an id an earlier save drew: its shards must not be replaced
        except OSError as e:
            error = e
    try:
        engine.dist.agree_on_outcome(error, f"making {directory}")
        module = engine.module

        def configs():
            for attr, name in (("config", "config.json"), ("generation_config", "generation_config.json")):
                cfg = getattr(module, attr, None)
                if cfg is not None and hasattr(cfg, "to_json_string"):
                    if attr == "config":
                        cfg = _described(cfg, module, entries)
                    _write_small(os.path.join(directory, name), cfg.to_json_string().encode())

        def commit():
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                         "weight_map": {e.key: n for n, shard in zip(names, shards) for e in shard}}  # fmt: skip
                _write_small(os.path.join(directory, INDEX), json.dumps(index, indent=2).encode())
                try:  # an old single file wins over the new index until it goes
                    os.unlink(os.path.join(directory, SINGLE))
                    fsync_dir(directory)
                except FileNotFoundError:
                    pass
            _collect(directory, keep={*names, INDEX} if len(shards) > 1 else {SINGLE})

        files = [(os.path.join(directory, n), _Layout(shard)) for n, shard in zip(names, shards)]
        write_files(engine, files, f"save_pretrained to {directory}", done=f"saved {directory}",
                    before_commit=configs, after_commit=commit)  # fmt: skip
    finally:
        if lock is not None:
            os.close(lock)
    return directory


def _untied(entries: list) -> list:
    """``entries`` with each parameter under its first key only, as transformers' save_pretrained
    writes a tied weight (``lm_head.weight`` left out beside ``model.embed_tokens.weight``: the
    tied keys come after their source in every model's state_dict) and from_pretrained ties it
    again. A checkpoint consolidated (`_consolidate`) is written the same."""
    seen: set[int] = set()
    out = []
    for e in entries:
        if e.is_param:
            if id(e.value) in seen:
                continue
            seen.add(id(e.value))
        out.append(e)
    return out


def _refuse_wrapper(module, directory: str) -> None:
    """A module that wraps a transformers model (peft's PeftModel) has the wrapper's keys
    (``base_model.model.*``) and no architecture of its own: the directory it gave loaded in
    AutoModel*.from_pretrained as a model of randomly initialised weights, saying so only in a
    load report. Refused, naming what writes such a model."""
    try:
        import transformers
    except ImportError:
        return
    if isinstance(module, transformers.PreTrainedModel) or not hasattr(module, "save_pretrained"):
        return
    raise TypeError(
        f"save_pretrained to {directory}: engine.module is a {type(module).__module__}.{type(module).__qualname__}, "
        "not a transformers model: its keys are the wrapper's, and AutoModel*.from_pretrained would load the "
        "directory as a randomly initialised model. Use the wrapper's own save (peft: "
        "engine.module.save_pretrained(directory) writes the adapters; every rank calls it), or engine.export "
        "for every weight under the wrapper's keys"
    )


def _described(cfg, module, entries):
    """A copy of the model's config that says what transformers' own save_pretrained writes into
    it: the class (``architectures``, which pipelines and the Hub read) and the dtype of the
    weights written (the first floating-point parameter's, as transformers takes the model's),
    whatever the config named: `from_pretrained` loads in that dtype, so a config that kept the
    dtype it was loaded in (bf16 weights trained and written in fp32) rounded them on the way
    back, silently. The user's config is unchanged."""
    cfg = copy.deepcopy(cfg)
    if hasattr(cfg, "architectures"):
        cfg.architectures = [type(module).__name__]
    dtype = next((e.dtype for e in entries if e.is_param and e.dtype.is_floating_point), None)
    if dtype is not None and hasattr(cfg, "set_dtype"):  # a config.json as it is (infinity-consolidate)
        cfg.set_dtype(str(dtype).removeprefix("torch."))
    elif dtype is not None and hasattr(cfg, "to_dict"):
        cfg.dtype = str(dtype).removeprefix("torch.")
    return cfg


def _names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE]
    save_id = secrets.token_hex(4)
    return [f"model-{save_id}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _lock(directory: str) -> int:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise OSError(e.errno, "another save_pretrained is writing this directory (it holds its flock)",
                          directory) from None  # fmt: skip
        raise OSError(e.errno, f"cannot lock the directory: {e.strerror}", directory) from None
    return fd


def _write_small(path: str, data: bytes) -> None:
    """``path`` replaced atomically by ``data``, with the mode the shards have (see formats.md)."""
    out = _AtomicFile(path, len(data))
    try:
        out.write(data, 0)
        out.commit()
    finally:
        out.discard()


def _collect(directory: str, keep, temporary_only: bool = False) -> None:
    """Remove what no reader of ``directory``'s checkpoint opens: the temporary files of saves that
    were killed and, unless ``temporary_only``, the checkpoint files not in ``keep``. A file that
    cannot be removed is a warning: the checkpoint itself is whole."""
    removed = False
    for entry in sorted(os.listdir(directory)):
        ours = entry in (SINGLE, INDEX) or _SHARD_NAME.fullmatch(entry)
        if _TEMPORARY.fullmatch(entry) or (not temporary_only and ours and entry not in keep):
            try:
                os.unlink(os.path.join(directory, entry))
                removed = True
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("save_pretrained: cannot remove %s, which the checkpoint does not use: %s",
                               os.path.join(directory, entry), e.strerror)  # fmt: skip
    if removed:
        fsync_dir(directory)
