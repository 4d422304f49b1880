"""The manifest of a swap space: what each rank directory holds, as JSON, written atomically.

One manifest per rank, in the rank directory of the space's first directory (the primary).
Other directories' rank directories hold only arena files and a ``space.json`` that names the
space, so a directory that belongs to another space is recognised. Everything a path in a
manifest names is relative to a rank directory: the loader refuses anything else (absolute
paths, separators, ``..``), so a tampered manifest cannot point the engine outside it.

[Note: checksums]
Every write of a tensor records the xxh3-64 of its bytes, whatever the space's ``verify`` says
(that says only when reads check them). A version-2 manifest (what this code writes) therefore
has a checksum for every tensor, and a record without one is damage: the loader refuses it,
naming the tensor and the manifest. Version 1 (older infinity) wrote checksums only where asked;
its records without one load only for a reader that says it accepts unchecked tensors
(``allow_unchecked=True``: swap-inspect, which then reports them as not verified).
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from itertools import accumulate

import torch
from infinity.aio._files import file_kind, open_regular

FORMAT = "infinity-swap"
VERSION = 2  # of the manifest; see [Note: checksums]
READ_VERSIONS = (1, 2)  # manifests this code reads
SPACE_VERSION = 1  # of space.json, unchanged since version 1
MANIFEST_NAME = "manifest.json"
SPACE_NAME = "space.json"

_FILE_NAME = re.compile(r"arena-[0-9]{1,6}\.bin")

DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )  # fmt: skip
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"dtype {dtype} cannot be swapped (supported: {', '.join(DTYPES)})")
    return name


class ManifestError(ValueError):
    """A manifest or space.json that cannot be trusted: unknown version, bad field, escaping path."""


@dataclass(frozen=True, slots=True)
class ArenaFile:
    """One preallocated arena file: ``name`` inside the rank directory of directory ``dir``."""

    dir: int
    name: str
    size: int


@dataclass(frozen=True, slots=True)
class Extent:
    """``nbytes`` of a tensor's bytes at ``offset`` in arena file ``file`` (an index into
    `Manifest.files`). The allocation behind it is ``nbytes`` rounded up to the alignment."""

    file: int
    offset: int
    nbytes: int


@dataclass(slots=True)
class TensorRecord:
    """One swapped tensor: its bytes are the concatenation of its extents, in order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    extents: tuple[Extent, ...]
    generation: int = 0  # times written
    checksum: str | None = None  # "xxh3-64:<16 hex digits>" of the nbytes; None only in version 1

    @property
    def kind(self) -> str:
        """The state kind: the part of the name after its last "/" ("param", "exp_avg"...)."""
        return self.name.rsplit("/", 1)[1] if "/" in self.name else ""


@dataclass(slots=True)
class Manifest:
    space_id: str
    rank: int
    directories: int  # stripe members; member k is the space's k-th directory
    alignment: int
    generation: int = 0  # bumped by every write of the manifest
    version: int = VERSION  # as read (1 or 2); every write is VERSION
    # Absolute path of each member's rank directory when last opened. Informational, for tools
    # (swap-inspect); a SwapSpace trusts the directories its caller gives, and a tool trusts a
    # member only if its space.json names this space. Arena paths stay relative (file names).
    members: list[str] = field(default_factory=list)
    files: list[ArenaFile] = field(default_factory=list)
    tensors: dict[str, TensorRecord] = field(default_factory=dict)

    # -- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "space_id": self.space_id,
            "rank": self.rank,
            "directories": self.directories,
            "alignment": self.alignment,
            "generation": self.generation,
            "members": list(self.members),
            "files": [{"dir": f.dir, "name": f.name, "size": f.size} for f in self.files],
            "tensors": {
                t.name: {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "nbytes": t.nbytes,
                    "extents": [[e.file, e.offset, e.nbytes] for e in t.extents],
                    "generation": t.generation,
                    "checksum": t.checksum,
                }
                for t in self.tensors.values()
            },
        }

    def unchecked(self) -> list[str]:
        """Names of the tensors without a checksum (only a version-1 manifest has any)."""
        return [t.name for t in self.tensors.values() if t.checksum is None]

    @classmethod
    def from_json(cls, data, source: str, *, allow_unchecked: bool = False) -> "Manifest":
        """Validate everything a reader will rely on; raise ManifestError naming the field.

        A tensor without a checksum is refused (see [Note: checksums]), except in a version-1
        manifest read with ``allow_unchecked``."""
        check = _Checker(source)
        version = check.header(data, READ_VERSIONS)
        m = cls(
            space_id=check.typed(data, "space_id", str),
            rank=check.count(data, "rank"),
            directories=check.count(data, "directories", minimum=1),
            alignment=check.count(data, "alignment", minimum=1),
            generation=check.count(data, "generation"),
            version=version,
        )
        if m.alignment & (m.alignment - 1):
            check.fail("alignment", f"{m.alignment} is not a power of two")
        members = check.typed(data, "members", list)
        if len(members) != m.directories or not all(
            isinstance(p, str) and os.path.isabs(p) and os.path.normpath(p) == p for p in members
        ):
            check.fail("members", f"{members!r} is not {m.directories} absolute, normalised directory paths")
        m.members = members
        m.files = _check_files(check, check.typed(data, "files", list), m.directories)
        for name, t in check.typed(data, "tensors", dict).items():
            m.tensors[name] = _check_tensor(check, name, t, m, allow_unchecked)
        return m


def _check_files(check: "_Checker", files: list, directories: int) -> list[ArenaFile]:
    out = []
    for i, f in enumerate(files):
        key = f"files[{i}]"
        f = check.typed({key: f}, key, dict)
        out.append(
            ArenaFile(
                dir=check.count(f, "dir", where=key, maximum=directories - 1),
                name=check.file_name(check.typed(f, "name", str, where=key), f"{key}.name"),
                size=check.count(f, "size", where=key),
            )
        )
    if len({(f.dir, f.name) for f in out}) != len(out):
        check.fail("files", "the same arena file is listed twice")
    return out


def _check_tensor(check: "_Checker", name: str, t, m: Manifest, allow_unchecked: bool) -> TensorRecord:
    """One entry of ``tensors``: its dtype, shape and size agree, its extents lie in the
    manifest's files, aligned (see [Note: swap alignment]), holding exactly its bytes, and it
    has a checksum (see [Note: checksums])."""
    key = f"tensors[{name!r}]"
    t = check.typed({key: t}, key, dict)
    dtype = check.typed(t, "dtype", str, where=key)
    if dtype not in DTYPES:
        check.fail(f"{key}.dtype", f"unknown dtype {dtype!r}")
    shape = tuple(check.typed(t, "shape", list, where=key))
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        check.fail(f"{key}.shape", f"{list(shape)} is not a list of sizes")
    nbytes = check.count(t, "nbytes", where=key)
    numel = 1
    for d in shape:
        numel *= d
    if numel * DTYPES[dtype].itemsize != nbytes:
        check.fail(f"{key}.nbytes", f"{nbytes} is not {list(shape)} x {dtype}")
    extents = _check_extents(check, key, check.typed(t, "extents", list, where=key), m)
    if sum(e.nbytes for e in extents) != nbytes:
        check.fail(f"{key}.extents", f"extents hold {sum(e.nbytes for e in extents)} bytes, not {nbytes}")
    checksum = t.get("checksum")
    if checksum is None:
        if m.version >= 2:
            check.fail(f"{key}.checksum", f"missing: a version-{m.version} manifest records a checksum for every "
                       "tensor, so this one is damaged (its bytes cannot be trusted)")  # fmt: skip
        if not allow_unchecked:
            check.fail(f"{key}.checksum", "none recorded (a version-1 manifest, written without checksums), so the "
                       "tensor cannot be verified; only a reader that accepts unchecked tensors opens it")  # fmt: skip
    elif not (isinstance(checksum, str) and re.fullmatch(r"xxh3-64:[0-9a-f]{16}", checksum)):
        check.fail(f"{key}.checksum", f"{checksum!r} is not 'xxh3-64:<16 hex digits>'")
    return TensorRecord(
        name=name, dtype=dtype, shape=shape, nbytes=nbytes, extents=tuple(extents),
        generation=check.count(t, "generation", where=key), checksum=checksum,
    )  # fmt: skip


def _check_extents(check: "_Checker", key: str, entries: list, m: Manifest) -> list[Extent]:
    extents = []
    for j, e in enumerate(entries):
        ekey = f"{key}.extents[{j}]"
        if not (isinstance(e, list) and len(e) == 3 and all(isinstance(v, int) and v >= 0 for v in e)):
            check.fail(ekey, f"{e!r} is not [file, offset, nbytes]")
        if e[0] >= len(m.files):
            check.fail(ekey, f"file index {e[0]} is not in files (0..{len(m.files) - 1})")
        if e[1] % m.alignment:
            check.fail(ekey, f"offset {e[1]} is not a multiple of the alignment {m.alignment}")
        if extents and extents[-1].nbytes % m.alignment:  # see [Note: swap alignment]
            check.fail(ekey, f"follows an extent of {extents[-1].nbytes} bytes, not whole units")
        extents.append(Extent(*e))
    return extents


class _Checker:
    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, why: str):
        raise ManifestError(f"{self.source}: {key}: {why}")

    def header(self, data, versions: tuple[int, ...]) -> int:
        if not isinstance(data, dict):
            raise ManifestError(f"{self.source}: not a JSON object")
        if data.get("format") != FORMAT:
            self.fail("format", f"{data.get('format')!r} is not {FORMAT!r}: not an infinity swap manifest")
        version = data.get("version")
        if type(version) is not int or version not in versions:
            known = " and ".join(map(str, versions))
            self.fail("version", f"unknown version {version!r} (this infinity reads version {known})")
        return version

    def typed(self, data: dict, key: str, kind: type, where: str = ""):
        full = f"{where}.{key}" if where else key
        if key not in data:
            self.fail(full, "missing")
        value = data[key]
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            self.fail(full, f"{value!r} is not a {kind.__name__}")
        return value

    def count(self, data: dict, key: str, where: str = "", minimum: int = 0, maximum: int | None = None) -> int:
        value = self.typed(data, key, int, where)
        if value < minimum or (maximum is not None and value > maximum):
            full = f"{where}.{key}" if where else key
            self.fail(full, f"{value} is out of range [{minimum}, {maximum if maximum is not None else '...'}]")
        return value

    def file_name(self, name: str, key: str) -> str:
        # Only names the space itself makes: no separator, no "..", nothing absolute.
        if not _FILE_NAME.fullmatch(name):
            self.fail(key, f"{name!r} is not an arena file name (arena-N.bin): a manifest may not point outside its directory")
        return name


def arena_name(index: int) -> str:
    return f"arena-{index}.bin"


def is_space_file(name: str) -> bool:
    """Whether ``name`` (in a rank directory) is a file a swap space makes."""
    return name in (MANIFEST_NAME, SPACE_NAME, LOCK_NAME) or bool(_FILE_NAME.fullmatch(name)) or (
        name.startswith(f".{MANIFEST_NAME}.") or name.startswith(f".{SPACE_NAME}.")
    )


LOCK_NAME = ".lock"


# [Note: atomic manifest]
# A manifest is replaced, never edited: the new one is written to a temporary file in the same
# directory, fsynced, renamed over the old one, and the directory is fsynced so the rename
# itself is durable. A crash before the rename leaves the old manifest (and a stray temporary
# file, which the next write replaces and `is_space_file` accepts); after it, the new one.
def write_json_atomic(path: str, data: dict, *, before_rename=None) -> None:
    """Write ``data`` as JSON to ``path`` atomically (see [Note: atomic manifest]).

    ``before_rename`` is a hook for tests that simulate a crash at that point.
    """
    text = json.dumps(data, separators=(",", ":")) + "\n"  # compact: swap-inspect is the human view
    write_bytes_atomic(path, text.encode(), before_rename=before_rename)


def write_bytes_atomic(path: str, data: bytes, *, before_rename=None) -> None:
    """Replace ``path`` by a file (0600) holding ``data``, as [Note: atomic manifest] says."""
    directory, base = os.path.split(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise OSError(e.errno, f"cannot create a temporary file to write {base}: {e.strerror}", path) from None
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
        except OSError as e:  # ENOSPC, EIO: say which file (the temporary one is removed below)
            raise OSError(e.errno, f"cannot write {len(data)} bytes: {e.strerror}", path) from None
        if before_rename is not None:
            before_rename(tmp)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    """Make the entries of ``directory`` (a rename into it, say) durable."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


MAX_JSON_DEPTH = 100  # arrays and objects; a manifest nests 5 deep, meta.json about as deep as its client_state
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def read_json(path: str):
    """The JSON value in the regular file ``path``: what every reader of the swap and checkpoint
    formats parses with. ManifestError names the path and the cause for anything else: not a
    regular file (a FIFO is not waited on), bytes that are not UTF-8 (at which offset), invalid
    JSON (line and column), a key twice in one object, nesting deeper than MAX_JSON_DEPTH."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # meta.json is read without `require_regular`
        os.close(fd)
        raise ManifestError(f"{path}: is {file_kind(mode)}, not a regular file")
    with os.fdopen(fd, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: not UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start}") from None
    return parse_json(text, path)


def parse_json(text: str, path: str):
    """``text`` parsed as `read_json` parses a file (``path`` names it, or what ``text`` is, in
    errors): writers check with it that what they write will read back."""

    def unique(pairs: list) -> dict:
        obj = dict(pairs)
        if len(obj) != len(pairs):  # json keeps the last silently; a tampered file may count on that
            seen = set()
            for key, _ in pairs:
                if key in seen:
                    raise ManifestError(f"{path}: key {key!r} appears twice in one object")
                seen.add(key)
        return obj

    too_deep = f"{path}: nested more than {MAX_JSON_DEPTH} levels deep"
    try:
        data = json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON: {e.msg} (at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ManifestError(too_deep) from None
    # Valid JSON, so every bracket outside a string opens or closes a level.
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    if max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) > MAX_JSON_DEPTH:
        raise ManifestError(too_deep)
    return data


def require_regular(path: str) -> None:
    """Raise OSError naming ``path`` unless it is a regular file (not a symlink, a FIFO that
    would block the reader forever, a device...): checked through an O_NOFOLLOW, non-blocking
    open and fstat (`infinity.aio._files.open_regular`). ``read_json`` then opens it by name."""
    os.close(open_regular(path, os.O_RDONLY | os.O_CLOEXEC))


def load_manifest(path: str, *, allow_unchecked: bool = False) -> Manifest:
    """The manifest at ``path``, checked (`Manifest.from_json`)."""
    require_regular(path)
    return Manifest.from_json(read_json(path), path, allow_unchecked=allow_unchecked)


def space_json(space_id: str, rank: int, member: int, directories: int) -> dict:
    return {"format": FORMAT, "version": SPACE_VERSION, "space_id": space_id, "rank": rank, "member": member,
            "directories": directories}  # fmt: skip


def load_space_json(path: str) -> dict:
    require_regular(path)
    data = read_json(path)
    check = _Checker(path)
    check.header(data, (SPACE_VERSION,))
    check.typed(data, "space_id", str)
    for key in ("rank", "member", "directories"):
        check.count(data, key)
    return data
