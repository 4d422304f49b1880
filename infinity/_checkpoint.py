"""Saving and loading checkpoints: every rank's state atomically, loaded bit-exactly, resharded.

Owns: the order of a save (prepare, write each rank's state, agree, publish, prune) and of a
load (resolve, check, read each rank's slices, agree, restore the components). Touches: the
engine's components through their ``state_dict()`` / ``load_state_dict()`` (optimizer, loss
scaler, stats, RNG) and its stores through leases; the format is `infinity.checkpoint`'s.

State is kept per unit, not per optimizer sub-group, so a checkpoint does not depend on
``optimizer.sub_group_size`` or the tiers, and a different world size only changes which slice
of each unit a rank reads (resharding). Modules cut into other tiles are re-cut as they load:
`_recut` says which runs of which saved units make each unit (see [Note: re-cut]).

[Note: atomic checkpoint]
Every rank writes its own ``rank<r>`` in ``.tmp-<tag>.<pid>.<hex>`` (its own swap space:
checksummed, fsynced, manifest written atomically); the ranks then agree that all succeeded, and
only rank 0 writes meta.json, renames the directory to ``<tag>`` (exchanging it with an old
``<tag>``), and then replaces ``latest``. A save that fails or is killed at any point leaves
``latest`` naming the previous checkpoint, which is untouched; a ``.tmp-`` directory is never
loaded. No two ranks create, rename or remove the same path. Ranks share ``DIR`` (one machine,
or a shared filesystem), as with any multi-rank checkpoint.

[Note: checkpoint root lock]
Rank 0 holds an exclusive flock on ``DIR/.lock`` from before it creates its temporary directory
until pruning is done, and a second save to ``DIR`` (another run's, or another engine's) fails
at once naming the holder's process rather than waiting: two runs saving to one root would
replace each other's ``latest`` and prune each other's checkpoints however their saves were
ordered. So a save that holds the lock is the only live one, and every ``.tmp-``/``.trash-``
entry it finds was left by a save that failed or was killed: it removes them, and nothing else
does. Removing a checkpoint (pruning, or the old one of a replaced tag) first renames it to a
``.trash-`` name and fsyncs the root, so a kill part-way through leaves a dot entry that is
never listed nor loaded, and that the next save removes, never a ``<tag>`` without its meta.json.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time

import torch
from torch.profiler import record_function

from infinity.swap import (
    DTYPES, SwapSpace, WriteBehind, fsync_dir, parse_json, read_json, round_up, write_bytes_atomic,
    write_json_atomic,
)  # fmt: skip

from . import _algorithms, _compact, _consolidate, _jsonstate, _recut, _rng, _saved
from .checkpoint import (
    FORMAT, LATEST_NAME, LOCK_NAME, META_NAME, TMP_PREFIX, TRASH_PREFIX, VERSION, CheckpointError, check_tag,
    list_checkpoints, load_meta, resolve, seal,
)  # fmt: skip

logger = logging.getLogger("infinity")

_IN_FLIGHT = 4  # checkpoint writes in flight per rank (each holds one pool buffer)


# -- meta.json --------------------------------------------------------------------------------
def components(engine) -> dict:
    """The stateful pieces of ``engine`` a checkpoint saves and restores through their
    ``state_dict()`` / ``load_state_dict()``: "optimizer", "lr_scheduler" (None unless given),
    "loss_scaler" (None unless fp16) and "stats"."""
    return {"optimizer": engine.optimizer, "lr_scheduler": engine.lr_scheduler, "loss_scaler": engine._scaler,
            "stats": engine._stats}  # fmt: skip


def _units_layout(engine) -> list[dict]:
    return [{"name": u.name, "numel": u.numel, "params": [[r.name, list(r.shape)] for r in u.records]}
            for u in engine.units]  # fmt: skip


def _meta(engine, tag: str, rng: list[dict], client_state) -> dict:
    parts = components(engine)
    scaler = parts["loss_scaler"]
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "step": parts["stats"].state_dict()["steps"],
        "world_size": engine.world_size,
        "stage": engine.config.partition.stage,
        "param_dtype": engine.config.precision.param_dtype,
        "config": engine.config.to_dict(),
        "loss_scaler": None if scaler is None else scaler.state_dict(),
        # JSON: the tensors go beside it (the steps, and a torch optimizer's state by name)
        "optimizer": {k: v for k, v in parts["optimizer"].checkpoint_state().items() if k not in ("unit_steps", "state")},
        "lr_scheduler": None if parts["lr_scheduler"] is None else parts["lr_scheduler"].state_dict(),
        "units": _units_layout(engine),
        # What engine.export writes under each key, so that a checkpoint consolidates offline
        # into the same file ([Note: consolidated checkpoint] in `_consolidate`).
        "state_dict": _consolidate.state_dict_layout(engine),
        "rng": rng,
        "buffers": [{"key": k, "shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
                    for k, b in persistent_buffers(engine.module)],  # fmt: skip
        "client_state": client_state,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run": _run(),
    }
    # Both as JSON that loads back equal (`_jsonstate`: a Counter, int keys and tuples tagged),
    # checked here, at the save, not found wrong at a resume.
    meta["client_state"] = _jsonstate.round_trip(client_state, "client_state")
    try:  # what the load will accept: not too deep
        parse_json(json.dumps(meta["client_state"], allow_nan=True), "client_state")
    except ValueError as e:
        raise ValueError(f"client_state would not load back: {e}") from None
    if meta["lr_scheduler"] is not None:
        meta["lr_scheduler"] = _jsonstate.round_trip(
            meta["lr_scheduler"], f"the state_dict() of lr_scheduler {type(parts['lr_scheduler']).__name__}")
    return meta


_RUN: dict = {}  # this process's identity as a saving run, made on first use


def _run() -> dict:
    """This process, as the run that saves: host, pid and a random id (new in a forked child)."""
    if _RUN.get("pid") != os.getpid():
        _RUN.update(host=socket.gethostname(), pid=os.getpid(), id=secrets.token_hex(8))
    return dict(_RUN)


# -- the checkpoint root ----------------------------------------------------------------------
class _RootLock:
    """The exclusive flock on ``root/.lock`` that rank 0 holds for a whole save (see
    [Note: checkpoint root lock]); the file names the holder as "<pid> <host>"."""

    def __init__(self, root: str):
        self.path = os.path.join(root, LOCK_NAME)
        self.fd = None
        me = f"{os.getpid()} {socket.gethostname()}\n".encode()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        locked = False
        # Closing is what releases the flock: a lock kept after any failure here (ENOSPC on a
        # full disk, a Ctrl-C right after the flock) refused every later save to this root from
        # this process, naming this process as "another save" (an audit helper's repro).
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
            os.pwrite(fd, me, 0)  # written before truncating: a reader never finds the file empty
            os.ftruncate(fd, len(me))
        except BlockingIOError:
            pid, _, host = os.pread(fd, 300, 0).decode(errors="replace").strip().partition(" ")
            os.close(fd)
            raise RuntimeError(
                f"checkpoint root {root} is in use by another save (process {pid or '?'} on {host or '?'}, "
                f"which holds {self.path}): two runs saving to one root would replace and prune each other's "
                "checkpoints; give each run its own checkpoint directory"
            ) from None
        except OSError as e:
            os.close(fd)
            what = ("cannot write the saving process's name into the checkpoint root's lock file" if locked else
                    "cannot lock the checkpoint root")  # fmt: skip
            hint = "" if locked else ": its filesystem must support flock"
            raise OSError(e.errno, f"{what} ({e.strerror}){hint}", self.path) from None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # releases the flock

    def __del__(self):  # a lock its taker never got (a Ctrl-C as the constructor returned) goes with it
        self.release()


def _own_name(prefix: str, tag: str) -> str:
    """A temporary name that is this save's alone: ``<prefix><tag>.<pid>.<random hex>``."""
    return f"{prefix}{tag}.{os.getpid()}.{secrets.token_hex(4)}"


_LATEST_TMP = re.compile(re.escape(f".{LATEST_NAME}.") + r".*\.tmp")  # write_bytes_atomic's, for `latest`


def _collect(root: str) -> None:
    """Holding the root's lock: remove what saves that did not finish left in ``root`` (their
    temporary directories, checkpoints they were removing, temporary ``latest`` files)."""
    gone = []
    for entry in os.scandir(root):
        name = entry.name
        if not (name.startswith((TMP_PREFIX, TRASH_PREFIX)) or _LATEST_TMP.fullmatch(name)):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError as e:  # only space is lost: the save goes on
            logger.warning("checkpoint: cannot remove %s, left by a save that did not finish: %s", entry.path, e)
            continue
        gone.append(name)
    if gone:
        logger.info("checkpoint: removed %s in %s, left by saves that did not finish", ", ".join(sorted(gone)), root)


def _remove(root: str, names: list[str]) -> None:
    """Remove the checkpoints ``root/<name>``: each renamed to a ``.trash-`` name first and the
    root fsynced, so no kill leaves a ``<tag>`` without its meta.json behind."""
    trash = []
    for name in names:
        aside = os.path.join(root, _own_name(TRASH_PREFIX, name))
        os.rename(os.path.join(root, name), aside)
        trash.append(aside)
    if trash:
        fsync_dir(root)
    for aside in trash:
        shutil.rmtree(aside)


# -- saving -----------------------------------------------------------------------------------
class _Writer:
    """One rank's checkpoint space: each tensor written from its own pool copy, checksummed,
    at most ``_IN_FLIGHT`` in flight."""

    def __init__(self, space: SwapSpace, pool):
        self.space, self.pool = space, pool
        self.writes = WriteBehind(_IN_FLIGHT)
        self.bytes = 0

    def put(self, name: str, src: torch.Tensor) -> None:
        """Write a copy of ``src`` (1-D, any device) as ``name``."""
        lease = self.pool.acquire(max(src.numel() * src.element_size(), 1))
        copy = lease.view(src.dtype, (src.numel(),))
        try:
            copy.copy_(src)
            future = self.space.put(name, copy, checksum=True)
        except BaseException:
            lease.release()
            raise
        self.writes.add(future, lease)
        self.bytes += src.numel() * src.element_size()


def _rank_bytes(engine) -> int:
    """Arena bytes one rank's checkpoint needs (every tensor rounded up to the alignment)."""
    opt = engine.optimizer
    total = round_up(len(engine.units) * 4)  # the step counts, fp32
    if engine.rank == 0:
        total += sum(round_up(b.numel() * b.element_size()) for _, b in persistent_buffers(engine.module))
    for u in engine.units:
        total += round_up(opt.record(u).nbytes("param"))
    for g in opt.groups:  # every kind fp32, whatever the state dtype (see _write_state)
        for u in g.units:
            total += sum(round_up(u.shard_numel * k.itemsize) for k in opt.algorithm.saved_kinds)
    for _, tensor in opt.foreign_tensors():
        total += round_up(max(tensor.numel() * tensor.element_size(), 1))
    return total


def _write_state(engine, out: _Writer) -> None:
    """Every unit's optimizer state and parameters (this rank's slices), and the step counts.

    Compact states (``optimizer.state_dtype`` bf16 or int8) are saved decoded, in fp32 like
    fp32 ones: the format stays one fp32 tensor per unit and kind, which reshards and re-cuts
    at any element (an int8 block would not), and loads into any state dtype; the cost is the
    checkpoint's size (docs/formats.md). Decoding then encoding gives the same codes back, so
    a compact run resumes bit-exactly ([Note: compact state format] in `_compact`)."""
    opt = engine.optimizer
    codec = opt.algorithm.codec
    for group in opt.groups:
        # The group's optimizer state, kind by kind, as leases of the tier.
        for kind in opt.kinds if codec is None else ("master",):
            lease = opt.states[kind].get(group.record.name_for()).result()
            try:
                for u in group.units:
                    out.put(opt.record(u).key(kind), lease.tensor[group.slices[u.index]])
            finally:
                lease.release()
        if codec is not None:
            _write_compact(opt, group, out)
    for u in engine.units:  # frozen units too: they have parameters and no optimizer state
        lease = engine.param_store.get(u.name).result()
        try:
            flat = lease.tensor.reshape(-1)  # stages 1, 2 keep the whole unit: save the slice
            out.put(opt.record(u).key("param"), flat if flat.numel() == u.shard_numel else flat[u.shard])
        finally:
            lease.release()
    out.put("optimizer/steps", opt.checkpoint_state()["unit_steps"])
    for name, tensor in opt.foreign_tensors():  # a torch optimizer run as it is: its own state
        out.put(name, tensor.detach().reshape(-1))
    if engine.rank == 0:  # the module's persistent buffers (BatchNorm's running statistics), rank 0's
        for key, buf in persistent_buffers(engine.module):
            out.put(_saved.BUFFER_PREFIX + key, buf.detach().reshape(-1))


def persistent_buffers(module) -> list[tuple[str, torch.Tensor]]:
    """(state_dict key, tensor) of each buffer ``module.state_dict()`` holds, once each, in a
    dtype the swap format names (another one, uint16 say, is left out and said once)."""
    out, seen, other = [], set(), []
    for prefix, m in module.named_modules(remove_duplicate=False):
        for name, buf in m._buffers.items():
            if buf is None or name in m._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            key = f"{prefix}.{name}" if prefix else name
            (out if str(buf.dtype).removeprefix("torch.") in DTYPES else other).append((key, buf))
    global _told_buffers
    if other and not _told_buffers:
        _told_buffers = True
        logger.warning("buffers of a dtype a checkpoint cannot hold are not saved: %s",
                       ", ".join(f"{k} ({b.dtype})" for k, b in other[:5]))  # fmt: skip
    return out


_told_buffers = False  # said once per process


def _load_buffers(engine, src: _saved.Sources, meta: dict) -> None:
    """The saved persistent buffers into the module's (every rank reads rank 0's). A checkpoint
    of version 1 holds none: the module keeps its own, and the load says so where it has some."""
    mine = dict(persistent_buffers(engine.module))
    saved = meta.get("buffers")
    if saved is None:
        if mine:
            logger.warning("checkpoint %s (version %s) holds no buffer values: the module keeps its own %s",
                           src.where, meta.get("version"), ", ".join(sorted(mine)[:5]))  # fmt: skip
        return
    if not (isinstance(saved, list) and all(isinstance(e, dict) and isinstance(e.get("key"), str)
                                            and isinstance(e.get("shape"), list) for e in saved)):  # fmt: skip
        raise CheckpointError(f"{src.where}: meta.json: buffers: not a list of {{key, shape, dtype}}")
    reader = src.reader(0)
    missing = []
    for entry in saved:
        key = entry["key"]
        buf = mine.pop(key, None)
        if buf is None:
            missing.append(key)
            continue
        if list(buf.shape) != list(entry["shape"]):
            raise CheckpointError(f"{src.where}: buffer {key!r} was saved of shape {tuple(entry['shape'])}, and the "
                                  f"module's is {tuple(buf.shape)}")  # fmt: skip
        value = reader.read(_saved.BUFFER_PREFIX + key, verify=True)
        with torch.no_grad():
            buf.copy_(value.reshape(buf.shape))
    if missing or mine:
        logger.warning("checkpoint %s: buffers saved that the module does not hold (%s) and of the module not "
                       "saved (%s) are left as they are", src.where, ", ".join(missing[:5]) or "none",
                       ", ".join(sorted(mine)[:5]) or "none")  # fmt: skip


def _write_compact(opt, group, out: _Writer) -> None:
    """A sub-group's compact moments, each unit's decoded to fp32 under its own kind's name."""
    leases = []
    try:
        for kind in opt.kinds[1:]:
            leases.append(opt.states[kind].get(group.record.name_for()).result())
        tensors = [lease.tensor for lease in leases]
        blocks = _compact.block_slices(group.slices)
        for k, kind in enumerate(opt.algorithm.states):
            for u in group.units:
                value = opt.algorithm.codec.decode_unit(tensors, k, group.slices, u.index, blocks)
                out.put(opt.record(u).key(kind.name), value)
    finally:
        for lease in leases:
            lease.release()


def _save_rank(engine, tmp: str) -> tuple[int, str]:
    """Write this rank's state under ``tmp``; returns the bytes written and its space's id."""
    # The arena takes the checkpoint's size at its first tensor: grown by doubling up to it, the
    # last tensors asked for up to as much again, and a save the disk had room for failed with
    # ENOSPC (32.1 MiB with 50 MiB free; an audit helper's repro).
    space = SwapSpace(tmp, rank=engine.rank, engine=engine.aio, pool=engine.pool, fresh=True,
                      grow_step=_rank_bytes(engine), doubling=False)  # fmt: skip
    out = _Writer(space, engine.pool)
    try:
        _write_state(engine, out)
        out.writes.drain()
        space.close()  # flushes: the arena fsynced, the manifest written atomically
    except BaseException as e:
        # The first error is the one to report; the rest only has to give its buffers back.
        for cleanup in (out.writes.drain, space.close):
            try:
                cleanup()
            except Exception as other:  # noqa: BLE001
                e.add_note(f"(then, cleaning up the checkpoint's swap space: {other})")
        raise
    return out.bytes, space.space_id


_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap the directories ``a`` and ``b`` (renameat2 RENAME_EXCHANGE); False where
    the C library or the filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, a.encode(), at_fdcwd, b.encode(), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot exchange {a} with the old checkpoint: {os.strerror(err)}", b)


def _warn_if_from_another_run(final: str, tag: str) -> None:
    """Log a warning when the checkpoint ``final``, about to be replaced, was saved by another run."""
    try:
        old = read_json(os.path.join(final, META_NAME))
        run = old.get("run")
    except (OSError, ValueError, AttributeError):
        return  # not readable: nothing to name
    if isinstance(run, dict) and run.get("id") != _run()["id"]:
        logger.warning("checkpoint %s: replacing tag %r, which another run saved (process %s on %s, at %s); "
                       "runs that share a checkpoint root replace each other's tags", final, tag, run.get("pid"),
                       run.get("host"), old.get("saved_at"))  # fmt: skip


def _publish(root: str, tmp: str, tag: str) -> None:
    """Rank 0: move the finished ``tmp`` to ``root/tag`` (replacing an old one), then point
    ``latest`` at it."""
    final = os.path.join(root, tag)
    if os.path.exists(final):
        _warn_if_from_another_run(final, tag)
        if _exchange(tmp, final):
            fsync_dir(root)
            shutil.rmtree(tmp)  # the old checkpoint of this tag, now under this save's own name
        else:
            aside = os.path.join(root, _own_name(TRASH_PREFIX, tag))
            os.rename(final, aside)
            os.rename(tmp, final)
            fsync_dir(root)
            shutil.rmtree(aside)
    else:
        os.rename(tmp, final)
        fsync_dir(root)
    write_bytes_atomic(os.path.join(root, LATEST_NAME), f"{tag}\n".encode())


def _prune(root: str, keep_last: int, current: str) -> list[str]:
    """Rank 0, holding the root's lock: remove all but the newest ``keep_last`` checkpoints
    (never ``current``); returns their tags."""
    found = [tag for _, _, tag in list_checkpoints(root)]
    doomed = [t for t in found[: max(len(found) - keep_last, 0)] if t != current]
    _remove(root, doomed)
    return doomed


def save(engine, path, tag: str | None = None, client_state=None, keep_last: int | None = None) -> str:
    """See `Engine.save_checkpoint`."""
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"{keep_last=} must be a positive int (or None to keep every checkpoint)")
    steps = components(engine)["stats"].state_dict()["steps"]
    tag = check_tag(f"step-{steps}" if tag is None else tag)
    dist = engine.dist
    dist.agree_text(tag, "checkpoint tag")
    if engine.grads.has_grad:
        acc = engine._accumulation
        first = (f"run this step's micro-batches to its last (optimizer.accumulation = \"engine\": engine.step() "
                 f"updates at the last of {acc.want}; {acc.calls} counted)" if acc.counts else "call step() first")  # fmt: skip
        raise RuntimeError(
            "save_checkpoint between backward and step: the gradients accumulated since the last "
            f"step are not saved; {first}, or zero_grad() to drop them (after an interrupted backward)"
        )
    root = os.path.abspath(os.fspath(path))
    start = time.perf_counter()
    with record_function("infinity::checkpoint.save"):
        engine.scheduler.release_all()  # prefetched parameters give their pool buffers back
        engine._writes.carry()  # what was written into bound parameters is saved: `_inplace`
        # Rank 0 names the temporary directory (its own: see [Note: checkpoint root lock]).
        mine = {"rng": _rng.state_dict(), "tmp": _own_name(TMP_PREFIX, tag) if dist.rank == 0 else ""}
        every = [json.loads(t) for t in dist.gather_text(json.dumps(mine), "checkpoint RNG states")]
        tmp = os.path.join(root, every[0]["tmp"])
        lock = None  # rank 0's, held until the end
        try:
            error = meta = None
            try:
                meta = _meta(engine, tag, [r["rng"] for r in every], client_state)
                if dist.rank == 0:
                    lock = _prepare(root, tmp)
            except BaseException as e:  # noqa: BLE001 - every rank learns of it (see [Note: atomic checkpoint])
                error = _naming(e, "preparing the checkpoint root", root)
            _agree(dist, error, "preparing the checkpoint directory")
            nbytes, space_id = 0, ""
            try:
                nbytes, space_id = _save_rank(engine, tmp)
            except BaseException as e:  # noqa: BLE001
                error = _naming(e, "writing the checkpoint", tmp)
            _agree(dist, error, "writing the checkpoint", cleanup=tmp if dist.rank == 0 else None)
            # Each rank's space of this save, which a load checks its rank directories against.
            meta["spaces"] = dist.gather_text(space_id, "checkpoint spaces")
            if dist.rank == 0:
                try:
                    write_json_atomic(os.path.join(tmp, META_NAME), seal(meta))
                    fsync_dir(tmp)
                    _publish(root, tmp, tag)
                    if keep_last is not None:
                        removed = _prune(root, keep_last, tag)
                        if removed:
                            logger.info("checkpoint: removed %s (keep_last=%d)", ", ".join(removed), keep_last)
                except BaseException as e:  # noqa: BLE001
                    error = _naming(e, f"publishing the checkpoint as {tag!r}", tmp)
            _agree(dist, error, "publishing the checkpoint", cleanup=tmp if dist.rank == 0 else None)
        finally:
            if lock is not None:
                lock.release()
    where = os.path.join(root, tag)
    elapsed = time.perf_counter() - start
    if dist.rank == 0:
        logger.info("checkpoint %s saved: %.1f MB per rank in %.2fs (%.2f GB/s)", where, nbytes / 1e6, elapsed,
                    nbytes / max(elapsed, 1e-9) / 1e9)  # fmt: skip
    return where


def _naming(error: BaseException, what: str, path: str) -> BaseException:
    """``error``, or where it is an OSError naming no file (the kernel's ENOSPC from a write,
    EIO from a directory's fsync), one with its errno that names ``path``: on a full or failing
    disk the user has to learn which filesystem it is."""
    if not isinstance(error, OSError) or error.filename is not None or error.errno is None:
        return error
    named = OSError(error.errno, f"{what}: {error.strerror}", path)
    named.__cause__ = error
    return named.with_traceback(error.__traceback__)


def _prepare(root: str, tmp: str) -> _RootLock:
    """Rank 0: the checkpoint root exists and is locked (the lock is returned), what saves that
    did not finish left is gone, ``tmp`` is new."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise NotADirectoryError(errno.ENOTDIR, "the checkpoint root is a file: save_checkpoint takes a directory, "
                                 "under which each checkpoint is a directory of its own", root)  # fmt: skip
    os.makedirs(root, mode=0o700, exist_ok=True)
    lock = _RootLock(root)
    try:
        _collect(root)
        os.mkdir(tmp, 0o700)
    except BaseException:
        lock.release()
        raise
    return lock


def _agree(dist, error: BaseException | None, what: str, cleanup: str | None = None) -> None:
    """Raise on every rank if any rank failed at ``what`` (after removing ``cleanup``)."""
    try:
        dist.agree_on_outcome(error, f"checkpoint: {what}")
    except BaseException:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise


# -- loading ----------------------------------------------------------------------------------
def load(engine, path, tag: str = LATEST_NAME, *, on_partial=None) -> tuple[str, object]:
    """See `Engine.load_checkpoint`: (the checkpoint directory, its client_state).
    ``on_partial(why)`` is called when the load failed after part of the engine's state was
    replaced (the engine must then refuse to train)."""
    if engine.grads.has_grad:
        raise RuntimeError("load_checkpoint between backward and step: call step() or zero_grad() first")
    error = None
    meta = None
    start = time.perf_counter()
    # What an interrupted backward left (a gradient in a parameter or a unit) would be added
    # to the loaded state's first one: see [Note: gradient hand-over] in `_schedule`.
    engine.scheduler.forget_backward()
    engine.scheduler.release_all()
    where, writing = None, False
    with record_function("infinity::checkpoint.load"):
        try:
            where = resolve(path, tag)
            meta = load_meta(where)
            cut = _recut.plan(engine.units, meta, where)
            src = _saved.Sources(where, meta["world_size"], engine.aio, spaces=meta.get("spaces"))
            try:
                _refuse_other_optimizer(engine.optimizer, meta, where)
                steps = _unit_steps(engine, src, meta, cut)  # refused here, before any state is replaced
                writing = True  # from here on, the engine's state is being replaced
                _load_rank(engine, src, meta, cut, steps)
            finally:
                src.close()
        except BaseException as e:  # noqa: BLE001 - all ranks agree before anyone trains on it
            error = e
        try:
            _agree(engine.dist, error, "loading the checkpoint")
        except BaseException as e:
            if writing and on_partial is not None:  # part of the state is the checkpoint's, part is not
                on_partial(f"the engine's state is partly loaded from {where} ({type(e).__name__}: {e}); "
                           "load a good checkpoint or make a new engine")  # fmt: skip
            raise
    parts = components(engine)
    if parts["loss_scaler"] is not None and meta["loss_scaler"] is not None:
        parts["loss_scaler"].load_state_dict(meta["loss_scaler"])
    restored = True  # the groups' hyperparameters, which the schedule's state goes with
    if meta.get("optimizer") is not None:  # the groups' hyperparameters (the LR schedule's lr, say)
        saved = meta["optimizer"]
        try:
            parts["optimizer"].load_hyperparameters(saved["type"], saved["param_groups"])
        except (KeyError, TypeError, ValueError) as e:
            restored = False
            logger.warning("checkpoint %s: optimizer hyperparameters not restored (%s)%s", where, e,
                           "; nor the lr_scheduler's state: the schedule starts over from this engine's learning rates"
                           if parts["lr_scheduler"] is not None and meta.get("lr_scheduler") is not None else "")  # fmt: skip
    if restored and parts["lr_scheduler"] is not None and meta.get("lr_scheduler") is not None:
        # Without the groups' (another optimizer, another number of groups) the schedule's epoch
        # and base_lrs went on from this engine's lr: a StepLR ran 8x the saved run's lr two
        # steps on (an audit helper's repro), and base_lrs held a saved group's that is not here.
        parts["lr_scheduler"].load_state_dict(_jsonstate.decode(meta["lr_scheduler"]))
    parts["stats"].load_state_dict({"steps": meta["step"]})
    rank = engine.rank
    if rank < meta["world_size"]:
        _rng.load_state_dict(meta["rng"][rank], os.path.join(where, META_NAME))
    else:
        logger.warning("checkpoint saved by %d ranks: rank %d keeps its own RNG state", meta["world_size"], rank)
    if rank == 0:
        recut = f"; {', '.join(cut.recut)} re-cut into this engine's tiles" if cut.recut else ""
        logger.info("checkpoint %s loaded (step %d, saved by %d rank(s)%s) in %.2fs", where, meta["step"],
                    meta["world_size"], recut, time.perf_counter() - start)  # fmt: skip
    return where, _jsonstate.decode(meta["client_state"])


def _load_into(store, name: str, writes: WriteBehind, fill) -> None:
    """``fill(cpu_tensor)`` the tensor ``name`` of ``store`` and write it there."""
    lease = store.writable(name)
    try:
        target = lease.tensor.reshape(-1)
        # Readers fill host memory; a device-tier tensor is filled through a host copy.
        flat = target if target.device.type == "cpu" else torch.empty(target.numel(), dtype=target.dtype)
        fill(flat)
        if flat is not target:
            target.copy_(flat)
        pending = store.put(name, lease.tensor)
    except BaseException:
        lease.release()
        raise
    writes.add(pending, lease)


def _load_compact(opt, src: _saved.Sources, cut: _recut.Plan, group, writes: WriteBehind) -> None:
    """A sub-group's state where the own kinds are compact: every kind read in fp32 as saved
    (checkpoints keep them fp32, `_write_state`), the own kinds then encoded (to nearest)."""

    def read(kind: str, flat: torch.Tensor | None = None) -> torch.Tensor:
        flat = torch.empty(group.numel, dtype=torch.float32) if flat is None else flat
        for u in group.units:
            _saved.fill(src, flat[group.slices[u.index]], cut.runs[u.index], u.numel, kind, torch.float32,
                  u.shard.start, u.shard.stop)  # fmt: skip
        return flat

    _load_into(opt.states["master"], group.record.name_for(), writes, lambda flat: read("master", flat))
    values = [read(kind.name) for kind in opt.algorithm.states]
    for kind, tensor in opt.algorithm.encoded(values, group.slices):
        _load_into(opt.states[kind], group.record.name_for(), writes, lambda flat, t=tensor: flat.copy_(t))


def _refuse_other_optimizer(opt, meta: dict, where: str) -> None:
    """A checkpoint of an optimizer whose states are not this engine's (AdamW's moments into
    SGD's momentum) cannot load: said as that, before a missing tensor is, which reads as a
    damaged checkpoint. Algorithms with the same states (Adam and AdamW) load into each other."""
    saved = (meta.get("optimizer") or {}).get("type")
    if saved is None or saved == opt.kind:
        return
    try:
        theirs = _algorithms.algorithm(saved).saved_kinds
    except ValueError:
        theirs = None
    ours = opt.algorithm.saved_kinds
    if theirs is not None and [k.name for k in theirs] == [k.name for k in ours]:
        return

    def kinds(ks):
        return ", ".join(k.name for k in ks) if ks is not None else "unknown"

    raise CheckpointError(
        f"{where}: saved by optimizer {saved!r} (state per parameter: {kinds(theirs)}), and this engine runs "
        f"{opt.kind!r} ({kinds(ours)}): the optimizer states do not carry over. Make the engine with the "
        f"checkpoint's optimizer ([optimizer] type = {saved!r}, or optimizer= its torch class), or load the "
        "weights alone (engine.module.load_state_dict of an export) and start the optimizer afresh"
    )


def _unit_steps(engine, src: _saved.Sources, meta: dict, cut: _recut.Plan) -> torch.Tensor:
    """Every unit's step count from this rank's saved ones (the same on every rank; a new rank
    takes rank 0's), re-cut where the units are (see [Note: re-cut] in `_recut`)."""
    reader = src.reader(engine.rank if engine.rank < meta["world_size"] else 0)
    return cut.steps(engine.units, reader.read("optimizer/steps", verify=True), reader.rank_dir)


def _load_rank(engine, src: _saved.Sources, meta: dict, cut: _recut.Plan, steps: torch.Tensor) -> None:
    """Replace this rank's state of every unit (optimizer states, parameters, step counts) by
    the checkpoint's, each unit's elements read from the saved units ``cut`` names."""
    opt = engine.optimizer
    writes = WriteBehind(2)
    try:
        for group in opt.groups:
            if opt.algorithm.codec is not None:
                _load_compact(opt, src, cut, group, writes)
                continue
            for kind in opt.algorithm.kinds:
                def fill(flat, group=group, kind=kind):
                    for u in group.units:
                        dst = flat[group.slices[u.index]]
                        _saved.fill(src, dst, cut.runs[u.index], u.numel, kind.name, kind.dtype, u.shard.start, u.shard.stop)

                _load_into(opt.states[kind.name], group.record.name_for(), writes, fill)
        same_dtype = meta["param_dtype"] == engine.config.precision.param_dtype
        frozen = {u.index for u in opt.frozen}
        saved_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[meta["param_dtype"]]
        for u in engine.units:
            lo, hi = (0, u.padded_numel) if opt.gather_params else (u.shard.start, u.shard.stop)

            def fill(flat, u=u, lo=lo, hi=hi):
                if same_dtype:
                    _saved.fill(src, flat, cut.runs[u.index], u.numel, "param", engine.dtype, lo, hi)
                    return
                # The precision changed: the parameters are the master weights, cast (a frozen
                # unit has no master weights: its saved parameters, cast).
                kind, dtype = ("param", saved_dtype) if u.index in frozen else ("master", torch.float32)
                value = torch.empty(hi - lo, dtype=dtype)
                _saved.fill(src, value, cut.runs[u.index], u.numel, kind, dtype, lo, hi)
                flat.copy_(value)

            _load_into(engine.param_store, u.name, writes, fill)
        opt.substates.load_steps(steps)
        _load_buffers(engine, src, meta)
        saved_state = (meta.get("optimizer") or {}).get("torch_state")
        if opt.foreign is not None and saved_state:
            reader = src.reader(engine.rank if engine.rank < meta["world_size"] else 0)
            state = {idx: {key: (reader.read(v["tensor"], verify=True).view(v["shape"])
                                 if isinstance(v, dict) and "tensor" in v else v) for key, v in st.items()}
                     for idx, st in saved_state.items()}  # fmt: skip
            opt.load_foreign_state(state)
        writes.drain()
    finally:
        writes.discard_errors()  # after an error: every buffer back, the first error propagating
