"""Which saved elements make each unit's state when a checkpoint loads: the re-cut.

Owns: the check that a checkpoint's units are of this model, and the plan a load follows, for
every unit of the engine, the runs of the saved units' flat tensors that make its own, and the
saved step counts that become its own. Touches nothing: `_checkpoint` reads what the plan
names, from whichever saved ranks hold it.

[Note: re-cut]
A checkpoint keeps its state per unit (`_checkpoint`), and a module cut into tiles (see [Note:
tiles] in `_units`) has one unit per block of rows: another ``memory.tile_size``, or one side
tiled and the other whole (every tier on the device tiles nothing), gives the same modules other
units. Every cut holds the same rows, though. A unit's flat tensor is its parameters one after
the other, each its rows ``[lo, hi)`` flattened (a Linear's weight rows, then its bias
elements), so rows ``[a, b)`` of parameter i are one run of ``(b - a) * row_i`` elements in any
unit that holds them (``row_i`` the elements of one row of parameter i). A unit of the new cut
is made of such runs of the saved units whose rows meet its own, parameter by parameter, and
every state kind (parameters, master weights, moments) is laid out alike, so one plan serves
all; the saved world size only decides which saved rank holds each element (`_checkpoint`).
The scalar state per unit, the step count, cannot be cut: a new unit takes the count of the
saved units it is made of, which the tiles of one module share (every tile gets a gradient
whenever any does, `_tiled`). Counts that differ are refused, naming them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .checkpoint import CheckpointError


class Run(NamedTuple):
    """Elements ``[at, at + n)`` of a unit's flat tensor are ``[start, start + n)`` of the
    saved unit ``name``'s, which holds ``numel`` elements."""

    at: int
    name: str
    numel: int
    start: int
    n: int


class Plan:
    """How to load a checkpoint into a model's units (see [Note: re-cut])."""

    def __init__(self, where: str, meta: dict):
        self.where = where
        self.saved = meta["units"]  # the saved units, in order: {"name", "numel", "params"}
        config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
        self.tile_size = (config.get("memory") or {}).get("tile_size", "?")  # the saving run's
        self.runs: dict[int, list[Run]] = {}  # unit index -> its runs, covering [0, numel) in order
        self.sources: dict[int, list[int]] = {}  # unit index -> indices in ``saved`` of the units it is made of
        self.recut: list[str] = []  # the modules cut otherwise than saved

    def steps(self, units, saved_steps: torch.Tensor, rank_dir: str) -> torch.Tensor:
        """Each of ``units``' step count (1-D float32, in unit order) from the saved units' (in
        their order, as `Optimizer.state_dict` gives them); CheckpointError where the saved units
        that make one unit stepped apart."""
        if saved_steps.numel() != len(self.saved):
            raise CheckpointError(f"{rank_dir}: optimizer/steps: {saved_steps.numel()} step counts for "
                                  f"{len(self.saved)} saved units")  # fmt: skip
        out = torch.empty(len(units), dtype=torch.float32)
        for u in units:
            counts: dict[float, list[str]] = {}  # step count -> the saved units that took it
            for k in self.sources[u.index]:
                counts.setdefault(float(saved_steps[k]), []).append(self.saved[k]["name"])
            if len(counts) > 1:
                listed = "; ".join(f"{names[0]!r}{f' and {len(names) - 1} more' if len(names) > 1 else ''}: {c:g}"
                                   for c, names in counts.items())  # fmt: skip
                raise CheckpointError(
                    f"{self.where}: the saved units of {u.path!r} that make {u.name!r} took different numbers of "
                    f"optimizer steps ({listed}), and one unit has one count: load it into an engine that cuts "
                    f"{u.path!r} as the saving one did (memory.tile_size={self.tile_size}, some tier off the device)"
                )
            out[u.index] = next(iter(counts), 0.0)
        return out


def plan(units, meta: dict, where: str) -> Plan:
    """The plan to load the checkpoint ``where``, whose meta.json is ``meta``, into
    ``units``; CheckpointError naming the unit where it is not of the same model."""
    out = Plan(where, meta)
    saved = out.saved
    mine: dict[str, list] = {}  # module path -> its units, in order
    for u in units:
        mine.setdefault(u.path, []).append(u)
    theirs: dict[str, list[int]] = {}  # module path -> its saved units (indices), in order
    for k, s in enumerate(saved):
        theirs.setdefault(_module(s["name"], mine), []).append(k)
    if list(mine) != list(theirs):
        raise CheckpointError(_other_modules(where, mine, theirs, saved))
    for path, ours in mine.items():
        ks = theirs[path]
        if [saved[k]["name"] for k in ks] == [u.name for u in ours]:  # cut alike: unit by unit
            for u, k in zip(ours, ks):
                if saved[k]["numel"] != u.numel:
                    raise CheckpointError(f"{where}: unit {u.name!r} ({u.numel} elements) was saved as "
                                          f"{saved[k]['name']!r} ({saved[k]['numel']} elements): not the same "
                                          "model")  # fmt: skip
                out.runs[u.index] = [Run(0, u.name, u.numel, 0, u.numel)] if u.numel else []
                out.sources[u.index] = [k]
            continue
        blocks = _saved_rows(where, ours[0], [(k, saved[k]) for k in ks])
        out.recut.append(path)
        for u in ours:
            out.runs[u.index], out.sources[u.index] = _runs(u, blocks)
    return out


def _runs(unit, blocks: list[tuple[int, dict, int, int]]) -> tuple[list[Run], list[int]]:
    """The runs of the saved units ``blocks`` ((index, entry, first row, end row) each, in
    row order) that make ``unit``'s flat tensor, in its order, and the saved units used."""
    lo, hi = unit.rows if unit.is_tile else (0, unit.records[0].full_shape[0])
    row = [math.prod(r.full_shape[1:]) for r in unit.records]  # elements of one row, per parameter
    runs: list[Run] = []
    used: list[int] = []
    for i, per_row in enumerate(row):
        for k, entry, first, end in blocks:
            a, b = max(lo, first), min(hi, end)
            if a >= b:
                continue
            if k not in used:
                used.append(k)
            offset = (end - first) * sum(row[:i])  # parameter i's place in the saved unit
            run = Run(unit.records[i].offset + (a - lo) * per_row, entry["name"], entry["numel"],
                      offset + (a - first) * per_row, (b - a) * per_row)  # fmt: skip
            last = runs[-1] if runs else None
            if run.n == 0:
                continue
            if last and last.name == run.name and last.at + last.n == run.at and last.start + last.n == run.start:
                runs[-1] = last._replace(n=last.n + run.n)  # one read where the two cuts agree
            else:
                runs.append(run)
    return runs, used


def _module(name: str, paths) -> str:
    """The module path of a saved unit's name: a tile's is "<module>#<first row>" (a module of
    this model's ``paths`` may have "#" in its own name)."""
    if name in paths:
        return name
    path, mark, row = name.rpartition("#")
    return path if mark and row.isdigit() else name


def _block_rows(entry: dict, unit) -> int | None:
    """The rows the saved unit ``entry`` holds if it is a block of rows of ``unit``'s module
    (the same parameters, in order, with the same shapes but for the rows), else None."""
    params = entry.get("params")
    shapes = [r.full_shape for r in unit.records]
    if not (isinstance(params, list) and len(params) == len(shapes)):
        return None
    rows = set()
    for p, r in zip(params, unit.records):
        name, full = r.name, r.full_shape
        if not (isinstance(p, list) and len(p) == 2 and p[0] == name and isinstance(p[1], list)):
            return None
        shape = p[1]
        if not (shape and all(isinstance(d, int) and d >= 0 for d in shape) and len(shape) == len(full)
                and tuple(shape[1:]) == tuple(full[1:]) and full[0] == shapes[0][0]):  # fmt: skip
            return None
        rows.add(shape[0])
    if len(rows) != 1 or entry["numel"] != sum(math.prod(p[1]) for p in params):
        return None
    return rows.pop()


def _saved_rows(where: str, unit, saved: list[tuple[int, dict]]) -> list[tuple[int, dict, int, int]]:
    """(index, entry, first row, end row) of each saved unit of ``unit``'s module: blocks of
    its rows end to end, from the first row to the last (a whole unit: one block), each named
    for its first row. CheckpointError naming the unit if they are not."""
    out, at = [], 0
    for k, entry in saved:
        rows = _block_rows(entry, unit)
        if rows is None or entry["name"] not in (unit.path if at == 0 else None, f"{unit.path}#{at}"):
            break
        out.append((k, entry, at, at + rows))
        at += rows
    else:
        if unit.records and unit.records[0].full_shape and at == unit.records[0].full_shape[0]:
            return out
    mine = ", ".join(f"{r.name} {list(r.full_shape)}" for r in unit.records)
    first, last = saved[0][1]["name"], saved[-1][1]["name"]
    cut = repr(first) if len(saved) == 1 else f"{len(saved)} units {first!r}..{last!r}"
    raise CheckpointError(f"{where}: unit {unit.name!r} of {unit.path!r} ({mine}) was saved as {cut} of "
                          f"{_saved_shapes([s for _, s in saved])}: not the same model")  # fmt: skip


def _saved_shapes(entries: list[dict]) -> str:
    """The parameters and shapes of the module the saved units ``entries`` cut by rows."""
    try:
        rows = sum(e["params"][0][1][0] for e in entries)
        return ", ".join(f"{name} {[rows, *shape[1:]]}" for name, shape in entries[0]["params"])
    except (IndexError, KeyError, TypeError, ValueError):
        return f"parameters {entries[0].get('params')!r}"  # not rows of anything


def _other_modules(where: str, mine: dict, theirs: dict, saved: list[dict]) -> str:
    """Why a checkpoint whose modules (with parameters) are not this model's is refused: the
    first unit where they part."""
    for path, other in zip(mine, theirs):
        if path != other:
            return (f"{where}: unit {mine[path][0].name!r} was saved as {saved[theirs[other][0]]['name']!r}: not the "
                    "same model")  # fmt: skip
    if len(mine) > len(theirs):
        missing = f"unit {mine[list(mine)[len(theirs)]][0].name!r} is not in it"
    else:
        missing = f"its unit {saved[theirs[list(theirs)[len(mine)]][0]]['name']!r} is not in this model"
    return (f"{where}: saved from a model with {len(saved)} parameter units ({len(theirs)} modules), this one has "
            f"{sum(len(v) for v in mine.values())} ({len(mine)} modules) and {missing}: not the same model")

