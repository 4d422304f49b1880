"""Reading a Hugging Face safetensors checkpoint directory: which file holds each key, and the
tensors, one at a time, from files that are inside the directory and say who they are.

Owns: transformers' precedence (``model.safetensors`` before ``model.safetensors.index.json``,
as ``_get_resolved_checkpoint_files`` in transformers' modeling_utils), the index's shape, the
confinement of every weights file to the directory, the dtypes a parameter may be read from,
and errors that name the file. Touches: safetensors' lazy ``safe_open``.

[Note: weights inside the directory]
An index is data from wherever the checkpoint came from: a name in its weight_map that is
absolute, holds ``..``, or is a symlink out of the directory would make a load read any file
the user can (``/etc/passwd``, another model, a key) into the weights. Every weights file must
resolve (symlinks followed) inside the directory. The one exception is huggingface_hub's cache,
whose ``snapshots/<revision>/<file>`` are symlinks to ``../../blobs/<hash>`` of the same repo.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# What a parameter may be read from: a cast between these keeps the value (to within the target's
# precision). An integer or boolean tensor, cast, is not a weight, and an 8-bit float one needs
# its quantisation scales, which a plain load does not apply.
FLOATS = ("F64", "F32", "F16", "BF16")


def checkpoint_files(path: str) -> dict[str, str]:
    """key -> the safetensors file that holds it in the checkpoint directory ``path``: its
    ``model.safetensors`` where there is one (transformers' precedence), else its index's shards.
    ValueError names the file for an index that is not ``{"weight_map": {key: file name}}`` and
    for a file outside ``path`` (see [Note: weights inside the directory])."""
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        _inside(path, SINGLE, single)
        with _reading(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                return {k: single for k in f.keys()}
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        return {k: _inside(path, name, f"{index}: {k!r} is in {name!r}") for k, name in _weight_map(index).items()}
    raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX}: not a Hugging Face safetensors checkpoint")


def _weight_map(index: str) -> dict[str, str]:
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{index}: not JSON: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        got = type(weight_map if isinstance(data, dict) else data).__name__
        raise ValueError(f"{index}: not a safetensors index: expected {{\"weight_map\": {{key: file name}}}}, "
                         f"found {'a weight_map that is a ' if isinstance(data, dict) else 'a '}{got}")  # fmt: skip
    bad = [f"{k!r}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str) or not v]
    if bad:
        raise ValueError(f"{index}: weight_map values must be file names: " + ", ".join(bad[:5]))
    return weight_map


def _inside(path: str, name: str, what: str) -> str:
    """``path/name``, refused where it is not inside ``path`` (see [Note: weights inside the
    directory]); ``what`` starts the error."""
    parts = name.replace(os.sep, "/").split("/")
    if os.path.isabs(name) or ".." in parts or "\0" in name:
        raise ValueError(f"{what}, outside {path}: the weights files of a checkpoint must be inside its directory")
    file = os.path.join(path, name)
    root, real = os.path.realpath(path), os.path.realpath(file)
    if os.path.commonpath([root, real]) != root and not _hub_blob(root, real):
        raise ValueError(f"{what}, a symlink to {real}, outside {path}: the weights files of a checkpoint "
                         "must be inside its directory")  # fmt: skip
    return file


def _hub_blob(root: str, real: str) -> bool:
    """``real`` is a blob of the huggingface_hub cache repo whose snapshot ``root`` is."""
    snapshots = os.path.dirname(root)
    return os.path.basename(snapshots) == "snapshots" and os.path.dirname(real) == os.path.join(
        os.path.dirname(snapshots), "blobs"
    )


@contextlib.contextmanager
def _reading(file: str, key: str | None = None):
    """safetensors' errors name neither the file nor the key: these do."""
    from safetensors import SafetensorError

    of = f" (reading {key!r})" if key is not None else ""
    try:
        yield
    except SafetensorError as e:
        raise ValueError(f"{file}: not a valid safetensors file: {e}{of}") from None
    except OSError as e:
        if e.filename is not None:
            raise
        code = e.errno or (errno.ENOENT if isinstance(e, FileNotFoundError) else errno.EIO)  # safetensors' carry none
        why = os.strerror(code) if isinstance(e, FileNotFoundError) else (e.strerror or str(e))  # it names the file
        raise type(e)(code, f"{why}{of}", file) from None


class Shards:
    """The tensors of a checkpoint, read lazily, one at a time, through safetensors' ``safe_open``
    (which maps each file; `close` unmaps them: the pages read leave the process's RSS)."""

    def __init__(self, files: dict[str, str]):
        self.files = files  # key -> file
        self._handles: dict[str, object] = {}

    def _open(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open

            with _reading(file):
                self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def slice(self, key: str):
        """A lazy view of ``key``: indexing it reads only the rows asked for."""
        file = self.files[key]
        with _reading(file, key):
            return _NamedSlice(self._open(file).get_slice(key), file, key)

    def tensor(self, key: str):
        file = self.files[key]
        with _reading(file, key):
            return self._open(file).get_tensor(key)

    def header(self, key: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype name such as "F32", shape) of ``key``, from its file's header only."""
        view = self.slice(key)
        return view.get_dtype(), tuple(view.get_shape())

    def close(self) -> None:
        self._handles.clear()


class _NamedSlice:
    """A safetensors slice whose read errors name its file and key."""

    __slots__ = ("_view", "_file", "_key")

    def __init__(self, view, file: str, key: str):
        self._view, self._file, self._key = view, file, key

    def get_dtype(self) -> str:
        return self._view.get_dtype()

    def get_shape(self) -> list[int]:
        return self._view.get_shape()

    def __getitem__(self, index):
        with _reading(self._file, self._key):
            return self._view[index]


def check_dtypes(headers: dict[str, tuple[str, tuple]], buffers: dict, where: str) -> None:
    """Refuse a parameter stored in a dtype that is not one of FLOATS, and a buffer whose dtype
    or shape a copy into it would change silently (copy_ casts and broadcasts): one error naming
    every such key."""
    from ._export import DTYPES

    names = {v: k for k, v in DTYPES.items()}
    bad = [f"{k}: {dt}" for k, (dt, _) in headers.items() if k not in buffers and dt not in FLOATS]
    for k, buf in buffers.items():
        if k not in headers:
            continue
        dt, shape = headers[k]
        floating = dt in FLOATS and buf.is_floating_point()
        if (not floating and names.get(dt) != buf.dtype) or shape != tuple(buf.shape):
            bad.append(f"{k}: {dt} {list(shape)} in the checkpoint, a {buf.dtype} {list(buf.shape)} buffer here")
    if bad:
        raise ValueError(f"{where}: tensors a load would cast, not convert (parameters load from "
                         f"{', '.join(FLOATS)}; a buffer from its own dtype and shape): " + "; ".join(bad))  # fmt: skip
