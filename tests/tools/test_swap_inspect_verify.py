"""swap-inspect --verify on spaces it cannot fully check: it says what, and exits non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import xxhash

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


_PEAK = """\
import json, resource, sys
from infinity.tools.swap_inspect import main
import torch, xxhash  # loaded before the baseline: only what main() takes counts
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
code = main(sys.argv[1:])
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"code": code, "grew_kib": grew}), file=sys.stderr)
"""


@pytest.mark.parametrize("mode", [["--verify"], ["--tensor", "huge/exp_avg"]])
def test_a_huge_tensor_is_verified_and_summarised_in_bounded_memory(tmp_path, mode):
    """A 512 MiB tensor (a sparse arena: nothing on disk) is read in chunks: the tool's peak
    memory grows by well under the tensor's size (it once read the tensor whole, and a space
    with a tensor larger than RAM could not be verified). The checksum and the statistics are
    still of the whole tensor (zeros: min = max = mean = norm = 0)."""
    numel = 64 << 20  # float64: 512 MiB
    nbytes = numel * 8
    with SwapSpace(str(tmp_path), grow_step=1 << 20, host_budget=1 << 20) as space:
        space.put("huge/exp_avg", torch.zeros(8, dtype=torch.float64)).result()
        rank_dir = space.rank_dirs[0]
    path = os.path.join(rank_dir, "manifest.json")
    m = json.load(open(path))
    record = m["tensors"]["huge/exp_avg"]
    offset = record["extents"][0][1]
    zeros, digest = bytes(1 << 24), xxhash.xxh3_64()
    for _ in range(nbytes >> 24):
        digest.update(zeros)
    record.update(shape=[numel], nbytes=nbytes, extents=[[0, offset, nbytes]], checksum=f"xxh3-64:{digest.hexdigest()}")
    m["files"][0]["size"] = offset + nbytes
    with open(path, "w") as f:
        json.dump(m, f)
    os.truncate(os.path.join(rank_dir, "arena-0.bin"), offset + nbytes)  # sparse: a hole reads as zeros
    out = subprocess.run([sys.executable, "-c", _PEAK, rank_dir, *mode, "--json"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    result = json.loads(out.stderr.splitlines()[-1])
    assert result["code"] == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    if mode == ["--verify"]:
        assert report["verify"] == {"tensors": 1, "verified": 1, "bad": 0, "unverified": 0}
    else:
        (rec,) = report["records"]
        assert rec["status"] == "ok"
        assert {k: rec["stats"][k] for k in ("min", "max", "mean", "norm", "finite", "nan", "inf")} == dict(
            min=0.0, max=0.0, mean=0.0, norm=0.0, finite=numel, nan=0, inf=0)  # fmt: skip
    # A 64 MiB read buffer and the statistics' temporaries of one 32 MiB piece of it (about 130 MiB
    # here), against twice the tensor (its copy and a staging buffer) before.
    assert result["grew_kib"] * 1024 < 192 << 20, result
