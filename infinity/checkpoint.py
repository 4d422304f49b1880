"""The checkpoint format on disk: names, tags, ``latest`` resolution and meta.json.

Layout of a checkpoint root ``DIR``::

    DIR/latest              the tag of the newest complete checkpoint (text, replaced atomically)
    DIR/<tag>/meta.json     format, step, world size, stage, config, the loss scaler's state,
                            RNG states of every rank, the units' layout, the module's
                            state_dict keys (what an export writes under each; absent in older
                            checkpoints), the user's client_state (JSON only), and a
                            checksum of all that (since version 3)
    DIR/<tag>/rank<r>/      rank r's state in the swap format (manifest.json, arena-0.bin):
                            per unit "<unit>/param" (low precision), "<unit>/master",
                            "<unit>/exp_avg", "<unit>/exp_avg_sq" (fp32), each the rank's slice of
                            the unit padded to the world size; "optimizer/steps" (fp32, per unit)
    DIR/.lock               flocked by the save in progress (rank 0's), naming its process
    DIR/.tmp-<tag>.<pid>.<hex>/   a save in progress, or one that failed or was killed
    DIR/.trash-<tag>.<pid>.<hex>/ a checkpoint being removed (pruned or replaced)

A save holds the lock from start to end, so whatever ``.tmp-``/``.trash-`` entry a save finds
once it holds the lock was left by one that did not finish, and it removes them. Entries
starting with a dot are never checkpoints: `list_checkpoints` and `resolve` ignore them.

This module reads and checks; it writes nothing and imports nothing of the engine, so
`swap-inspect` and other tools can use it. Saving and loading live in the engine
(``Engine.save_checkpoint`` / ``load_checkpoint``); ``docs/formats.md`` describes both formats.
"""

from __future__ import annotations

import errno
import json
import os
import re

import xxhash

from infinity.swap import ManifestError, read_json

FORMAT = "infinity-checkpoint"
# 2: persistent buffers saved, lr_scheduler and client_state tagged (`_jsonstate`); 3: meta.json
# checksummed (`seal`). 1 and 2 are read too.
VERSION = 3
READS = (1, 2, 3)
META_NAME = "meta.json"
LATEST_NAME = "latest"
LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: incomplete, of another model, unknown version..."""


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag == LATEST_NAME:
        raise ValueError(
            f"checkpoint tag {tag!r} must be 1-128 letters, digits, '.', '_', '+' or '-', not starting "
            f"with a dot and not {LATEST_NAME!r} (a tag names a directory inside the checkpoint root)"
        )
    return tag


def resolve(path: str, tag: str = LATEST_NAME) -> str:
    """The checkpoint directory ``path`` and ``tag`` name: ``path`` itself when it holds a
    meta.json, else ``path/<tag>`` (``latest``: the tag the ``latest`` file names)."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(os.path.join(path, META_NAME)) and tag == LATEST_NAME:
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(errno.ENOENT, "no checkpoint directory here", path)
    if tag == LATEST_NAME:
        pointer = os.path.join(path, LATEST_NAME)
        if not os.path.isfile(pointer):
            raise FileNotFoundError(errno.ENOENT, f"no {LATEST_NAME!r} file: no complete checkpoint was saved here", pointer)
        with open(pointer, "rb") as f:
            raw = f.read(4096)
        try:
            named = raw.decode().strip()
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{pointer}: not a tag: byte 0x{raw[e.start]:02x} at offset {e.start} is not UTF-8") from None
        try:
            tag = check_tag(named)
        except ValueError as e:
            raise CheckpointError(f"{pointer}: {e}") from None
    else:
        check_tag(tag)
    where = os.path.join(path, tag)
    if not os.path.isfile(os.path.join(where, META_NAME)):
        raise FileNotFoundError(errno.ENOENT, f"checkpoint {tag!r} is missing or incomplete (no {META_NAME})", where)
    return where



def _meta_checksum(meta: dict) -> str:
    """``"xxh3-64:<16 hex digits>"`` of ``meta`` but its "checksum", as `write_json_atomic`
    writes it (compact, in its own key order: what JSON parsing keeps)."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return "xxh3-64:" + xxhash.xxh3_64_hexdigest(json.dumps(body, separators=(",", ":")).encode())


def seal(meta: dict) -> dict:
    """``meta`` with its "checksum": the tensors are checksummed in their manifests, and meta.json
    holds what they are not (the optimizer's groups, the LR scheduler, the RNG states,
    client_state): an edit or a damaged byte there is refused at load, as one in a tensor is."""
    return {**meta, "checksum": _meta_checksum(meta)}


def load_meta(where: str) -> dict:
    """meta.json of the checkpoint directory ``where``, validated (CheckpointError names the key)."""
    path = os.path.join(where, META_NAME)
    try:
        meta = read_json(path)
    except ManifestError as e:
        raise CheckpointError(str(e)) from None

    def fail(key, why):
        raise CheckpointError(f"{path}: {key}: {why}")

    if not isinstance(meta, dict):
        fail("(top)", "not a JSON object")
    if meta.get("format") != FORMAT:
        fail("format", f"{meta.get('format')!r} is not {FORMAT!r}: not an infinity checkpoint")
    if meta.get("version") not in READS:
        fail("version", f"unknown version {meta.get('version')!r} (this infinity reads versions "
                        f"{', '.join(map(str, READS))})")
    if meta["version"] >= 3 and meta.get("checksum") != _meta_checksum(meta):
        fail("checksum", f"{meta.get('checksum')!r} is not the file's ({_meta_checksum(meta)}): meta.json was "
                         "edited or damaged after the save (the optimizer's groups, LR scheduler, RNG states and "
                         "client_state it holds would load changed): restore it from a copy")
    for key, lo in (("step", 0), ("world_size", 1), ("stage", 1)):
        v = meta.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            fail(key, f"{v!r} is not an integer >= {lo}")
    if meta["stage"] > 3:
        fail("stage", f"{meta['stage']} is not 1, 2 or 3")
    if meta.get("param_dtype") not in ("bf16", "fp16", "fp32"):
        fail("param_dtype", f"{meta.get('param_dtype')!r} is not bf16, fp16 or fp32")
    units = meta.get("units")
    if not isinstance(units, list) or not units:
        fail("units", "missing or empty")
    for i, u in enumerate(units):
        if not (isinstance(u, dict) and isinstance(u.get("name"), str) and isinstance(u.get("numel"), int)
                and u["numel"] >= 0 and isinstance(u.get("params"), list)):  # fmt: skip
            fail(f"units[{i}]", f"{u!r} is not {{name, numel, params}}")
    rng = meta.get("rng")
    if not isinstance(rng, list) or len(rng) != meta["world_size"] or not all(isinstance(r, dict) for r in rng):
        fail("rng", f"not a list of {meta['world_size']} RNG states")
    spaces = meta.get("spaces")  # (absent before it was recorded)
    if spaces is not None and not (isinstance(spaces, list) and len(spaces) == meta["world_size"]
                                   and all(isinstance(s, str) for s in spaces)):  # fmt: skip
        fail("spaces", f"not a list of {meta['world_size']} space ids")
    scaler = meta.get("loss_scaler")
    if scaler is not None and not (isinstance(scaler, dict) and isinstance(scaler.get("scale"), (int, float))
                                   and isinstance(scaler.get("good_steps"), int)):  # fmt: skip
        fail("loss_scaler", f"{scaler!r} is not {{scale, good_steps}}")
    return meta


def list_checkpoints(root: str) -> list[tuple[int, float, str]]:
    """(step, mtime, tag) of the complete checkpoints in ``root``, oldest first."""
    found = []
    for entry in os.scandir(root):
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False) or not _TAG.fullmatch(entry.name):
            continue
        meta_path = os.path.join(entry.path, META_NAME)
        try:
            step = read_json(meta_path).get("step")
            found.append((int(step), os.stat(meta_path).st_mtime, entry.name))
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # not a checkpoint: not ours to prune
    return sorted(found)
