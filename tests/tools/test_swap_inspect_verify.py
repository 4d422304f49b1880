"""swap-inspect --verify on spaces it cannot fully check: it says what, and exits non-zero."""

from __future__ import annotations

import json
import os

import pytest
import torch

from infinity.swap import SwapSpace
from infinity.tools.swap_inspect import main


@pytest.fixture
def rank_dir(tmp_path):
    with SwapSpace(str(tmp_path), grow_step=1 << 20, host_budget=1 << 20) as space:
        space.put("a/param", torch.arange(2000, dtype=torch.float32)).result()
        space.put("b/param", torch.ones(10)).result()
        return space.rank_dirs[0]


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_an_arena_that_is_not_a_regular_file_is_reported_bad(rank_dir, tmp_path, capsys, kind, no_hang):
    arena = os.path.join(rank_dir, "arena-0.bin")
    if kind == "fifo":
        os.unlink(arena)
        os.mkfifo(arena, 0o600)
    else:
        os.rename(arena, tmp_path / "target.bin")
        os.symlink(tmp_path / "target.bin", arena)
    code, out, _ = run(capsys, rank_dir, "--verify")
    assert code == 1
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    what = "is a FIFO (named pipe)" if kind == "fifo" else "is a symbolic link"
    assert len(bad) == 2 and all(what in line and arena in line for line in bad), out
    assert "tensor 'a/param'" in bad[0] and "tensor 'a/param': tensor" not in bad[0]
    assert out.splitlines()[-1] == "2 tensors: 0 verified, 2 bad, 0 not verified (no checksum)"


def test_a_current_manifest_without_a_checksum_cannot_be_trusted(rank_dir, capsys):
    path = os.path.join(rank_dir, "manifest.json")
    data = json.load(open(path))
    data["tensors"]["b/param"]["checksum"] = None
    with open(path, "w") as f:
        json.dump(data, f)
    code, _, err = run(capsys, rank_dir, "--verify")
    assert code == 2
    assert f"{path}: tensors['b/param'].checksum: missing" in err
