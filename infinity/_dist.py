"""Ranks: the process group, the collectives the engine uses, and failing loudly together.

Owns: joining (or making) the process group, the collectives with errors that name the rank
that failed, and agreement across ranks (same config, same text, one outcome). Touches only
torch.distributed; what is gathered or reduced is the caller's (see `_transport`).

torch.distributed is the transport (gloo on CPU, NCCL with GPUs); nothing home-made. The
engine joins the process group the user made, or makes one from torchrun's environment
(WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT), with ``partition.timeout``.

[Note: rank failures]
A rank that raises records why in the group's key-value store (an excepthook installed at
initialize, and the engine's own errors); a collective that fails or times out on another rank
reads those records, so the survivors' error names the failed rank instead of only saying that
a collective timed out. Collectives are issued in module order, the same on every rank, so no
rank-local decision (a prefetch that found no free memory, say) can reorder them.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import itertools
import os
import sys

import torch
import torch.distributed as dist
import xxhash

_FAILED = "infinity/failed/"
_MET = "infinity/met/"
# Every rank makes its engines (and so its Dists) in one order: their initialize is a collective.
_DISTS = itertools.count()


def _own_gpu(local_rank: int | None = None) -> int:
    """This rank's GPU: ``local_rank`` (default LOCAL_RANK), which must name one of the GPUs this
    process sees (NCCL needs a GPU per rank; without this check, torch.cuda.set_device fails
    with "invalid device ordinal", which names neither the counts nor the way out)."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this process sees {count} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): each rank needs a GPU "
            "of its own. Launch at most that many ranks per machine (torchrun --nproc-per-node), or "
            "train on the CPU with gloo by hiding the GPUs (CUDA_VISIBLE_DEVICES=\"\")"
        )
    return local_rank


# [Note: the same units on every rank]
# Collectives pair up by their order on each rank alone: the engine's per-unit gathers (stage 3)
# and gradient reductions carry no unit identity. A rank whose forward takes other modules than
# the others' (a head or an expert chosen by its own data) would average one unit's gradient
# with another unit's of the same size, or gather another unit's shards, silently (where the
# sizes differ, a collective fails, naming no cause). `Transport` hashes the names of the units
# it gathers and reduces, in order, and before each step `Transport.check_same_units` compares
# the digests over the ranks (`same_everywhere`: one all-reduce of two int64s): where they differ the
# step is refused on every rank, before anything is updated. Initial weights are made the same
# the same way (`same_from_rank0`: rank 0's, as DDP's constructor broadcasts them).


def _group_timeout() -> float | None:
    """The default process group's timeout in seconds, where torch says (a private field)."""
    try:
        group = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
        return group._get_backend(device).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - only a message's detail
        return None


class Dist:
    def __init__(self, timeout: int):
        self.timeout = timeout
        self._meetings = f"{_MET}{next(_DISTS)}/"  # this Dist's keys: another engine's were set before
        self._met: dict[str, int] = {}  # name -> how many times this rank has met the others there
        self._own_group = False
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        if not dist.is_available() or (not dist.is_initialized() and env_world <= 1):
            self.rank, self.world_size, self.local_rank, self.store = 0, 1, 0, None
            return
        # The process group's timeout bounds its collectives: partition.timeout where the engine
        # makes the group, the group's own where it was made before (`_why` names which).
        self._own_group = not dist.is_initialized()
        if self._own_group:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(_own_gpu())
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
            # Ours to end: left to the interpreter's finalisation, gloo's threads abort the
            # exit now and then ("terminate called without an active exception").
            atexit.register(_destroy_group)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", str(self.rank % max(torch.cuda.device_count(), 1))))
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError):  # a group without a store: no failure records
            self.store = None
        # NCCL moves device memory only: CPU tensors go through the GPU (see _on_device).
        self.nccl = dist.get_backend() == "nccl"
        if self.nccl and torch.cuda.current_device() != self.local_rank:
            # A group the user made without torch.cuda.set_device: every rank's current GPU is
            # the first, where NCCL finds them all ("Duplicate GPU detected") and where
            # all_gather_object puts its tensors. The engine computes on the rank's own, as
            # DeepSpeed's initialize sets it.
            torch.cuda.set_device(_own_gpu(self.local_rank))
        self._install_excepthook()

    @property
    def active(self) -> bool:
        return self.world_size > 1

    # -- collectives ------------------------------------------------------------------------
    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, what: str) -> None:
        out, src = self._on_device(full, output=True), self._on_device(shard)
        self._run(lambda: dist.all_gather_into_tensor(out, src), what)
        self._back(full, out)

    def gather_to_rank0(self, full: torch.Tensor | None, shard: torch.Tensor, what: str) -> None:
        """Every rank's ``shard`` (all of one size) into ``full`` on rank 0, in rank order; the
        other ranks pass ``full=None`` and receive nothing (a save's gather: only the writer
        holds the whole of what it writes)."""
        if (full is None) != (self.rank != 0):
            raise ValueError(f"gather_to_rank0 on rank {self.rank}: full is given on rank 0 only ({what})")
        src = self._on_device(shard)
        if full is None:
            self._run(lambda: dist.gather(src, None, dst=0), what)
            return
        out = self._on_device(full, output=True)
        self._run(lambda: dist.gather(src, list(out.view(self.world_size, -1)), dst=0), what)
        self._back(full, out)

    def reduce_scatter_mean(self, shard: torch.Tensor, full: torch.Tensor, what: str) -> None:
        """``shard`` = this rank's slice of the mean over ranks of ``full``."""
        out, src = self._on_device(shard, output=True), self._on_device(full)
        self._run(lambda: dist.reduce_scatter_tensor(out, src), what)
        out.div_(self.world_size)
        self._back(shard, out)

    def all_reduce_mean(self, t: torch.Tensor, what: str) -> None:
        self.all_reduce_sum(t, what)
        t.div_(self.world_size)

    def all_reduce_sum(self, t: torch.Tensor, what: str) -> None:
        on = self._on_device(t)
        self._run(lambda: dist.all_reduce(on), what)
        self._back(t, on)

    def same_from_rank0(self, t: torch.Tensor, what: str) -> bool:
        """Make ``t`` rank 0's on every rank, as DDP's constructor broadcasts the module's
        weights: their xxh3-64 fingerprints are compared first (`same_everywhere`), and
        ``t`` is broadcast only where they differ (ranks that built the model from other RNG
        states). Every rank calls it; returns whether it was broadcast."""
        if self.same_everywhere(xxhash.xxh3_64_intdigest(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
                                                         .numpy()), what):  # fmt: skip
            return False
        on = self._on_device(t)
        self._run(lambda: dist.broadcast(on, src=0), what)
        self._back(t, on)
        return True

    def same_everywhere(self, value: int, what: str) -> bool:
        """Whether every rank passed the same ``value`` (a 64-bit digest; every rank calls it):
        the least of it and of its negation over the ranks (the greatest), in one all-reduce of
        two int64s."""
        if not self.active:
            return True
        value -= 1 << 64 if value >= 1 << 63 else 0  # as int64
        # (-2**63 has no negation in int64: as itself, it makes every rank see a difference)
        both = self._on_device(torch.tensor([value, -value if value != -(1 << 63) else value]))
        self._run(lambda: dist.all_reduce(both, op=dist.ReduceOp.MIN), what)
        low, neg_high = both.tolist()
        return low == value and -neg_high == value

    def all_ok(self, ok: bool, what: str) -> list[int]:
        """The ranks for which ``ok`` was False (every rank calls it; empty when all are fine)."""
        if not self.active:
            return [] if ok else [self.rank]
        flags = torch.zeros(self.world_size)
        flags[self.rank] = 0.0 if ok else 1.0
        self.all_reduce_sum(flags, what)
        return [r for r in range(self.world_size) if flags[r] > 0]

    def meet(self, name: str, what: str) -> None:
        """Return once every rank has reached its n-th ``name`` (n: this rank's count of them),
        else raise after ``partition.timeout`` naming the ranks that did not come. Through the
        group's key-value store, not a collective: a call that one rank makes alone (``if rank
        == 0: model.state_dict()``, the DDP idiom) is refused before its first collective, which
        would otherwise wait on, or under NCCL pair with, whatever the other ranks run next."""
        if not self.active or self.store is None:
            return
        n = self._met[name] = self._met.get(name, 0) + 1
        keys = [f"{self._meetings}{name}/{n}/{r}" for r in range(self.world_size)]
        try:
            self.store.set(keys[self.rank], "1")
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
            return
        except Exception as e:  # noqa: BLE001 - the store's timeout: say who did not come
            error = e
        missing = [r for r, key in enumerate(keys) if not self._has(key)]
        if not missing:
            return  # the last one came as the wait gave up
        failed = self.failures()
        why = "".join(f"; rank {r} failed: {failed[r]}" for r in missing if r in failed)
        ranks = ", ".join(map(str, missing))
        raise RuntimeError(
            f"{what} is a collective that every rank calls: rank {self.rank} called it (call {n}) and rank(s) "
            f"{ranks} did not within partition.timeout={self.timeout}s{why}") from error

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:  # noqa: BLE001 - an unreachable store: count the key as missing
            return False

    def agree_on_outcome(self, error: BaseException | None, what: str) -> None:
        """Every rank calls it after doing ``what``, with its error or None: raise on every rank
        if any rank failed (this rank's own error where it has one, else a RuntimeError naming
        the ranks that failed and, where they recorded it, why). Nothing when all succeeded."""
        failed = self.all_ok(error is None, what)
        if not failed:
            return
        if error is not None:
            raise error
        others = self.failures()
        why = "; ".join(f"rank {r}: {others[r]}" for r in failed if r in others)
        ranks = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {', '.join(map(str, failed))}"
        raise RuntimeError(f"{what} failed on {ranks}" + (f" ({why})" if why else "; its error says why"))

    def agree_text(self, text: str, what: str) -> None:
        """Raise on every rank unless every rank passed the same ``text`` (no pickle: a digest)."""
        if not self.same_everywhere(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little"), what):
            raise ValueError(f"{what}: the ranks passed different values (rank {self.rank}: {text!r})")

    def all_reduce_max(self, t: torch.Tensor, what: str) -> None:
        on = self._on_device(t)
        self._run(lambda: dist.all_reduce(on, op=dist.ReduceOp.MAX), what)
        self._back(t, on)

    def gather_text(self, text: str, what: str) -> list[str]:
        """Every rank's ``text`` (UTF-8 bytes through an all-gather of a padded tensor)."""
        if not self.active:
            return [text]
        data = text.encode()
        size = torch.tensor([float(len(data))])
        self.all_reduce_max(size, what)
        mine = torch.zeros(int(size) + 8, dtype=torch.uint8)
        mine[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        mine[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[8:8]
        out = torch.empty(self.world_size * mine.numel(), dtype=torch.uint8)
        self.all_gather(out, mine, what)
        texts = []
        for chunk in out.view(self.world_size, -1):
            n = int.from_bytes(bytes(chunk[:8].tolist()), "little")
            texts.append(bytes(chunk[8 : 8 + n].tolist()).decode())
        return texts

    def _on_device(self, t: torch.Tensor, output: bool = False) -> torch.Tensor:
        """``t`` where the backend moves it: a host tensor on this rank's GPU for NCCL (its
        values copied there, unless it is only an ``output``), else ``t`` itself."""
        if self.nccl and t.device.type == "cpu":
            gpu = torch.device("cuda", self.local_rank)
            return torch.empty(t.shape, dtype=t.dtype, device=gpu) if output else t.to(gpu)
        return t

    @staticmethod
    def _back(original: torch.Tensor, used: torch.Tensor) -> None:
        if used is not original:
            original.copy_(used)

    def _run(self, fn, what: str) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised with the rank that failed, if known
            raise RuntimeError(self._why(what, e)) from e

    def _why(self, what: str, error: BaseException) -> str:
        failed = self.failures()
        if failed:
            who = "; ".join(f"rank {r} failed: {msg}" for r, msg in sorted(failed.items()))
            return f"{what} on rank {self.rank} could not complete because {who}"
        if self._own_group:
            limit = f"partition.timeout={self.timeout}s"
        else:  # (partition.timeout applies to a group the engine makes: docs/config.md)
            seconds = _group_timeout()
            limit = (f"the process group's own timeout{f' of {seconds:g}s' if seconds is not None else ''}, "
                     "set by the init_process_group made before the engine (partition.timeout applies to a group the "
                     "engine makes)")  # fmt: skip
        return (f"{what} on rank {self.rank} failed or timed out after {limit}; another rank died, stopped calling "
                "the engine, or called another collective (ranks that ran other modules, or gave gradients to other "
                f"parameters of them: see [partition] in docs/config.md) ({error})")

    # -- agreement and failures -------------------------------------------------------------
    def agree(self, config: dict) -> None:
        """Raise on every rank when the ranks' configs differ, naming the keys and ranks."""
        if not self.active:
            return
        configs: list = [None] * self.world_size
        self._run(lambda: dist.all_gather_object(configs, config), "comparing the tier configs")
        mine = _flatten(config)
        for r, other in enumerate(configs):
            theirs = _flatten(other)
            diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            if diff:
                details = ", ".join(f"{k} = {theirs.get(k)!r} on rank {r}, {mine.get(k)!r} here" for k in diff[:5])
                raise ValueError(f"the tier configs of the ranks differ (rank {self.rank} vs rank {r}): {details}")

    def report_failure(self, error: BaseException) -> None:
        if self.store is None:
            return
        try:
            self.store.set(f"{_FAILED}{self.rank}", f"{type(error).__name__}: {error}"[:500])
        except Exception:  # noqa: BLE001 - the store may be gone too; the raise goes on regardless
            pass

    def failures(self) -> dict[int, str]:
        if self.store is None:
            return {}
        out = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = f"{_FAILED}{r}"
            try:
                if self.store.check([key]):
                    out[r] = self.store.get(key).decode(errors="replace")
            except Exception:  # noqa: BLE001 - an unreachable store says nothing
                pass
        return out

    def _install_excepthook(self) -> None:
        previous = sys.excepthook

        def hook(kind, value, tb):
            self.report_failure(value)
            previous(kind, value, tb)

        sys.excepthook = hook


def _destroy_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
