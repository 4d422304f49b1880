"""What a run opens and how much memory it may take.

Owns: opening the aio engine, the host buffer pool and the swap space of a run (`open_io`, for
the engine and `build` alike); glibc's malloc tuning; the checks at initialize that the host
budget and the machine's available memory can hold the placement (a clear error then, not an
OOM kill or a `PoolExhausted` at step 1000); and the registry of engines still open at exit.
Touches: the config, `infinity.aio`, `infinity.swap`; it knows nothing of models.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import os
import platform
import weakref

from infinity import aio
from infinity.swap import HostBufferPool, SwapSpace, human_size

from .config import TierConfig

logger = logging.getLogger("infinity")


def as_config(config) -> TierConfig:
    """A TierConfig from what `initialize` and `build` accept: a TierConfig, a dict, a path to
    a TOML or JSON file, a DeepSpeed config (its dict or ds_config.json: `_deepspeed`), or
    None (everything on the device)."""
    if isinstance(config, TierConfig):
        return config
    from . import _deepspeed

    if _deepspeed.is_deepspeed(config):  # a ds_config.json or its dict
        return _deepspeed.to_tier_config(config)
    if isinstance(config, dict):
        return TierConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return TierConfig.load(config)
    if config is None:
        return TierConfig()
    raise TypeError(f"config must be a TierConfig, a dict or a path, got {type(config).__name__}")


def open_io(cfg: TierConfig, rank: int, local_rank: int):
    """The aio engine, the host buffer pool and (when a tier is nvme) the swap space of a run."""
    engine = aio.open_engine(cfg.aio.backend, cfg.aio.queue_depth, cfg.aio.block_size)
    pool = space = None
    try:
        pool = HostBufferPool(cfg.memory.host_budget, engine=engine)
        if "nvme" in (cfg.tiers.params, cfg.tiers.grads, cfg.tiers.optimizer):
            paths = _swap_paths(cfg, rank, local_rank)
            # A run's swap is scratch: what a previous run left there is stale (a checkpoint, not
            # the swap, is how a run resumes). At close the arenas shrink to what they hold, or
            # go with nvme.keep = false (a key of the config once it has one).
            space = SwapSpace(
                paths, rank=rank, engine=engine, pool=pool, verify=cfg.nvme.verify, fresh=True,
                stripe_size=cfg.nvme.stripe_size, stripe_threshold=cfg.nvme.stripe_threshold,
                grow_step=cfg.nvme.grow_step, keep=cfg.nvme.keep,
            )  # fmt: skip
    except BaseException:
        if pool is not None:
            pool.close()
        engine.close()
        raise
    return engine, pool, space


def remove_stale_ranks(cfg: TierConfig, world: int, engine, pool) -> None:
    """Rank 0's: remove what ranks at or past ``world`` of an earlier run left under nvme.paths
    (theirs and the activation tier's), as each rank's fresh space removes what its own rank
    left: a 2-rank run's rank1 stayed beside a 1-rank run's rank0, its disk never given back,
    and swap-inspect showed it as current. Paths with a placeholder (a directory per rank) are
    left alone, and so is a rank directory another live process holds (its lock)."""
    if "nvme" not in (cfg.tiers.params, cfg.tiers.grads, cfg.tiers.optimizer, cfg.activations.tier):
        return
    if any(p.format(rank=0, local_rank=0) != p.format(rank=1, local_rank=1) for p in cfg.nvme.paths):
        return
    paths = list(cfg.nvme.resolve_paths())
    for dirs in (paths, [os.path.join(p, "activations") for p in paths]):
        stale = set()
        for d in dirs:
            try:
                names = os.listdir(d)
            except OSError:
                continue
            stale.update(int(n[4:]) for n in names if n.startswith("rank") and n[4:].isdigit() and int(n[4:]) >= world)
        for r in sorted(stale):
            rank_dirs = [os.path.join(d, f"rank{r}") for d in dirs]
            try:
                SwapSpace(dirs, rank=r, engine=engine, pool=pool, fresh=True, keep=False, allow_foreign=True).discard()
            except (OSError, RuntimeError, ValueError) as e:  # in use, or not a space's: leave it
                logger.warning("left %s of an earlier run as it is: %s", " ".join(rank_dirs), e)
                continue
            for rank_dir in rank_dirs:
                try:
                    os.rmdir(rank_dir)
                except OSError:
                    pass  # files a space did not make stay, and so does their directory
            logger.info("removed the swap files rank %d of an earlier run left in %s", r, ", ".join(dirs))


def _swap_paths(cfg: TierConfig, rank: int, local_rank: int) -> list[str]:
    cfg.nvme.check_paths()  # again: a drive may have gone since the config was made
    paths = list(cfg.nvme.resolve_paths(rank, local_rank))
    for template, path in zip(cfg.nvme.paths, paths):
        # "{rank}" templates name a directory per rank below the part the config
        # checked: make it. A plain path's last component, when missing, is made by
        # the swap space (its parent must exist: a mistyped mount point is not made).
        if template.format(rank=0, local_rank=0) != template.format(rank=1, local_rank=1):
            os.makedirs(path, mode=0o700, exist_ok=True)
    return paths


def open_activation_space(cfg: TierConfig, rank: int, local_rank: int, engine, pool) -> tuple[SwapSpace, list]:
    """The swap space of ``[activations] tier = "nvme"``: an "activations" directory under each
    of nvme.paths, an arena of its own (the state's disk bound stays the state's), scratch; and
    the nvme.paths it made (missing where no state is on nvme: the state's space would have made
    them), for `remove_made_dirs` at close."""
    made = []
    paths = _swap_paths(cfg, rank, local_rank)
    for path in paths:  # its parent exists: nvme.check_paths said so
        try:
            os.mkdir(path, mode=0o700)
            made.append(path)
        except FileExistsError:
            pass
    try:
        space = SwapSpace(
            [os.path.join(p, "activations") for p in paths], rank=rank, engine=engine, pool=pool,
            verify=cfg.nvme.verify, fresh=True, keep=False, stripe_size=cfg.nvme.stripe_size,
            stripe_threshold=cfg.nvme.stripe_threshold, grow_step=cfg.nvme.grow_step,
        )  # fmt: skip
    except BaseException:
        remove_made_dirs(made)
        raise
    return space, made


def remove_made_dirs(made) -> None:
    """Remove the directories `open_activation_space` made, where they are empty again."""
    for path in reversed(made):
        try:
            os.rmdir(path)
        except OSError:
            pass  # not empty: something else is there now


def close_io(space, pool, engine, discard: bool = False) -> None:
    """Close the swap space, the pool and the aio engine: all three, whatever fails first
    (the first error is raised after the others are closed). ``discard``: remove the swap
    space's files too (an initialize that failed: its fresh space holds nothing to keep)."""
    try:
        if space is not None:
            space.discard() if discard else space.close()
    finally:
        try:
            if pool is not None:
                pool.close()
        finally:
            if engine is not None:
                engine.close()


# [Note: malloc threshold]
# glibc serves large blocks with mmap and returns them on free, until a large mmapped block is
# freed: then it raises its mmap threshold to that size, and later blocks of that size come
# from the heap, where freed ones stay in the process. An offload engine allocates and frees
# unit-sized tensors (gradients, copies) all the time, so RSS crept to several times what the
# engine holds (measured: 381 MiB against 84 MiB for the same run, tests/infinity/test_memory.py).
# Fixing the threshold at 1 MiB keeps large blocks mmapped, so RSS follows what is held.
# Blocks under it (a 64-token batch's activations of a 2048-wide model are 512 KiB each) come
# from the heap, and free ones inside it stay in the process: glibc returns only the heap's
# top. `trim_malloc` (malloc_trim(0): free pages anywhere in the heaps go back) runs after
# initialize, after a step that ends 16 MiB (`STEP_TRIM_SLACK`) above where the last trimmed
# step ended (each step trimmed, the walk took 5 ms of a 17.8M model's 140 ms step,
# benchmarks/small_layers.py, and the next step faulted the pages in again), and every 512 MiB
# of state while initialize writes it and
# from_pretrained loads it (`TrimEvery`): on the 953M Llama it gave back 240 to 880 MiB each
# time, in about 60 ms.
# The pin must come before the first large free, which raises the threshold for good:
# `infinity.build` makes each module's parameters for real and frees them (a 16 MiB weight
# per Linear(2048, 2048)), so it pins too. Pinned only at initialize, after such a build, the
# unit-sized gradients of backward came from the heap and stayed until the step's trim: the
# peak RSS growth of 48 x Linear(2048, 2048) under a 256 MiB budget was 488 to 621 MiB, and
# is 414 MiB pinned here (benchmarks/rss_bound.py --no-warmup).
_MALLOC_PINNED = False
STEP_TRIM_SLACK = 16 << 20


@functools.cache
def _glibc():
    """glibc's handle, or None where the C library is another or cannot be loaded."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def pin_malloc_threshold() -> None:
    """See [Note: malloc threshold]; once per process, and not where the user set it."""
    global _MALLOC_PINNED
    libc = _glibc()
    if _MALLOC_PINNED or "MALLOC_MMAP_THRESHOLD_" in os.environ or libc is None:
        return
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    # A large free before this call raised the trim threshold with the mmap threshold (to
    # twice the block: glibc's dynamic rule), and pinning the one leaves the other: set it
    # as glibc would for 1 MiB. Then give back what such frees left in the heaps.
    libc.mallopt(-1, 2 << 20)  # M_TRIM_THRESHOLD
    _MALLOC_PINNED = True
    trim_malloc()


class TrimEvery:
    """`trim_malloc` once every ``nbytes`` of work `add`-ed: for long loops (writing the
    initial state, loading a checkpoint) whose freed heap would otherwise pile up to the end."""

    def __init__(self, nbytes: int = 512 << 20):
        self.nbytes, self.done = nbytes, 0

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self.done >= self.nbytes:
            self.done = 0
            trim_malloc()


_TRIM_MARK = 0  # the resident set size when trim_malloc last trimmed, before it did (bytes)


def trim_malloc(unless_within: int = 0) -> None:
    """Give the free pages of glibc's heaps back to the system (see [Note: malloc threshold]);
    with ``unless_within``, only where the resident set is that many bytes above what it was
    at the last trim: a step's own transient memory is faulted in again by the next step, so
    trimming it every step cost the walk of the heaps and the faults, for nothing; what
    piles up from step to step still goes back."""
    global _TRIM_MARK
    libc = _glibc()
    if libc is None:
        return
    if unless_within:
        now = _rss()
        if now - _TRIM_MARK < unless_within:
            return
        _TRIM_MARK = now
    libc.malloc_trim(0)


def _rss() -> int:
    """The process's resident set size now (bytes; 0 where /proc cannot say)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HostBudgetError(ValueError):
    """``memory.host_budget`` is smaller than what the run needs: ``need`` bytes, for ``what``
    ("optimizer step" or "forward/backward"); ``needs`` has every figure (what -> bytes). The
    smallest budget `initialize` accepts for the model and config is ``need``; from
    ``overlap_from`` on, the optimizer runs under backward (None: it cannot, whatever the
    budget; see ``optimizer.overlap`` in docs/config.md)."""

    def __init__(self, message: str, *, need: int, what: str, needs: dict[str, int], overlap_from: int | None = None):
        super().__init__(message)
        self.need, self.what, self.needs, self.overlap_from = need, what, dict(needs), overlap_from


def check_host_budget(cfg: TierConfig, needs: dict[str, int], largest_unit_bytes: int, *,
                      overlap_from: int | None = None) -> None:
    """Refuse a host budget smaller than what the pipelines hold at most (``needs``: what ->
    bytes), naming the largest need and the settings that move it. ``overlap_from`` is passed
    on to the error (`HostBudgetError`)."""
    need, what = max((v, k) for k, v in needs.items())
    if need > cfg.memory.host_budget:
        budget, need_s, unit, group = distinct_sizes(cfg.memory.host_budget, need, largest_unit_bytes,
                                                     cfg.optimizer.sub_group_size)  # fmt: skip
        raise HostBudgetError(
            f"memory.host_budget={budget} is less than the {need_s} the {what} needs with this model and "
            f"config (largest unit {unit} in fp32, optimizer.sub_group_size={group}, "
            f"prefetch.depth={cfg.prefetch.depth}); "
            "raise memory.host_budget, or lower optimizer.sub_group_size, memory.tile_size or prefetch.depth",
            need=need, what=what, needs=needs, overlap_from=overlap_from,
        )  # fmt: skip


def distinct_sizes(*sizes: int) -> list[str]:
    """``human_size`` of each of ``sizes``, except that sizes which differ but would read the
    same ("1.0MiB" twice) are written in bytes: a message never shows two different figures as
    equal (nor, as ``human_size`` never does, one that is not zero as zero)."""
    text = [human_size(n) for n in sizes]
    reads = [t.replace(".0", "") for t in text]  # "1.0GiB" reads as "1GiB" (one decimal at most)
    clash = {r for r in reads if len({n for n, q in zip(sizes, reads) if q == r}) > 1}
    return [f"{n} bytes" if r in clash else t for n, t, r in zip(sizes, text, reads)]


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (what the kernel can give without swapping), or
    None where there is no such file."""
    return proc_bytes("/proc/meminfo", "MemAvailable")


def proc_bytes(path: str, key: str) -> int | None:
    """The ``key:`` line of a /proc file whose figures are in kB (``/proc/meminfo``,
    ``/proc/self/status``), in bytes; None where the file or the line is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(resident: dict[str, int], pool_bytes: int) -> None:
    """Refuse a placement whose state kept in host memory (``resident``: kind -> bytes; the cpu
    tier, and the device tier on a machine without a GPU) plus the pool bytes the pipelines
    need will not fit in the memory the machine has available: an OOM kill later is worse."""
    held = sum(resident.values())
    available = mem_available()
    if available is None or held == 0 or held + pool_bytes <= available:
        return
    parts = ", ".join(f"{kind} {human_size(n)}" for kind, n in resident.items() if n)
    held_s, pool_s, available_s = distinct_sizes(held, pool_bytes, available)
    raise ValueError(
        f"this placement keeps {held_s} in host memory ({parts}) and its host buffers "
        f"need {pool_s} more, but the machine has {available_s} available "
        "(MemAvailable in /proc/meminfo); put more state on nvme ([tiers] params, grads, optimizer "
        '= "nvme"), or free memory'
    )


# Engines not closed yet. A script that ends without engine.close() still gets it at exit:
# manifests are flushed, and the I/O threads and the process group's peers are let go of
# while the interpreter is whole (left to finalization, a 2-rank run aborted in ~1 of 4 exits:
# "terminate called without an active exception").
_OPEN: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(thing) -> None:
    """Have ``thing.close()`` called at exit unless `closed` says it was closed before."""
    _OPEN.add(thing)


def closed(thing) -> None:
    _OPEN.discard(thing)


@atexit.register
def _close_at_exit() -> None:
    for thing in list(_OPEN):
        try:
            thing.close()
        except Exception as e:  # noqa: BLE001 - exiting anyway; say what was not flushed
            logger.warning("closing %s at exit failed: %s", type(thing).__name__, e)
