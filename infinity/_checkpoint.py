"""Checkpoints: every rank's training state saved atomically, loaded bit-exactly, resharded.

Layout of a checkpoint root ``DIR``::

    DIR/latest              the tag of the newest complete checkpoint (text, replaced atomically)
    DIR/<tag>/meta.json     format, step, world size, stage, config, loss scaler, RNG states of
                            every rank, the units' layout, the user's client_state (JSON only)
    DIR/<tag>/rank<r>/      rank r's state in the swap format (manifest.json, arena-0.bin):
                            per unit "<unit>/param" (low precision), "<unit>/master",
                            "<unit>/exp_avg", "<unit>/exp_avg_sq" (fp32), each the rank's slice of
                            the unit padded to the world size; "optimizer/steps" (fp32, per unit)
    DIR/.tmp-<tag>/         a save in progress (or one that was killed: the next save removes it)

State is kept per unit, not per optimizer sub-group, so a checkpoint does not depend on
``optimizer.sub_group_size`` or the tiers, and a different world size only changes which slice
of each unit a rank reads (resharding).

[Note: atomic checkpoint]
Every rank writes its own ``rank<r>`` in ``.tmp-<tag>`` (its own swap space: checksummed,
fsynced, manifest written atomically); the ranks then agree that all succeeded, and only rank 0
writes meta.json, renames the directory to ``<tag>`` (exchanging it with an old ``<tag>``), and
then replaces ``latest``. A save that fails or is killed at any point leaves ``latest`` naming
the previous checkpoint, which is untouched; a ``.tmp-`` directory is never loaded. No two ranks
create, rename or remove the same path. Ranks share ``DIR`` (one machine, or a shared
filesystem), as with any multi-rank checkpoint.
"""

from __future__ import annotations

import base64
import collections
import ctypes
import errno
import json
import logging
import os
import random
import re
import shutil
import time

import torch

from infinity.swap import SpaceReader, SwapSpace
from infinity.swap._io import round_up
from infinity.swap._manifest import ManifestError, fsync_dir, read_json, write_bytes_atomic, write_json_atomic

from ._optim import KINDS

logger = logging.getLogger("infinity")

FORMAT = "infinity-checkpoint"
VERSION = 1
META_NAME = "meta.json"
LATEST_NAME = "latest"
TMP_PREFIX = ".tmp-"
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
_IN_FLIGHT = 4  # checkpoint writes in flight per rank (each holds one pool buffer)


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
        with open(pointer) as f:
            named = f.read().strip()
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


# -- meta.json --------------------------------------------------------------------------------
def _rng_state() -> dict:
    import numpy as np

    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out = {
        "python": [version, list(state), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return out


def _set_rng_state(state: dict, where: str) -> None:
    import numpy as np

    try:
        version, inner, gauss = state["python"]
        random.setstate((version, tuple(inner), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            states = [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
            torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{where}: rng: not a saved RNG state ({type(e).__name__}: {e})") from None


def _units_layout(engine) -> list[dict]:
    return [{"name": u.name, "numel": u.numel, "params": [[n, list(s)] for n, s in zip(u.param_names, u.shapes)]}
            for u in engine.units]  # fmt: skip


def _meta(engine, tag: str, rng: list[dict], client_state) -> dict:
    scaler = engine._scaler
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "step": engine._stats.steps,
        "world_size": engine.world_size,
        "stage": engine.config.partition.stage,
        "param_dtype": engine.config.precision.param_dtype,
        "config": engine.config.to_dict(),
        "loss_scaler": None if scaler is None else {"scale": scaler.scale, "good_steps": scaler._good},
        "units": _units_layout(engine),
        "rng": rng,
        "client_state": client_state,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        json.dumps(client_state, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"client_state must be JSON-serialisable (checkpoints hold no pickle): {e}; "
            "convert tensors with .tolist() or save them yourself"
        ) from None
    return meta


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
    if meta.get("version") != VERSION:
        fail("version", f"unknown version {meta.get('version')!r} (this infinity reads version {VERSION})")
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
    scaler = meta.get("loss_scaler")
    if scaler is not None and not (isinstance(scaler, dict) and isinstance(scaler.get("scale"), (int, float))
                                   and isinstance(scaler.get("good_steps"), int)):  # fmt: skip
        fail("loss_scaler", f"{scaler!r} is not {{scale, good_steps}}")
    return meta


# -- saving -----------------------------------------------------------------------------------
class _Writes:
    """Checkpoint writes in flight, each from its own pool buffer, at most ``_IN_FLIGHT``."""

    def __init__(self, space: SwapSpace, pool):
        self.space, self.pool = space, pool
        self.queue: collections.deque = collections.deque()
        self.bytes = 0

    def put(self, name: str, src: torch.Tensor) -> None:
        """Write a copy of ``src`` (1-D, any device) as ``name``, with a checksum."""
        lease = self.pool.acquire(max(src.numel() * src.element_size(), 1))
        copy = lease.view(src.dtype, (src.numel(),))
        copy.copy_(src)
        try:
            self.queue.append((self.space.put(name, copy, checksum=True), lease))
        except BaseException:
            lease.release()
            raise
        self.bytes += src.numel() * src.element_size()
        while len(self.queue) > _IN_FLIGHT:
            self._finish_one()

    def _finish_one(self) -> None:
        fut, lease = self.queue.popleft()
        try:
            fut.result()
        finally:
            lease.release()

    def finish(self) -> None:
        error = None
        while self.queue:
            try:
                self._finish_one()
            except BaseException as e:  # noqa: BLE001 - every buffer goes back; the first error is raised
                error = error or e
        if error is not None:
            raise error


def _rank_bytes(engine) -> int:
    """Arena bytes one rank's checkpoint needs (every tensor rounded up to the alignment)."""
    itemsize = engine.dtype.itemsize
    total = round_up(len(engine.units) * 4)
    for u in engine.units:
        total += 3 * round_up(u.shard_numel * 4) + round_up(u.shard_numel * itemsize)
    return total


def _save_rank(engine, tmp: str) -> int:
    """Write this rank's state under ``tmp``; returns the bytes written."""
    opt = engine.optimizer
    space = SwapSpace(tmp, rank=engine.rank, engine=engine.aio, pool=engine.pool, fresh=True,
                      grow_step=_rank_bytes(engine))  # fmt: skip
    writes = _Writes(space, engine.pool)
    try:
        for group in opt.groups:
            # The group's optimizer state, kind by kind: resident tensors, or pool buffers read from nvme.
            for kind in KINDS:
                store = opt.stores[kind]
                value = store.get(group.name).result()
                lease = None if store.resident else value
                flat = value if lease is None else value.view(torch.float32, (group.numel,))
                try:
                    for u in group.units:
                        writes.put(f"{u.name}/{kind}", flat[group.slices[u.index]])
                finally:
                    if lease is not None:
                        lease.release()
            for u in group.units:
                value = engine.param_store.get(u.name).result()
                lease = None if engine.param_store.resident else value
                n = u.padded_numel if opt.gather_params else u.shard_numel  # stages 1, 2: all of it
                flat = value.reshape(-1) if lease is None else value.view(engine.dtype, (n,))
                try:
                    writes.put(f"{u.name}/param", flat if n == u.shard_numel else flat[u.shard])
                finally:
                    if lease is not None:
                        lease.release()
        steps = torch.stack([opt.steps[u.index].detach().to("cpu", torch.float32) for u in engine.units])
        writes.put("optimizer/steps", steps)
        writes.finish()
        space.close()  # flushes: the arena fsynced, the manifest written atomically
    except BaseException as e:
        # The first error is the one to report; the rest only has to give its buffers back.
        for cleanup in (writes.finish, space.close):
            try:
                cleanup()
            except Exception as other:  # noqa: BLE001
                e.add_note(f"(then, cleaning up the checkpoint's swap space: {other})")
        raise
    return writes.bytes


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


def _publish(root: str, tmp: str, tag: str) -> None:
    """Rank 0: move the finished ``tmp`` to ``root/tag``, then point ``latest`` at it."""
    final = os.path.join(root, tag)
    if os.path.exists(final):
        if _exchange(tmp, final):
            fsync_dir(root)
            shutil.rmtree(tmp)  # the old checkpoint of this tag, now under the temporary name
        else:
            aside = os.path.join(root, f"{TMP_PREFIX}old-{tag}")
            os.rename(final, aside)
            os.rename(tmp, final)
            fsync_dir(root)
            shutil.rmtree(aside)
    else:
        os.rename(tmp, final)
        fsync_dir(root)
    write_bytes_atomic(os.path.join(root, LATEST_NAME), f"{tag}\n".encode())


def list_checkpoints(root: str) -> list[tuple[int, float, str]]:
    """(step, mtime, tag) of the complete checkpoints in ``root``, oldest first."""
    found = []
    for entry in os.scandir(root):
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False) or not _TAG.fullmatch(entry.name):
            continue
        meta_path = os.path.join(entry.path, META_NAME)
        try:
            with open(meta_path) as f:
                step = json.load(f).get("step")
            found.append((int(step), os.stat(meta_path).st_mtime, entry.name))
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # not a checkpoint: not ours to prune
    return sorted(found)


def _prune(root: str, keep_last: int, current: str) -> list[str]:
    found = [tag for _, _, tag in list_checkpoints(root)]
    doomed = [t for t in found[: max(len(found) - keep_last, 0)] if t != current]
    for tag in doomed:
        shutil.rmtree(os.path.join(root, tag))
    if doomed:
        fsync_dir(root)
    return doomed


def save(engine, path, tag: str | None = None, client_state=None, keep_last: int | None = None) -> str:
    """See `Engine.save_checkpoint`."""
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"{keep_last=} must be a positive int (or None to keep every checkpoint)")
    tag = check_tag(f"step-{engine._stats.steps}" if tag is None else tag)
    dist = engine.dist
    dist.agree_text(tag, "checkpoint tag")
    if engine.grads.has_grad:
        raise RuntimeError(
            "save_checkpoint between backward and step: the gradients accumulated since the last "
            "step are not saved; call step() first"
        )
    root = os.path.abspath(os.fspath(path))
    tmp = os.path.join(root, TMP_PREFIX + tag)
    start = time.perf_counter()
    engine.scheduler.release_all()  # prefetched parameters give their pool buffers back
    rng = dist.gather_text(json.dumps(_rng_state()), "checkpoint RNG states")
    error = meta = None
    try:
        meta = _meta(engine, tag, [json.loads(r) for r in rng], client_state)
        if dist.rank == 0:
            os.makedirs(root, mode=0o700, exist_ok=True)
            for entry in os.listdir(root):  # saves that were killed: never loaded, removed now
                if entry.startswith(TMP_PREFIX):
                    shutil.rmtree(os.path.join(root, entry))
            os.mkdir(tmp, 0o700)
    except BaseException as e:  # noqa: BLE001 - every rank learns of it (see [Note: atomic checkpoint])
        error = e
    _agree(dist, error, "preparing the checkpoint directory")
    nbytes = 0
    try:
        nbytes = _save_rank(engine, tmp)
    except BaseException as e:  # noqa: BLE001
        error = e
    _agree(dist, error, "writing the checkpoint", cleanup=tmp if dist.rank == 0 else None)
    if dist.rank == 0:
        try:
            write_json_atomic(os.path.join(tmp, META_NAME), meta)
            fsync_dir(tmp)
            _publish(root, tmp, tag)
            if keep_last is not None:
                removed = _prune(root, keep_last, tag)
                if removed:
                    logger.info("checkpoint: removed %s (keep_last=%d)", ", ".join(removed), keep_last)
        except BaseException as e:  # noqa: BLE001
            error = e
    _agree(dist, error, "publishing the checkpoint", cleanup=tmp if dist.rank == 0 else None)
    where = os.path.join(root, tag)
    elapsed = time.perf_counter() - start
    if dist.rank == 0:
        logger.info("checkpoint %s saved: %.1f MB per rank in %.2fs (%.2f GB/s)", where, nbytes / 1e6, elapsed,
                    nbytes / max(elapsed, 1e-9) / 1e9)  # fmt: skip
    return where


def _agree(dist, error: BaseException | None, what: str, cleanup: str | None = None) -> None:
    """Raise on every rank if any rank failed at ``what`` (after removing ``cleanup``)."""
    failed = dist.all_ok(error is None, f"checkpoint: {what}")
    if not failed:
        return
    if cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)
    if error is not None:
        raise error
    others = dist.failures()
    why = "; ".join(f"rank {r}: {others[r]}" for r in failed if r in others)
    raise RuntimeError(f"checkpoint: {what} failed on rank(s) {', '.join(map(str, failed))}" + (f" ({why})" if why else ""))


# -- loading ----------------------------------------------------------------------------------
class _Sources:
    """The saved ranks' swap spaces (read-only, opened on first use), for one load."""

    def __init__(self, where: str, world: int, engine):
        self.where, self.world, self.aio = where, world, engine.aio
        self.readers: dict[int, SpaceReader] = {}

    def reader(self, q: int) -> SpaceReader:
        if q not in self.readers:
            rank_dir = os.path.join(self.where, f"rank{q}")
            try:
                r = SpaceReader(rank_dir, engine=self.aio)
            except FileNotFoundError:
                raise CheckpointError(f"{rank_dir}: rank {q} of {self.world} is missing: the checkpoint is incomplete") from None
            if r.manifest.rank != q:
                r.close()
                raise CheckpointError(f"{rank_dir}: holds rank {r.manifest.rank}, not rank {q}")
            self.readers[q] = r
        return self.readers[q]

    def record(self, q: int, name: str, dtype: torch.dtype, numel: int):
        r = self.reader(q)
        try:
            rec = r.info(name)
        except KeyError:
            raise CheckpointError(f"{r.rank_dir}: tensor {name!r} is missing: the checkpoint is incomplete") from None
        if rec.dtype != str(dtype).removeprefix("torch.") or rec.shape != (numel,):
            raise CheckpointError(f"{r.rank_dir}: tensor {name!r} is {rec.dtype} {list(rec.shape)}, expected "
                                  f"{str(dtype).removeprefix('torch.')} [{numel}]")  # fmt: skip
        return r

    def close(self) -> None:
        for r in self.readers.values():
            r.close()


def _fill(src: _Sources, dst: torch.Tensor, unit, meta_numel: int, kind: str, dtype, lo: int, hi: int) -> None:
    """``dst`` (1-D, CPU) = elements [lo, hi) of unit's flat ``kind`` (zero past its numel),
    read from the saved ranks' slices (each verified against its checksum)."""
    world = src.world
    shard_old = -(-meta_numel // world)  # the saved slice length (the unit padded to the old world size)
    numel = unit.numel
    if hi > numel:
        dst[max(numel - lo, 0) :].zero_()
    for q in range(lo // shard_old, min(-(-min(hi, numel) // shard_old), world)):
        a, b = max(lo, q * shard_old), min(hi, (q + 1) * shard_old, numel)
        if a >= b:
            continue
        name = f"{unit.name}/{kind}"
        reader = src.record(q, name, dtype, shard_old)
        if a == q * shard_old and b - a == shard_old:
            reader.read(name, verify=True, out=dst[a - lo : b - lo])
        else:
            piece = reader.read(name, verify=True)
            dst[a - lo : b - lo].copy_(piece[a - q * shard_old : b - q * shard_old])


def _check_model(engine, meta: dict, where: str) -> None:
    saved = meta["units"]
    if len(saved) != len(engine.units):
        raise CheckpointError(f"{where}: saved from a model with {len(saved)} parameter units, this one has "
                              f"{len(engine.units)}: not the same model")  # fmt: skip
    for u, s in zip(engine.units, saved):
        if s["name"] != u.name or s["numel"] != u.numel:
            raise CheckpointError(f"{where}: unit {u.name!r} ({u.numel} elements) was saved as {s['name']!r} "
                                  f"({s['numel']} elements): not the same model")  # fmt: skip


def load(engine, path, tag: str = LATEST_NAME) -> dict:
    """See `Engine.load_checkpoint`."""
    if engine.grads.has_grad:
        raise RuntimeError("load_checkpoint between backward and step: call step() or zero_grad() first")
    error = None
    meta = None
    start = time.perf_counter()
    engine.scheduler.release_all()
    where, writing = None, False
    try:
        where = resolve(path, tag)
        meta = load_meta(where)
        _check_model(engine, meta, where)
        writing = True  # from here on, the engine's state is being replaced
        _load_rank(engine, where, meta)
    except BaseException as e:  # noqa: BLE001 - all ranks agree before anyone trains on it
        error = e
    try:
        _agree(engine.dist, error, "loading the checkpoint")
    except BaseException as e:
        if writing:  # part of the state is the checkpoint's, part is not
            engine._unusable = (f"the engine's state is partly loaded from {where} ({type(e).__name__}: {e}); "
                                "load a good checkpoint or make a new engine")  # fmt: skip
        raise
    engine._unusable = None
    scaler = meta["loss_scaler"]
    if engine._scaler is not None and scaler is not None:
        engine._scaler.scale, engine._scaler._good = float(scaler["scale"]), int(scaler["good_steps"])
    engine._stats.steps = meta["step"]
    rank = engine.rank
    if rank < meta["world_size"]:
        _set_rng_state(meta["rng"][rank], os.path.join(where, META_NAME))
    else:
        logger.warning("checkpoint saved by %d ranks: rank %d keeps its own RNG state", meta["world_size"], rank)
    if rank == 0:
        logger.info("checkpoint %s loaded (step %d, saved by %d rank(s)) in %.2fs", where, meta["step"],
                    meta["world_size"], time.perf_counter() - start)  # fmt: skip
    return meta["client_state"]


def _load_rank(engine, where: str, meta: dict) -> None:
    opt = engine.optimizer
    src = _Sources(where, meta["world_size"], engine)
    pool = engine.pool
    pending: collections.deque = collections.deque()  # (store Pending, pool buffer)

    def put(store, name, tensor, lease):
        pending.append((store.put(name, tensor), lease))
        while len(pending) > 2:
            finish_one()

    def finish_one():
        p, lease = pending.popleft()
        try:
            p.result()
        finally:
            if lease is not None:
                lease.release()

    try:
        saved_numel = {s["name"]: s["numel"] for s in meta["units"]}
        padded = {u.name: -(-saved_numel[u.name] // meta["world_size"]) * meta["world_size"] for u in engine.units}
        for group in opt.groups:
            for kind in KINDS:
                store = opt.stores[kind]
                if store.resident:
                    target, lease = store.tensor(group.name), None
                    flat = target if target.device.type == "cpu" else torch.empty(group.numel, dtype=torch.float32)
                else:
                    lease = pool.acquire(group.numel * 4)
                    flat = target = lease.view(torch.float32, (group.numel,))
                for u in group.units:
                    s = group.slices[u.index]
                    _fill(src, flat[s], u, padded[u.name], kind, torch.float32, u.shard.start, u.shard.stop)
                if lease is not None:
                    put(store, group.name, flat, lease)
                elif flat is not target:
                    target.copy_(flat)
        same_dtype = meta["param_dtype"] == engine.config.precision.param_dtype
        gathers = opt.gather_params
        for u in engine.units:
            lo, hi = (0, u.padded_numel) if gathers else (u.shard.start, u.shard.stop)
            ps = engine.param_store
            if ps.resident:
                target, lease = ps.tensor(u.name).reshape(-1), None
                flat = target if target.device.type == "cpu" else torch.empty(hi - lo, dtype=engine.dtype)
            else:
                lease = pool.acquire((hi - lo) * engine.dtype.itemsize)
                flat = target = lease.view(engine.dtype, (hi - lo,))
            if same_dtype:
                _fill(src, flat, u, padded[u.name], "param", engine.dtype, lo, hi)
            else:  # the precision changed: the parameters are the master weights, cast
                master = torch.empty(hi - lo, dtype=torch.float32)
                _fill(src, master, u, padded[u.name], "master", torch.float32, lo, hi)
                flat.copy_(master)
            if lease is not None:
                put(ps, u.name, flat, lease)
            elif flat is not target:
                target.copy_(flat)
        # Step counts: this rank's own (the same on every rank; a new rank takes rank 0's).
        q = engine.rank if engine.rank < meta["world_size"] else 0
        steps = src.reader(q).read("optimizer/steps", verify=True)
        if steps.numel() != len(engine.units):
            raise CheckpointError(f"{src.reader(q).rank_dir}: optimizer/steps has {steps.numel()} entries, "
                                  f"expected {len(engine.units)}")  # fmt: skip
        for u in engine.units:
            opt.steps[u.index].fill_(float(steps[u.index]))
        while pending:
            finish_one()
    finally:
        while pending:
            try:
                finish_one()
            except BaseException:  # noqa: BLE001 - the first error is already propagating
                pass
        src.close()
