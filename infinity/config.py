"""The tier config: where parameters, gradients and optimizer state live, and how they move.

One frozen, keyword-only dataclass per section of the file (docs/config.md), each field with a
default, so that an empty file means "everything on the device". Every value is checked when
its section is built, whether it came from `TierConfig.load`, `TierConfig.from_dict` or a
constructor call, and a bad one raises `ValueError` naming its dotted key ("aio.queue_depth"),
because a typo found at step 10,000 of a run costs the run. Sizes accept ints (bytes) or
strings such as "1MiB" and are stored as ints.

This module imports no torch (only the constants of the I/O layer, which load without it), so
launchers and tools can read and check a config cheaply.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
import stat
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

Size = Union[int, str]  # bytes, or "4GiB" / "512MiB" / "64K" / "4096"; stored as int bytes

from infinity.aio import ALIGNMENT, BACKENDS  # O_DIRECT: swap offsets and I/O blocks are whole pages
from infinity.swap import VERIFY_MODES

TIERS = ("device", "cpu", "nvme")
AIO_BACKENDS = ("auto", *BACKENDS)
PARAM_DTYPES = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "adam", "sgd", "adagrad")
STATE_DTYPES = ("fp32", "bf16", "int8")  # infinity._compact's; here so the config loads no torch
ACCUMULATIONS = ("caller", "engine")  # who counts the micro-batches: OptimizerConfig.accumulation
ADAM_STATE_BYTES = 12  # fp32 master weight + exp_avg + exp_avg_sq, per parameter

# The same grammar as nvme-bench's --size, so a figure it prints pastes into a config.
_SHIFTS = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50, "e": 60}
# ASCII: Python's \d takes any script's digits ("１", "١") and IGNORECASE takes the Kelvin sign for k.
_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?)\s*(?:([kmgtpe])(?:i?b)?|b)?", re.IGNORECASE | re.ASCII)


def parse_size(text: str) -> int:
    """Bytes in "1GiB", "64MiB", "128K", "4M", "1.5G", "4096": binary units (KB = KiB, as fio)."""
    m = _SIZE_RE.fullmatch(text.strip())
    if not m:
        ascii_only = "" if text.isascii() else "; only ASCII digits and letters count"
        raise ValueError(f"size {text!r} is not a number with an optional unit (K, M, G, KiB, MiB, ...){ascii_only}")
    number, shift = m.group(1), _SHIFTS[(m.group(2) or "").lower()]
    value = float(number) * (1 << shift) if "." in number else int(number) << shift
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_size(nbytes: int) -> str:
    """The largest binary unit that divides ``nbytes``: "1MiB", "128KiB", "4097"."""
    for unit, shift in (("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


# -- checks, shared by the sections -----------------------------------------------------------
# Each takes the section (to name the key and to store the normalized value) and the field name;
# a frozen dataclass normalizes through object.__setattr__, as dataclasses itself does.
def _key(section: Any, name: str) -> str:
    return f"{section._section}.{name}"


def _type_error(section: Any, name: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"{_key(section, name)}: expected {expected}, got {type(value).__name__} {value!r}")


def _choice(section: Any, name: str, choices: tuple) -> None:
    value = getattr(section, name)
    if not isinstance(value, str):
        raise _type_error(section, name, "a string", value)
    if value not in choices:
        raise ValueError(f"{_key(section, name)}: {value!r} is not one of {', '.join(choices)}")


def _int(section: Any, name: str, lo: int, hi: int | None = None) -> None:
    value = getattr(section, name)
    if isinstance(value, bool) or not isinstance(value, int):  # True is an int to Python, not here
        raise _type_error(section, name, "an int", value)
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{_key(section, name)}: {value} must be {bound}")


def _float(section: Any, name: str, *, lo: float, hi: float | None = None, open_lo: bool = False,
           open_hi: bool = False, none_ok: bool = False) -> None:  # fmt: skip
    value = getattr(section, name)
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(section, name, "a number" + (" or none" if none_ok else ""), value)
    value = float(value)  # TOML's `lr = 1` is an int; a float field takes it
    low_ok = value > lo if open_lo else value >= lo
    high_ok = hi is None or (value < hi if open_hi else value <= hi)
    if not (low_ok and high_ok and math.isfinite(value)):
        lb, rb = "(" if open_lo else "[", ")" if open_hi or hi is None else "]"
        raise ValueError(f"{_key(section, name)}: {value!r} must be in {lb}{lo}, {'inf' if hi is None else hi}{rb}")
    object.__setattr__(section, name, value)


def _size(section: Any, name: str, *, lo: int = 1, multiple: int = 1, none_ok: bool = False) -> None:
    value = getattr(section, name)
    if value is None and none_ok:
        return
    if isinstance(value, str):
        try:
            value = parse_size(value)
        except ValueError as e:
            raise ValueError(f"{_key(section, name)}: {e}") from None
    elif isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(section, name, "a size (int bytes, or a string such as '1MiB')", value)
    if value < lo or value % multiple:
        need = f"at least {lo}" + (f" and a multiple of {multiple}" if multiple > 1 else "")
        raise ValueError(f"{_key(section, name)}: {value} bytes must be {need}")
    object.__setattr__(section, name, value)


_WIDTH = re.compile(r"0?[0-9]{0,2}d?")  # "{rank:03d}": an integer, zero-padded to at most 99 places


def _check_placeholders(key: str, path: str) -> None:
    """``path`` names a directory on every rank: no NUL (no system call takes one) and only
    ``{rank}`` and ``{local_rank}``, at most zero-padded. Any other format spec is refused here,
    where the key can be named: ``{rank:c}`` makes control characters (NUL on rank 0), a huge
    width a MemoryError, ``{rank:%}`` a float."""
    if "\0" in path:
        raise ValueError(f"{key}: {path!r} holds a NUL character, which no path can")
    try:
        fields = [(name, conv, spec) for _, name, spec, conv in string.Formatter().parse(path) if name is not None]
    except ValueError as e:
        raise ValueError(f"{key}: {path!r} has a placeholder other than {{rank}} and {{local_rank}} "
                         f"(ValueError: {e})") from None  # fmt: skip
    for name, conv, spec in fields:
        if name not in ("rank", "local_rank"):
            raise ValueError(f"{key}: {path!r} has a placeholder other than {{rank}} and {{local_rank}}: "
                             f"{{{name}}}")  # fmt: skip
        if conv is not None:
            raise ValueError(f"{key}: {path!r} converts {{{name}}} with !{conv}: write {{{name}}}")
        if not _WIDTH.fullmatch(spec):
            raise ValueError(f"{key}: {path!r} formats {{{name}}} with {spec!r}: only a width of at most 99 "
                             f"places is allowed, zero-padded or not, such as {{{name}:03d}}")  # fmt: skip


# -- the sections -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class TiersConfig:
    """Which tier holds each kind of state between uses (docs/architecture.md)."""

    _section: ClassVar[str] = "tiers"

    params: str = "device"
    """Where the parameters rest between uses: device | cpu | nvme."""
    grads: str = "device"
    """Where the gradients wait for the optimizer step: device | cpu | nvme."""
    optimizer: str = "device"
    """Where the optimizer state (fp32 master weights, Adam moments) lives: device | cpu | nvme."""

    def __post_init__(self) -> None:
        for name in ("params", "grads", "optimizer"):
            _choice(self, name, TIERS)

    @property
    def on_nvme(self) -> tuple[str, ...]:
        """The kinds of state placed on NVMe, e.g. ("params", "optimizer")."""
        return tuple(n for n in ("params", "grads", "optimizer") if getattr(self, n) == "nvme")


@dataclass(frozen=True, kw_only=True, slots=True)
class NvmeConfig:
    """The swap directories and how tensors are laid out in them (infinity.swap.SwapSpace)."""

    _section: ClassVar[str] = "nvme"

    paths: tuple[str, ...] = ()
    """One directory per drive; tensors are striped over all of them. "{rank}" and "{local_rank}"
    are replaced per process (`resolve_paths`). Each rank gets its own subdirectory anyway, so a
    placeholder is only needed to spread ranks over drives. A single string is one path."""
    stripe_size: Size = "1MiB"
    """The unit a striped tensor is cut into over the drives (a multiple of 4096)."""
    stripe_threshold: Size = "8MiB"
    """Tensors of at least this many bytes are striped; smaller ones go whole to one drive."""
    grow_step: Size = "256MiB"
    """The most the arena file on each drive grows (preallocated) by at a time (a multiple of
    4096); a small space grows from 1MiB, doubling, so it takes no more than it holds."""
    verify: str = "always"
    """Every swap write records an xxh3-64 checksum; this says which reads check it: "always"
    every read (parameters, gradients, optimizer states, staged copies, activations), hashed as
    it lands on threads beside the caller's, raising `infinity.swap.SwapCorruption` naming
    the file, tensor and offset before a byte is used; "off" and "checkpoint" (the same) only
    checkpoint loads, which always do: a byte the drive changed then trains on silently."""
    keep: bool = True
    """At close, keep the swap files (their arenas shrunk to the data they hold: swap-inspect
    can read them) or, false, remove them: the swap is scratch, a new engine starts it over."""
    disk_budget: Size | None = None
    """The most bytes this rank's arena may take on each drive of ``paths`` (None: what the
    drive has free). Initialize refuses a state that does not fit it or the free space
    (statvfs); the optimizer under backward stages only what fits, the rest runs after
    backward ([Note: disk footprint] in infinity/_footprint.py)."""

    def __post_init__(self) -> None:
        paths = self.paths
        if isinstance(paths, (str, os.PathLike)):
            paths = (paths,)
        elif not isinstance(paths, (list, tuple)):
            raise _type_error(self, "paths", "a list of directories", paths)
        paths = tuple(os.fspath(p) if isinstance(p, os.PathLike) else p for p in paths)
        seen: dict[str, int] = {}
        for i, p in enumerate(paths):
            if not isinstance(p, str) or not p:
                raise ValueError(f"nvme.paths[{i}]: expected a directory, got {type(p).__name__} {p!r}")
            _check_placeholders(f"nvme.paths[{i}]", p)
            norm = os.path.normpath(p)
            if norm in seen:  # one drive twice would halve its share, and the two locks would clash
                raise ValueError(f"nvme.paths[{i}]: {p!r} repeats nvme.paths[{seen[norm]}]")
            seen[norm] = i
        object.__setattr__(self, "paths", paths)
        _size(self, "stripe_size", multiple=ALIGNMENT)
        _size(self, "stripe_threshold", lo=0)
        _size(self, "grow_step", multiple=ALIGNMENT)
        _size(self, "disk_budget", lo=ALIGNMENT, none_ok=True)
        _choice(self, "verify", VERIFY_MODES)
        if not isinstance(self.keep, bool):
            raise _type_error(self, "keep", "true or false", self.keep)

    def resolve_paths(self, rank: int = 0, local_rank: int = 0) -> tuple[str, ...]:
        """The directories of one process, its placeholders filled in."""
        return tuple(p.format(rank=rank, local_rank=local_rank) for p in self.paths)

    def check_paths(self) -> None:
        """Each directory must exist and be writable, or be missing in a writable directory
        (the swap space creates it, 0700); checked when a tier is on NVMe.

        A path with a placeholder is checked up to the component that holds it: the directories
        below differ per rank and need not exist on this host (rank 5's lives on another node).
        """
        for i, p in enumerate(self.paths):
            parts, fixed = p.split(os.sep), []
            for part in parts:
                if part.format(rank=0, local_rank=0) != part.format(rank=1, local_rank=1):
                    break
                fixed.append(part.format(rank=0, local_rank=0))  # unescapes "{{"
            d = os.sep.join(fixed) or (os.sep if p.startswith(os.sep) else ".")
            what = repr(d) if len(fixed) == len(parts) else f"{d!r} (the fixed part of {p!r})"
            if not os.path.lexists(d) and len(fixed) == len(parts):
                parent = os.path.dirname(os.path.abspath(d))
                if os.path.lexists(parent) and not os.path.isdir(parent):
                    raise ValueError(f"nvme.paths[{i}]: {what} does not exist, and its parent {parent!r} is a file, "
                                     "not a directory")  # fmt: skip
                if not os.path.isdir(parent):
                    raise ValueError(f"nvme.paths[{i}]: {what} does not exist, nor does its parent {parent!r}")
                if not os.access(parent, os.W_OK | os.X_OK):
                    raise ValueError(f"nvme.paths[{i}]: {what} does not exist and {parent!r} is not writable")
                continue  # created when the swap space opens
            if not os.path.isdir(d):
                raise ValueError(f"nvme.paths[{i}]: {what} is not a directory")
            if not os.access(d, os.W_OK | os.X_OK):
                raise ValueError(f"nvme.paths[{i}]: {what} is not writable")


@dataclass(frozen=True, kw_only=True, slots=True)
class AioConfig:
    """The async I/O engine (infinity.aio.open_engine); nvme-bench prints a tuned section."""

    _section: ClassVar[str] = "aio"

    backend: str = "auto"
    """auto (io_uring where it works, else threads, logged once) | uring (an error where it cannot
    run) | threads."""
    block_size: Size = "4MiB"
    """Requests are cut into chunks of this many bytes (a multiple of 4096, at most 1GiB).
    4MiB: the optimizer step kept this machine's drive busier than with 1MiB (docs/config.md)."""
    queue_depth: int = 32
    """Chunks in flight at once, per engine (1..4096)."""

    def __post_init__(self) -> None:
        _choice(self, "backend", AIO_BACKENDS)
        _size(self, "block_size", lo=ALIGNMENT, multiple=ALIGNMENT)
        if self.block_size > 1 << 30:
            raise ValueError(f"aio.block_size: {format_size(self.block_size)} is more than 1GiB")
        _int(self, "queue_depth", 1, 4096)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConfig:
    """Host memory."""

    _section: ClassVar[str] = "memory"

    host_budget: Size = "4GiB"
    """All host buffers the engine may hold, pinned or not: reads from and writes to NVMe, the
    optimizer's streamed sub-groups, gradients gathered on a CPU device. The cpu tier's own
    tensors are not in it: initialize checks them against the memory the machine has available."""
    tile_size: Size | None = "32MiB"
    """An ``nn.Linear`` or ``nn.Embedding`` whose fp32 parameters are larger than this (a
    vocabulary-sized embedding or output layer) is split by rows into tiles of at most this
    size, each stored, fetched, updated and released on its own, and computed tile by tile;
    so no buffer the engine holds is larger. Only where some tier is not the device. None: no
    tiles."""

    device_budget: Size | None = None
    """Parameters the compute device may keep between a unit's forward and its backward, so
    that backward does not fetch them again ([Note: kept for backward] in
    infinity/_schedule.py). None: on a GPU half of what it has free at initialize, counting
    what torch's caching allocator holds unused (the rest for activations and the units in
    use); with the compute on the host, no bound beyond
    ``host_budget``, whose pool buffers the kept units are. 0: none kept."""

    keep_params: bool = True
    """With the parameters on nvme, the pool buffers they were read into or written from stay in
    the pool between uses, while ``host_budget`` has room no other buffer needs (any acquire
    takes theirs first), and the next fetch of unchanged bytes uses them instead of reading
    the drive ([Note: parameters kept in the pool] in infinity/_param_cache.py). False: every
    fetch reads the drive."""

    def __post_init__(self) -> None:
        _size(self, "host_budget")
        _size(self, "tile_size", lo=4096, none_ok=True)
        _size(self, "device_budget", lo=0, none_ok=True)
        if not isinstance(self.keep_params, bool):
            raise _type_error(self, "keep_params", "true or false", self.keep_params)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefetchConfig:
    """How far ahead of the compute parameters are brought in."""

    _section: ClassVar[str] = "prefetch"

    depth: int = 2
    """Modules ahead of the one running (0: fetch each on use)."""
    bytes: Size | None = None
    """A byte budget ahead, when set; prefetch stops at whichever of the two limits comes first."""
    keep: bool = True
    """Keep the units forward used last for backward, as far as memory.device_budget and (the
    compute on the host) memory.host_budget allow, instead of fetching them again ([Note: kept
    for backward] in infinity/_schedule.py). False: backward fetches every unit again."""

    def __post_init__(self) -> None:
        _int(self, "depth", 0)
        _size(self, "bytes", none_ok=True)
        if not isinstance(self.keep, bool):
            raise _type_error(self, "keep", "true or false", self.keep)


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationsConfig:
    """Where the tensors autograd saves for backward wait (with activation checkpointing: each
    block's inputs), [Note: activations offloaded] in infinity/_activations.py."""

    _section: ClassVar[str] = "activations"

    tier: str = "device"
    """"device": where the compute made them (PyTorch's own behaviour). "cpu": copied to pinned
    host tensors of their own on a GPU (beside the budget, as the cpu tier's state); on a CPU
    device they are in host memory already and stay. "nvme": written, in chunks through the
    host pool, to a swap space of their own under each of nvme.paths (an "activations"
    directory), read back ahead of backward."""
    min_bytes: Size = "1MiB"
    """Saved tensors smaller than this stay where they are (moving them costs more than it saves)."""
    depth: int = 2
    """Saved tensors read ahead in backward, beyond the one needed now."""

    def __post_init__(self) -> None:
        _choice(self, "tier", TIERS)
        _size(self, "min_bytes", lo=0)
        _int(self, "depth", 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionConfig:
    """The dtype the model computes in, and fp16's dynamic loss scaling (as torch's GradScaler)."""

    _section: ClassVar[str] = "precision"

    param_dtype: str = "fp32"
    """bf16 | fp16 | fp32: parameters and gradients in compute; the optimizer keeps fp32."""
    initial_scale: float = 2.0**16
    """fp16 only: the first loss scale."""
    growth_interval: int = 1000
    """fp16 only: steps without an overflow before the scale grows."""
    min_scale: float = 1.0
    """fp16 only: the scale never backs off below this (at most initial_scale)."""
    backoff_factor: float = 0.5
    """fp16 only: the scale is multiplied by this on an overflow (in (0, 1))."""
    growth_factor: float = 2.0
    """fp16 only: the scale is multiplied by this after growth_interval clean steps (> 1)."""
    hysteresis: int = 1
    """fp16 only: the overflows (each a skipped step) it takes to back the scale off; 1, torch's
    GradScaler: every one. DeepSpeed's ``fp16.hysteresis`` (2 by default there): the count is
    renewed when the scale grows (or, with ``consecutive_hysteresis``, at every clean step)."""
    consecutive_hysteresis: bool = False
    """fp16 only: renew the hysteresis count at every clean step, not only when the scale grows."""
    stop_at_min_scale: bool = False
    """fp16 only: an overflow with the scale at min_scale (its hysteresis spent) raises, once
    the skipped step is counted, instead of skipping on, as DeepSpeed stops its run there; a
    DeepSpeed config sets it."""
    deepspeed_growth: bool = False
    """fp16 only: the scale grows as DeepSpeed's loss scaler grows it, at the clean step after
    growth_interval clean ones since the last overflow (or the start), then every
    growth_interval: one step after torch's GradScaler, which grows at the growth_interval-th;
    a DeepSpeed config sets it."""

    def __post_init__(self) -> None:
        _choice(self, "param_dtype", PARAM_DTYPES)
        _int(self, "hysteresis", 1)
        for key in ("consecutive_hysteresis", "stop_at_min_scale", "deepspeed_growth"):
            if not isinstance(getattr(self, key), bool):
                raise _type_error(self, key, "true or false", getattr(self, key))
        _float(self, "initial_scale", lo=0.0, open_lo=True)
        _int(self, "growth_interval", 1)
        _float(self, "min_scale", lo=0.0, hi=self.initial_scale, open_lo=True)
        _float(self, "backoff_factor", lo=0.0, hi=1.0, open_lo=True, open_hi=True)
        _float(self, "growth_factor", lo=1.0, open_lo=True)

    @property
    def torch_dtype(self):
        """The torch.dtype of param_dtype (torch is imported here, not with the module)."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.param_dtype]

    @property
    def loss_scaling(self) -> bool:
        """Whether the loss is scaled: fp16 only, whose range underflows small gradients."""
        return self.param_dtype == "fp16"


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer the engine runs where its states live, one sub-group of parameters at a
    time. These are its defaults; parameter groups given to `initialize` override them."""

    _section: ClassVar[str] = "optimizer"

    type: str = "adamw"
    """adamw, adam, sgd or adagrad (torch.optim's semantics, torch's fused CPU kernels)."""
    lr: float = 1e-4
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's decay rates of the first and second moments, each in [0, 1)."""
    eps: float = 1e-8
    """Added to the denominator (> 0)."""
    weight_decay: float = 0.01
    """Weight decay: decoupled for adamw, added to the gradient (L2) for the others."""
    momentum: float = 0.0
    """SGD's momentum (0: none)."""
    nesterov: bool = False
    """SGD: Nesterov momentum (needs momentum > 0)."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm to this, when set."""
    sub_group_size: Size = "128MiB"
    """Bytes of fp32 optimizer state (12 a parameter: master weight and two moments) that one
    step of the optimizer holds in host memory at a time."""
    gradient_accumulation_steps: int = 1
    """Micro-batches (backward passes) per optimizer step. The last one's backward runs the
    update of each sub-group whose gradients are final (see ``overlap``); a step after more or
    fewer backward passes is still exact, only not overlapped."""
    accumulation: str = "caller"
    """Who counts the micro-batches: ``"caller"``, the training loop (`step` updates at every
    call, as a torch optimizer does; the loop calls it once per ``gradient_accumulation_steps``
    micro-batches and scales the loss itself); ``"engine"``, DeepSpeed's engine semantics
    (`backward` divides the loss by ``gradient_accumulation_steps``, and `step`, called after
    every micro-batch, updates on every ``gradient_accumulation_steps``-th call only). A
    DeepSpeed config means ``"engine"``; InfinityTrainer sets ``"caller"`` (the Trainer counts)."""
    overlap: bool | str = "auto"
    """Update sub-groups during the last micro-batch's backward, as their gradients become
    final, into staged copies that the step commits, or discards when the step turns out to
    clip, skip (a non-finite gradient) or change hyperparameters: then it updates
    sequentially. Results are the same either way. ``true``: wherever it applies (the optimizer
    states on nvme, or in host memory); ``"auto"``: where it can gain, which excludes states
    in host memory updated on the cores backward computes on (see docs/config.md); ``false``:
    never."""
    overlap_disk: float = 0.3
    """The disk the overlap's staged copies may take on each drive beside the state, as a
    fraction of the state there: each arena stays within (1 + overlap_disk) x its state. The
    sub-groups past it are updated after backward (the same numbers); 0.8 stages every
    sub-group of an fp32 AdamW with every tier on nvme ([Note: disk footprint] in
    infinity/_footprint.py)."""
    state_dtype: str = "fp32"
    """How the algorithm's own states (Adam's moments, SGD's momentum buffer, Adagrad's sum) are
    stored: fp32 (4 bytes an element), bf16 (2, stochastically rounded) or int8 (1, plus one fp32
    scale per 256 elements: blockwise dynamic quantisation). The master weights stay fp32;
    updates run in fp32 on decoded copies ([Note: compact state format] in infinity/_compact.py)."""

    def __post_init__(self) -> None:
        _choice(self, "type", OPTIMIZERS)
        _choice(self, "state_dtype", STATE_DTYPES)
        _float(self, "lr", lo=0.0)
        _float(self, "momentum", lo=0.0)
        if not isinstance(self.nesterov, bool):
            raise _type_error(self, "nesterov", "true or false", self.nesterov)
        if self.nesterov and self.momentum <= 0:
            raise ValueError(f"optimizer.nesterov: needs optimizer.momentum > 0, got {self.momentum}")
        betas = self.betas
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise _type_error(self, "betas", "two numbers", betas)
        for i, b in enumerate(betas):
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
                raise ValueError(f"optimizer.betas[{i}]: expected a number in [0, 1), got {type(b).__name__} {b!r}")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        _float(self, "eps", lo=0.0, open_lo=True)
        _float(self, "weight_decay", lo=0.0)
        _float(self, "max_grad_norm", lo=0.0, open_lo=True, none_ok=True)
        _size(self, "sub_group_size", lo=ADAM_STATE_BYTES)
        _int(self, "gradient_accumulation_steps", lo=1)
        _choice(self, "accumulation", ACCUMULATIONS)
        if not isinstance(self.overlap, bool) and self.overlap != "auto":
            raise _type_error(self, "overlap", 'true, false or "auto"', self.overlap)
        _float(self, "overlap_disk", lo=0.0)

    @property
    def sub_group_numel(self) -> int:
        """Parameters per optimizer sub-group."""
        return self.sub_group_size // ADAM_STATE_BYTES


@dataclass(frozen=True, kw_only=True, slots=True)
class PartitionConfig:
    """ZeRO partitioning across data-parallel ranks."""

    _section: ClassVar[str] = "partition"

    stage: int = 3
    """1: optimizer state partitioned; 2: and gradients; 3: and parameters."""

    timeout: int = 300
    """Seconds a collective may wait for the other ranks before failing (naming a rank that
    reported a failure): a rank that dies cannot leave the others hanging forever."""

    def __post_init__(self) -> None:
        _int(self, "stage", 1, 3)
        _int(self, "timeout", 1, 24 * 3600)

    @property
    def partition_grads(self) -> bool:
        """Whether each rank keeps only its shard of the gradients."""
        return self.stage >= 2

    @property
    def partition_params(self) -> bool:
        """Whether each rank keeps only its shard of the parameters between uses."""
        return self.stage == 3


# -- the whole config -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class TierConfig:
    """The whole tier config: one field per section of the file."""

    tiers: TiersConfig = field(default_factory=TiersConfig)
    """[tiers]: where each kind of state rests."""
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    """[nvme]: the swap directories, used when a tier is "nvme"."""
    aio: AioConfig = field(default_factory=AioConfig)
    """[aio]: the I/O engine."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """[memory]: the host memory budget."""
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    """[prefetch]: how far ahead parameters are fetched."""
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    """[activations]: where saved activations wait for backward."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """[precision]: the compute dtype and fp16 loss scaling."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """[optimizer]: AdamW's settings."""
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    """[partition]: the ZeRO stage."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, _SECTIONS[f.name]):
                raise ValueError(f"{f.name}: expected a {_SECTIONS[f.name].__name__}, got {type(value).__name__}")
        # Paths are checked only when something will be swapped to them: a config that names
        # drives but keeps every tier on device or cpu runs on a host without those drives.
        if self.tiers.on_nvme or self.activations.tier == "nvme":
            if not self.nvme.paths:
                what = f"tiers.{self.tiers.on_nvme[0]}" if self.tiers.on_nvme else "activations.tier"
                raise ValueError(f"nvme.paths: empty, but {what} is 'nvme'")
            self.nvme.check_paths()

    @classmethod
    def from_dict(cls, data: dict) -> TierConfig:
        """Sections as nested dicts, the shape of the TOML/JSON file; missing keys keep defaults."""
        if not isinstance(data, dict):
            raise ValueError(f"a tier config is a table of sections, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_SECTIONS))
        if unknown:
            raise ValueError(f"unknown section {unknown[0]!r} (known: {', '.join(_SECTIONS)})")
        return cls(**{name: _build(_SECTIONS[name], name, values) for name, values in data.items()})

    def to_dict(self) -> dict:
        """Plain, JSON-able dicts (sizes in bytes, tuples as lists); `from_dict` takes it back."""
        out = {}
        for name in _SECTIONS:
            section = getattr(self, name)
            out[name] = {f.name: _plain(getattr(section, f.name)) for f in dataclasses.fields(section)}
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> TierConfig:
        """Read a .toml or .json file; another name is tried as TOML, then JSON."""
        path = os.fspath(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO is not waited on
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "tier config file not found", path) from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # /dev/null would read as an empty file: every default
            os.close(fd)
            kind = _FILE_KINDS.get(stat.S_IFMT(mode), "a special file")
            raise ValueError(f"{path}: is {kind}, not a regular file: a tier config is a .toml or .json file")
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
        ext = os.path.splitext(path)[1].lower()
        formats = {".toml": ("TOML",), ".json": ("JSON",)}.get(ext, ("TOML", "JSON"))
        errors = []
        for fmt in formats:
            try:
                data = _loads_toml(raw) if fmt == "TOML" else _loads_json(raw)
                break
            except json.JSONDecodeError as e:
                where = "the file is empty" if not raw.strip() else f"{e.msg} (at line {e.lineno}, column {e.colno})"
                errors.append(f"not valid JSON: {where}")
            except ValueError as e:  # TOMLDecodeError says "(at line 3, column 9)"; bad UTF-8 too
                errors.append(f"not valid {fmt}: {e}")
            except RecursionError:
                errors.append(f"not valid {fmt}: nested too deeply")
        else:
            hint = "" if len(formats) == 1 else "; a tier config is TOML (.toml) or JSON (.json)"
            raise ValueError(f"{path}: {' and '.join(errors)}{hint}")
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_deepspeed(cls, source, *, training_args=None, base=None) -> TierConfig:
        """The tier config a DeepSpeed config means: ``source`` is its dict or the path to its
        JSON file (``ds_config.json``). Each key is mapped, ignored or refused as the table in
        docs/config.md says (an unknown key is refused, naming it). ``training_args``
        (transformers' TrainingArguments) fills the ``"auto"`` values as transformers does;
        without it an ``"auto"`` keeps this config's default. ``base``: the tier config (or its
        dict) for what DeepSpeed has no key for, such as ``memory.host_budget``. Its
        ``scheduler`` is `infinity.deepspeed_lr_scheduler`'s."""
        from ._deepspeed import to_tier_config

        return to_tier_config(source, training_args=training_args, base=base)

    def replace(self, **sections: Any) -> TierConfig:
        """A copy with sections replaced: by instances, or by dicts of the keys to change
        (`config.replace(optimizer={"lr": 3e-4})` keeps the other optimizer keys)."""
        new = {}
        for name, value in sections.items():
            if name not in _SECTIONS:
                raise ValueError(f"unknown section {name!r} (known: {', '.join(_SECTIONS)})")
            if isinstance(value, dict):
                value = _build(_SECTIONS[name], name, {**self.to_dict()[name], **value})
            new[name] = value
        return dataclasses.replace(self, **new)


_SECTIONS: dict[str, type] = {
    "tiers": TiersConfig, "nvme": NvmeConfig, "aio": AioConfig, "memory": MemoryConfig,
    "prefetch": PrefetchConfig, "activations": ActivationsConfig, "precision": PrecisionConfig, "optimizer": OptimizerConfig,
    "partition": PartitionConfig,
}  # fmt: skip


def _build(cls: type, name: str, values: Any) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"{name}: expected a table of keys, got {type(values).__name__} {values!r}")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown key '{name}.{unknown[0]}' (known: {', '.join(known)})")
    return cls(**values)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


_FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
               stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}  # fmt: skip


def _loads_json(raw: bytes) -> Any:
    """JSON that refuses a key twice in one table, as TOML does (json keeps the last silently)."""
    twice: list[tuple[dict, str]] = []

    def unique(pairs: list) -> dict:
        table = dict(pairs)
        if len(table) != len(pairs) and not twice:
            keys = [k for k, _ in pairs]
            twice.append((table, next(k for i, k in enumerate(keys) if k in keys[:i])))
        return table

    data = json.loads(raw, object_pairs_hook=unique)
    if twice:  # the hook sees a table before its parent: name the section once the parent exists
        table, key = twice[0]
        section = next((f"{name}." for name, v in data.items() if v is table), "") if isinstance(data, dict) else ""
        raise ValueError(f"key '{section}{key}' appears twice")
    return data


def _loads_toml(raw: bytes) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: tomli is the same parser, before it entered the stdlib
        try:
            import tomli as tomllib
        except ImportError:
            raise ModuleNotFoundError("reading TOML needs Python >= 3.11 or tomli; JSON needs neither") from None
    return tomllib.loads(raw.decode("utf-8"))
