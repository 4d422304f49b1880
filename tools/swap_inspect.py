"""swap-inspect: what a swap space holds on disk, and whether its bytes still match their checksums.

Everything is read through `SpaceReader` (the manifest, the members' space.json, the tensors
through the aio engine), so the tool trusts exactly what the engine's resume would trust. It
takes no lock and writes nothing: it may look at a space that a running engine holds.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys

import torch

from infinity import aio
from infinity._saved import rank_misplaced, rank_missing
from infinity.checkpoint import LATEST_NAME, META_NAME, TMP_PREFIX, load_meta
from infinity.checkpoint import resolve as resolve_checkpoint
from infinity.swap import (
    LOCK_NAME,
    MANIFEST_NAME,
    SPACE_NAME,
    ManifestError,
    SpaceReader,
    human_size,  # sizes for people (the tests import it from here too)
    is_space_file,
)
from infinity.tools._cli import BadInput, Progress


# -- finding and opening ranks ----------------------------------------------------------------
def find_ranks(directory: str) -> list[str]:
    """The rank directories DIR stands for: DIR itself or its immediate subdirectories that
    hold a manifest; for a checkpoint root (a ``latest`` file), those of the checkpoint it
    names. Every layout the tool understands is recognised here, and only here."""
    if not os.path.isdir(directory):
        raise BadInput(f"{directory!r} {'is not a directory' if os.path.exists(directory) else 'does not exist'}")
    if os.path.isfile(os.path.join(directory, LATEST_NAME)):  # a checkpoint root: the newest one
        try:
            directory = resolve_checkpoint(directory)
        except (ValueError, OSError) as e:
            raise BadInput(str(e)) from None
    if os.path.isfile(os.path.join(directory, MANIFEST_NAME)):
        return [directory]
    try:
        subdirs = sorted(e.path for e in os.scandir(directory) if e.is_dir())
    except OSError as e:
        raise BadInput(f"cannot list {directory!r}: {e.strerror}") from None
    found = [d for d in subdirs if os.path.isfile(os.path.join(d, MANIFEST_NAME))]
    if found:
        return found
    tags = [os.path.basename(d) for d in subdirs if os.path.isfile(os.path.join(d, META_NAME))]
    unfinished = [d for d in subdirs if os.path.basename(d).startswith(TMP_PREFIX)]
    if tags or unfinished:  # (not the root's .lock alone: a swap space's rank directory has one too)
        why = f"{directory!r} is a checkpoint root with no '{LATEST_NAME}' file: no save into it finished"
        if unfinished:
            why += f" ({len(unfinished)} did not: {', '.join(os.path.basename(d) for d in unfinished)})"
        if tags:
            why += f"; give one checkpoint's directory: {', '.join(tags)}"
        raise BadInput(why)
    why = f"{directory!r} is not a swap space: no {MANIFEST_NAME} in it or its subdirectories"
    if any(os.path.isfile(os.path.join(d, SPACE_NAME)) for d in [directory, *subdirs]):
        why += " (it holds a member's space.json: give the directory of the space's first member)"
    raise BadInput(why)


def open_readers(rank_dirs: list[str], engine: aio.Engine) -> list[SpaceReader]:
    """A reader per rank directory, sorted by rank; BadInput if one cannot be trusted."""
    readers: list[SpaceReader] = []
    try:
        for d in rank_dirs:
            readers.append(SpaceReader(d, engine=engine, allow_unchecked=True))  # --verify reports those
            check_sizes(readers[-1])
    except (ManifestError, OSError) as e:
        for r in readers:
            r.close()
        where = f"{e.filename}: " if isinstance(e, OSError) and e.filename else ""
        raise BadInput(where + (e.strerror if isinstance(e, OSError) and e.strerror else str(e))) from None
    return sorted(readers, key=lambda r: (r.manifest.rank, r.rank_dir))


def check_sizes(reader: SpaceReader) -> None:
    """Refuse what the manifest loader lets through but a read would trip on: a shape with
    more elements than a tensor can hold (torch refuses to allocate it whatever its nbytes),
    an extent past the end of its arena file as the manifest sizes it (the engine's resume
    refuses that too). ManifestError names the field, as the loader does."""
    m, where = reader.manifest, os.path.join(reader.rank_dir, MANIFEST_NAME)
    for t in m.tensors.values():
        key = f"tensors[{t.name!r}]"
        if math.prod(d for d in t.shape if d) > _INT64_MAX:  # torch multiplies the sizes before a 0 too
            raise ManifestError(f"{where}: {key}.shape: {list(t.shape)} is no tensor's shape (its sizes multiply "
                                "past 2**63 - 1)")  # fmt: skip
        for j, e in enumerate(t.extents):
            size = m.files[e.file].size
            if e.offset + e.nbytes > size:
                raise ManifestError(f"{where}: {key}.extents[{j}]: {e.nbytes} bytes at offset {e.offset} "
                                    f"end past arena file {e.file} ({size} bytes)")  # fmt: skip


_INT64_MAX = (1 << 63) - 1


def checkpoint_summary(directory: str) -> dict | None:
    """What meta.json says of the checkpoint in ``directory`` (None when it is not one)."""
    if not os.path.isfile(os.path.join(directory, META_NAME)):
        return None
    try:
        meta = load_meta(directory)
    except ValueError as e:
        raise BadInput(str(e)) from None
    keys = {k: meta[k] for k in ("tag", "step", "world_size", "stage", "param_dtype", "saved_at") if k in meta}
    client = meta.get("client_state")
    # The run's optimizer.state_dtype (absent before it existed: fp32); states are saved fp32 whatever it is.
    optimizer = meta["config"].get("optimizer") if isinstance(meta.get("config"), dict) else None
    state_dtype = optimizer.get("state_dtype", "fp32") if isinstance(optimizer, dict) else "fp32"
    return dict(keys, directory=directory, units=len(meta["units"]), state_dtype=state_dtype,
                client_state_keys=sorted(client) if isinstance(client, dict) else None)  # fmt: skip


def checkpoint_ranks(checkpoint: dict, readers: list[SpaceReader]) -> list[str]:
    """What is wrong with the checkpoint's ranks, in words (none: rank q of its world size is
    ``rank<q>/`` holding rank q, for every q, and nothing else), as a load refuses it: a rank
    missing, one in another's place, one the save did not write."""
    world = checkpoint.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool):
        return []
    where = checkpoint["directory"]
    problems = []
    held = {os.path.basename(r.rank_dir): r.manifest.rank for r in readers}
    for q in range(world):
        name = f"rank{q}"
        if name not in held:
            problems.append(rank_missing(os.path.join(where, name), q, world))
        elif held[name] != q:
            problems.append(rank_misplaced(os.path.join(where, name), held[name], q))
    for name in sorted(set(held) - {f"rank{q}" for q in range(world)}):
        problems.append(f"{os.path.join(where, name)}: rank {held[name]} is not one of the {world} rank(s) that saved "
                        "the checkpoint")  # fmt: skip
    return problems


def shown(text) -> str:
    """``text`` as the human output prints it: itself when every character is printable, else
    its Python repr (quoted, control characters escaped), so that a name read from disk cannot
    send an escape sequence to the terminal. --json keeps every name exact."""
    text = str(text)
    return text if text.isprintable() else repr(text)


def print_checkpoint(c: dict) -> None:
    client = f"; client_state: {', '.join(map(shown, c['client_state_keys']))}" if c["client_state_keys"] else ""
    print(f"checkpoint {shown(c.get('tag'))}: {shown(c['directory'])}\n  step {c['step']}, saved by "
          f"{c['world_size']} rank(s) at stage {c['stage']}, params {c['param_dtype']}, {c['units']} units, "
          f"{_states_line(c['state_dtype'])}, {shown(c.get('saved_at', '?'))}{client}")  # fmt: skip


def _states_line(state_dtype) -> str:
    """The saving run's optimizer states: compact ones are saved decoded (docs/formats.md)."""
    state_dtype = shown(state_dtype)
    return f"states {state_dtype}" + ("" if state_dtype == "fp32" else " (saved as fp32)")


# -- what a rank holds ------------------------------------------------------------------------
def _leak_reason(name: str) -> str:
    if name.startswith("."):  # see [Note: atomic manifest]
        return "temporary file of an unfinished manifest write"
    return "arena file the manifest does not list" if is_space_file(name) else "not a swap space file"


def lock_holder(rank_dir: str) -> int | None:
    """The process holding ``rank_dir``'s lock (a space open on it: a running engine), read from
    /proc/locks without touching the lock; None when none holds it or it cannot be told."""
    try:
        st = os.stat(os.path.join(rank_dir, LOCK_NAME), follow_symlinks=False)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        if "->" not in fields and len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key:
            return int(fields[4]) if fields[4].isdigit() else None
    return None


def rank_summary(reader: SpaceReader) -> dict:
    """The rank's members, arena files (as they are on disk), space and tensors; sizes in bytes."""
    m = reader.manifest
    files = []
    for i, f in enumerate(m.files):
        path = reader.file_path(i)
        try:
            on_disk = os.stat(path).st_size
        except FileNotFoundError:
            on_disk = None
        status = "missing" if on_disk is None else "short" if on_disk < f.size else "ok"
        files.append(dict(index=i, member=f.dir, name=f.name, path=path, size=f.size, on_disk=on_disk, status=status))
    listed = {f["path"] for f in files} | {os.path.join(d, n) for d in reader.member_dirs
                                           for n in (MANIFEST_NAME, SPACE_NAME, LOCK_NAME)}  # fmt: skip
    leaked = [
        dict(path=e.path, size=e.stat(follow_symlinks=False).st_size, why=_leak_reason(e.name))
        for d in reader.member_dirs
        for e in sorted(os.scandir(d), key=lambda e: e.name)
        if e.path not in listed and e.is_file(follow_symlinks=False)
    ]
    kinds: dict[str, dict] = {}
    for t in m.tensors.values():
        k = kinds.setdefault(t.kind, dict(tensors=0, bytes=0))
        k["tensors"] += 1
        k["bytes"] += t.nbytes
    capacity, used = sum(f.size for f in m.files), reader.allocated_bytes()
    tensors = [
        dict(name=t.name, kind=t.kind, dtype=t.dtype, shape=list(t.shape), nbytes=t.nbytes, generation=t.generation,
             checksum=t.checksum, extents=[[e.file, e.offset, e.nbytes] for e in t.extents])
        for t in m.tensors.values()
    ]  # fmt: skip
    return dict(rank=m.rank, rank_dir=reader.rank_dir, in_use_by=lock_holder(reader.rank_dir),
                space_id=m.space_id, generation=m.generation, alignment=m.alignment, members=reader.member_dirs,
                files=files, capacity=capacity, used=used, tensor_bytes=sum(t.nbytes for t in m.tensors.values()),
                free=capacity - used, leaked_bytes=sum(x["size"] for x in leaked), leaked=leaked,
                kinds=dict(sorted(kinds.items())), tensors=tensors)  # fmt: skip


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]  # fmt: skip


def print_summary(s: dict, tensors: bool = True) -> None:
    print(f"rank {s['rank']}: {shown(s['rank_dir'])} (space {shown(s['space_id'])}, manifest generation "
          f"{s['generation']})")  # fmt: skip
    if s["in_use_by"] is not None:
        print(f"  in use by process {s['in_use_by']}: a space open on it (a running engine), whose tensors "
              "since its last commit are not in the manifest shown")  # fmt: skip
    for k, member in enumerate(s["members"]):
        print(f"  member {k}: {shown(member)}")
    for f in s["files"]:
        note = {"ok": "", "missing": "  MISSING", "short": f"  SHORT: {f['on_disk']} bytes on disk"}[f["status"]]
        print(f"  arena {f['index']}: {shown(f['path'])}  {human_size(f['size'])}{note}")
    print(f"  space: {human_size(s['capacity'])} in {len(s['files'])} arena files; used {human_size(s['used'])}, "
          f"free {human_size(s['free'])}, leaked {human_size(s['leaked_bytes'])}")  # fmt: skip
    for x in s["leaked"]:
        print(f"  leaked: {shown(x['path'])}  {human_size(x['size'])}  ({x['why']})")
    kinds = ", ".join(f"{shown(k) if k else '(no kind)'} {v['tensors']} ({human_size(v['bytes'])})"
                      for k, v in s["kinds"].items())  # fmt: skip
    total = sum(t["nbytes"] for t in s["tensors"])
    print(f"  tensors: {len(s['tensors'])}, {human_size(total)}" + (f": {kinds}" if kinds else ""))
    if total:  # what the arenas take on disk for what the tensors hold (staging, alignment, holes)
        print(f"  footprint: {human_size(s['capacity'])} of arena for {human_size(total)} of tensors "
              f"({s['capacity'] / total:.2f}x)")  # fmt: skip
    if not s["tensors"] or not tensors:
        return
    files, striped = s["files"], len(s["members"]) > 1
    rows = [["name", "dtype", "shape", "bytes", "file", "offset", "checksum"]]
    for t in s["tensors"]:
        first = files[t["extents"][0][0]] if t["extents"] else None
        where = "-" if first is None else f"d{first['member']}/{first['name']}" if striped else first["name"]
        more = f"+{len(t['extents']) - 1}" if len(t["extents"]) > 1 else ""
        rows.append([shown(t["name"]), t["dtype"], "[" + ",".join(map(str, t["shape"])) + "]", human_size(t["nbytes"]),
                     shown(where) + more, str(t["extents"][0][1]) if first else "-", t["checksum"] or "-"])  # fmt: skip
    print("\n".join("  " + line for line in _table(rows, right={3, 5})))


# -- reading tensors back ---------------------------------------------------------------------
def read_back(reader: SpaceReader, name: str, record: dict, each=None) -> bool:
    """Read ``name`` with its checksum checked, in bounded pieces (`SpaceReader.read_chunks`:
    a tensor larger than memory is checked too), giving each to ``each``; set record's status
    ("ok", "unverified": read but without a checksum to check, "bad") and, when bad or
    unverified, its error: the SwapCorruption, the I/O error, or why there was nothing to check
    against. False when bad: then what ``each`` saw is not the tensor."""
    try:
        for piece in reader.read_chunks(name, verify=True):
            if each is not None:
                each(piece)
    except OSError as e:  # SwapCorruption is one; the reader's errors name the tensor
        text = str(e)
        record.update(status="bad", error=text if f"tensor {name!r}" in text else f"tensor {name!r}: {text}")
        return False
    if record["checksum"]:
        record["status"] = "ok"
    else:
        record.update(status="unverified", error=f"tensor {name!r}: no checksum recorded (a version-"
                      f"{reader.manifest.version} manifest), so its bytes could not be checked")  # fmt: skip
    return True


def verify(readers: list[SpaceReader], summaries: list[dict], quiet: bool) -> dict:
    jobs = [(r, t) for r, s in zip(readers, summaries) for t in s["tensors"]]
    total, done = sum(t["nbytes"] for _, t in jobs), 0
    progress = Progress(len(jobs), live=sys.stderr.isatty())
    try:
        for reader, t in jobs:
            progress.show(f"tensors, {human_size(done)} of {human_size(total)}")
            read_back(reader, t["name"], t)
            if t["status"] != "ok" and not quiet:
                progress.clear()
                label = "BAD" if t["status"] == "bad" else "NOT VERIFIED"
                print(f"{label} rank {reader.manifest.rank}: {shown(t['error'])}", flush=True)
            progress.done, done = progress.done + 1, done + t["nbytes"]
    finally:
        progress.clear()
    statuses = [t["status"] for _, t in jobs]
    return dict(tensors=len(jobs), verified=statuses.count("ok"), bad=statuses.count("bad"),
                unverified=statuses.count("unverified"))  # fmt: skip


class TensorStats:
    """min, max, mean and L2 norm of the finite elements (in float64; of |x| for complex) and
    how many are NaN or infinite, over the pieces of a tensor given to ``add`` in turn. Each
    piece is taken 4M elements at a time, so no float64 copy of a large tensor is made."""

    def __init__(self):
        self.lo = self.hi = None
        self.total, self.norm, self.numel, self.finite, self.nan, self.inf = 0.0, 0.0, 0, 0, 0, 0

    def add(self, piece: torch.Tensor) -> None:
        flat = piece.reshape(-1)
        flat = flat.abs() if flat.is_complex() else flat
        self.numel += flat.numel()
        for chunk in flat.split(1 << 22):
            x = chunk.to(torch.float64)
            keep = torch.isfinite(x)
            finite, nan = int(keep.sum()), int(torch.isnan(x).sum())
            self.nan, self.inf = self.nan + nan, self.inf + x.numel() - finite - nan
            if finite < x.numel():  # no copy of the common, all-finite piece
                x = x[keep]
            if x.numel():
                self.lo = min(self.lo, float(x.min())) if self.lo is not None else float(x.min())
                self.hi = max(self.hi, float(x.max())) if self.hi is not None else float(x.max())
                self.total, self.finite = self.total + float(x.sum()), self.finite + x.numel()
                self.norm = math.hypot(self.norm, float(torch.linalg.vector_norm(x)))  # no overflow from squaring

    def as_dict(self) -> dict:
        return dict(min=self.lo, max=self.hi, mean=self.total / self.finite if self.finite else None, norm=self.norm,
                    numel=self.numel, finite=self.finite, nan=self.nan, inf=self.inf)  # fmt: skip


def inspect_tensor(directory: str, readers: list[SpaceReader], name: str) -> list[dict]:
    """One record (with stats, unless it is bad) per rank that holds ``name``."""
    holders = [r for r in readers if name in r.manifest.tensors]
    if not holders:
        names = sorted({n for r in readers for n in r.names()})
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; close matches: {', '.join(map(repr, close))}" if close else ""
        raise BadInput(f"no tensor {name!r} in {directory!r} (it holds {len(names)} tensors{hint})")
    out = []
    for r in holders:
        t = r.info(name)
        record = dict(rank=r.manifest.rank, rank_dir=r.rank_dir, name=t.name, kind=t.kind, dtype=t.dtype,
                      shape=list(t.shape), nbytes=t.nbytes, generation=t.generation, checksum=t.checksum,
                      extents=[dict(file=e.file, path=r.file_path(e.file), offset=e.offset, nbytes=e.nbytes)
                               for e in t.extents])  # fmt: skip
        stats = TensorStats()
        record["stats"] = stats.as_dict() if read_back(r, name, record, stats.add) else None
        out.append(record)
    return out


def print_tensor(t: dict) -> None:
    check = {"ok": "verified", "unverified": "none", "bad": "MISMATCH"}[t["status"]]
    print(f"rank {t['rank']}: {shown(t['rank_dir'])}\n  tensor      {shown(t['name'])}\n  dtype       {t['dtype']}\n"
          f"  shape       {t['shape']}\n  bytes       {t['nbytes']} ({human_size(t['nbytes'])})\n"
          f"  generation  {t['generation']}\n  checksum    {t['checksum'] or '-'} ({check})")  # fmt: skip
    for i, e in enumerate(t["extents"]):
        print(f"  extent {i}    {shown(e['path'])} offset {e['offset']}, {e['nbytes']} bytes")
    if t["status"] == "bad":
        print(f"  BAD: {shown(t['error'])}")
    elif (s := t["stats"]) is not None:
        fmt = lambda v: "-" if v is None else f"{v:.6g}"  # noqa: E731
        print(f"  stats       min {fmt(s['min'])}, max {fmt(s['max'])}, mean {fmt(s['mean'])}, "
              f"norm {fmt(s['norm'])} (of {s['finite']} finite); NaN {s['nan']}, Inf {s['inf']}")  # fmt: skip


# -- command line -----------------------------------------------------------------------------
SYNOPSIS = "swap-inspect DIR [--verify | --tensor NAME] [--summary] [--json]"

DESCRIPTION = """\
description:
  Shows what a swap space holds on disk. DIR is a rank directory (the one holding
  manifest.json, in the space's first directory), or a directory whose immediate
  subdirectories are such rank directories (every rank found is shown, sorted by rank).
  Nothing is locked or written: a space that a running engine holds may be inspected, and
  then shows its last manifest and the process that holds it (from /proc/locks). The
  manifest and every member's space.json are checked as the engine checks them on resume.
  DIR may also be a checkpoint (save_checkpoint's directory, or the root it saves into,
  whose "latest" names the newest): a line on the checkpoint first (tag, step, ranks, stage,
  dtypes), and a BAD line for each rank that is missing, holds another rank, or is not one
  of those that saved it, as a load refuses them.
"""

EPILOG = """\
output:
  Per rank: its member directories (one per drive); its arena files with their sizes in
  the manifest, and MISSING or SHORT where the file on disk is absent or smaller; the space:
  used (every extent rounded up to the alignment), free (arena sizes less used) and leaked
  (files in the members' rank directories that the manifest does not list and a space does
  not make: orphaned arena files, temporary files of an interrupted manifest write, strays),
  each leaked file listed; tensor count and bytes per state kind (the part of a name after
  its last "/": an int8 optimizer state's codes are under its kind, its scales under
  "<kind>.scale"); the footprint: the arenas' size against the tensors' bytes, and their
  ratio (staged copies, alignment, holes). Then one row per tensor: name, dtype, shape, bytes, file (the first
  extent's arena file, "dK/" naming its member when there are several, "+N" for N more
  extents), offset of the first extent, checksum ("-" if none); --summary leaves the rows out.
  --verify: afterwards reads every tensor back (through the aio engine) and checks its
  checksum; prints a BAD line per mismatch (tensor, file, offset of its first extent) or
  read error (an arena that is missing, short, a FIFO or a symlink), a NOT VERIFIED line per
  tensor that has no checksum to check against (only a version-1 manifest, from an older
  infinity, has such tensors), then "N tensors: V verified, M bad, K not verified (no
  checksum)". A progress bar goes to stderr when it is a terminal.
  --tensor NAME: that tensor's record on each rank that holds it (dtype, shape, bytes,
  generation, checksum, every extent's file and offset) and, read back with its checksum
  checked, min, max, mean and L2 norm of its finite elements (in float64; of |x| for
  complex dtypes) and its NaN and Inf counts.
  Tensors are read in pieces of at most 64 MiB, whatever their size. A name (of a tensor, a
  file, a tag) holding a character that is not printable, such as a terminal escape
  sequence, is shown as its Python repr, quoted.
  --json: the same as one JSON object on stdout, sizes in bytes, names exact: {"path", "ranks": [{
  "rank", "rank_dir", "in_use_by" (a pid, or null), "space_id", "generation", "alignment",
  "members", "files": [{"index", "member", "name", "path", "size", "on_disk", "status"}],
  "capacity", "used", "free", "leaked_bytes", "leaked": [{"path", "size", "why"}], "kinds",
  "tensors": [{"name",
  "kind", "dtype", "shape", "nbytes", "generation", "checksum", "extents": [[file, offset,
  nbytes]], with --verify "status" (ok, unverified, bad) and "error"}]}], with --verify
  "verify": {"tensors", "verified", "bad", "unverified"}}, for a checkpoint "checkpoint": {"tag",
  "step", "world_size", "stage", "param_dtype", "saved_at", "directory", "units", "state_dtype",
  "client_state_keys", "problems"}; with --tensor {"path", "tensor", "records":
  [the record, "status", "error", "stats"]}.

exit status:
  0 inspected (and with --verify or --tensor, every checksum matched; with --verify, every
  tensor had one);
  1 a checksum mismatch, an error reading a tensor back, (--verify) a tensor that could
  not be verified for want of a checksum, or a checkpoint's rank missing or out of place;
  2 DIR missing or not a swap space, a manifest, space.json or meta.json that cannot be
  trusted (not UTF-8 or not JSON, a key twice, nested too deep, unknown version, bad field,
  a shape or extent no tensor can have, a path that escapes the space, a member of another
  space), an unreadable member, an unknown --tensor NAME; 130 interrupted.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swap-inspect", usage=SYNOPSIS, description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("directory", metavar="DIR", help="a rank directory, or a directory of rank directories")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--verify", action="store_true", help="read every tensor back and check its checksum")
    what.add_argument("--tensor", metavar="NAME", help="one tensor's record and statistics")
    p.add_argument("--summary", action="store_true", help="the space's totals without the table of tensors")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    readers: list[SpaceReader] = []
    # A summary reads no tensor: the threads engine then costs nothing and logs nothing.
    reading = args.verify or args.tensor is not None
    try:
        rank_dirs = find_ranks(args.directory)
        with aio.open_engine() if reading else aio.open_engine("threads", 1) as engine:
            readers = open_readers(rank_dirs, engine)
            if args.tensor is not None:
                records = inspect_tensor(args.directory, readers, args.tensor)
                if args.json:
                    print(json.dumps(dict(path=args.directory, tensor=args.tensor, records=records)))
                for r in [] if args.json else records:
                    print_tensor(r)
                return int(any(r["status"] == "bad" for r in records))
            summaries = [rank_summary(r) for r in readers]
            checkpoint = checkpoint_summary(os.path.dirname(rank_dirs[0]))
            problems = checkpoint_ranks(checkpoint, readers) if checkpoint is not None else []
            if checkpoint is not None:
                checkpoint["problems"] = problems
            if checkpoint is not None and not args.json:
                print_checkpoint(checkpoint)
                for problem in problems:
                    print(f"BAD {shown(problem)}")
            for s in [] if args.json else summaries:
                print_summary(s, tensors=not args.summary)
            sys.stdout.flush()
            result = dict(path=args.directory, ranks=summaries)
            if checkpoint is not None:
                result["checkpoint"] = checkpoint
            if args.verify:
                result["verify"] = v = verify(readers, summaries, quiet=args.json)
                if not args.json:
                    print(f"{v['tensors']} tensors: {v['verified']} verified, {v['bad']} bad, "
                          f"{v['unverified']} not verified (no checksum)")  # fmt: skip
            if args.json:
                print(json.dumps(result))
            return int(bool(problems or (args.verify and (v["bad"] or v["unverified"]))))
    except BadInput as e:
        print(f"swap-inspect: error: {shown(e)}", file=sys.stderr)
        return 2
    except (OSError, aio.BackendUnavailable) as e:
        print(f"swap-inspect: error: {shown(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nswap-inspect: interrupted", file=sys.stderr)
        return 130
    finally:
        for r in readers:
            r.close()


if __name__ == "__main__":
    sys.exit(main())
