"""swap-inspect: its command-line contract over real swap spaces on disk.

The spaces are written by `SwapSpace` over two directories standing for two drives, with a
small stripe threshold so 12 KiB tensors are striped over both. The CLI runs in-process
through main() for speed; one test runs the installed script.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infinity.swap import MANIFEST_NAME, SPACE_NAME, SwapSpace, dtype_name
from infinity.tools import swap_inspect
from infinity.tools.swap_inspect import human_size, main

ALIGN = 4096


def build_space(dirs: list[Path], tensors: dict[str, torch.Tensor], *, rank: int = 0,
                no_checksum: tuple[str, ...] = ()) -> Path:  # fmt: skip
    """Write ``tensors`` into a new swap space over ``dirs``; return member 0's rank directory.
    Tensors of 2 units or more are striped. Every write records a checksum, so those named in
    ``no_checksum`` lose theirs afterwards, the manifest made version 1 (an older infinity's,
    which wrote checksums only where asked)."""
    for d in dirs:
        d.mkdir(exist_ok=True)
    with SwapSpace([str(d) for d in dirs], rank=rank, stripe_size=ALIGN, stripe_threshold=2 * ALIGN,
                   grow_step=16 * ALIGN, host_budget=1 << 20) as space:  # fmt: skip
        for name, t in tensors.items():
            space.put(name, t).result()
        rank_dir = Path(space.rank_dirs[0])
    if no_checksum:
        m = manifest_of(rank_dir)
        m["version"] = 1
        for name in no_checksum:
            m["tensors"][name]["checksum"] = None
        (rank_dir / MANIFEST_NAME).write_text(json.dumps(m))
    return rank_dir


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    odd = torch.randn(300, dtype=torch.float64, generator=g)
    odd[[3, 7, 11]] = float("nan")
    odd[[5, 9]] = float("inf")
    odd[13] = float("-inf")
    return {
        "layers.0.attn.weight/param": torch.randn(64, 48, generator=g),  # 3 units: striped
        "layers.0.attn.weight/exp_avg": torch.randn(64, 48, generator=g),
        "layers.0.attn.bias/param": torch.randn(48, generator=g).bfloat16(),
        "embed.weight/param": torch.randn(100, 16, generator=g).half(),
        "layers.0.norm.weight/exp_avg_sq": odd,
        "step/count": torch.tensor(12345, dtype=torch.int64),
        "mask/buffer": torch.arange(10) % 3 == 0,
        "scratch/param": torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g),
        "empty/param": torch.empty(0),
    }


@pytest.fixture
def space(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = sample_tensors()
    rank_dir = build_space([tmp_path / "d0", tmp_path / "d1"], tensors, no_checksum=("scratch/param",))
    return rank_dir, tensors


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def manifest_of(rank_dir: Path) -> dict:
    return json.loads((rank_dir / MANIFEST_NAME).read_text())


def flip_byte(rank_dir: Path, name: str, at: int = 100) -> None:
    m = manifest_of(rank_dir)
    file, offset, _ = m["tensors"][name]["extents"][0]
    f = m["files"][file]
    path = Path(m["members"][f["dir"]]) / f["name"]
    with open(path, "r+b") as fh:
        fh.seek(offset + at)
        byte = fh.read(1)
        fh.seek(offset + at)
        fh.write(bytes([byte[0] ^ 0xFF]))


# -- summary ----------------------------------------------------------------------------------
def test_summary_and_table(space, capsys):
    rank_dir, tensors = space
    code, out, err = run(capsys, rank_dir)
    assert code == 0 and err == ""
    assert f"rank 0: {rank_dir}" in out
    assert f"member 1: {rank_dir.parent.parent / 'd1' / 'rank0'}" in out
    assert "tensors: 9," in out
    assert "param 5 (" in out and "exp_avg 1 (" in out and "count 1 (8B)" in out
    table = [line.split() for line in out.splitlines() if line.startswith("  ") and "/" in line.split()[0]]
    rows = {row[0]: row for row in table}
    assert set(rows) == set(tensors)
    name, dtype, shape, nbytes, file, offset, digest = rows["layers.0.attn.weight/param"]
    assert (dtype, shape, nbytes, file, offset) == ("float32", "[64,48]", "12KiB", "d0/arena-0.bin+1", "0")
    assert digest.startswith("xxh3-64:")
    assert rows["layers.0.attn.bias/param"][1:4] == ["bfloat16", "[48]", "96B"]
    assert rows["step/count"][1:3] == ["int64", "[]"]
    assert rows["scratch/param"][-1] == "-"
    assert rows["empty/param"][4:] == ["-", "-", manifest_of(rank_dir)["tensors"]["empty/param"]["checksum"]]
    assert "leaked 0B" in out and "leaked:" not in out


def test_a_space_open_now_names_the_process_that_holds_it(tmp_path, capsys):
    """A running engine's space showed its last manifest ("tensors: 0") with nothing to say it
    was live: the process holding its lock is named (from /proc/locks; the lock untouched)."""
    live = SwapSpace(str(tmp_path))
    try:
        code, out, _ = run(capsys, tmp_path / "rank0")
        assert code == 0 and f"in use by process {os.getpid()}: a space open on it" in out
        code, out, _ = run(capsys, tmp_path / "rank0", "--json")
        assert json.loads(out)["ranks"][0]["in_use_by"] == os.getpid()
    finally:
        live.close()
    code, out, _ = run(capsys, tmp_path / "rank0", "--json")
    assert json.loads(out)["ranks"][0]["in_use_by"] is None
    code, out, _ = run(capsys, tmp_path / "rank0")
    assert "in use by" not in out


def test_summary_shows_the_arena_against_the_tensor_bytes(space, capsys):
    rank_dir, _ = space
    code, out, err = run(capsys, rank_dir, "--json")
    (r,) = json.loads(out)["ranks"]
    assert r["tensor_bytes"] == sum(t["nbytes"] for t in r["tensors"])
    code, out, err = run(capsys, rank_dir)
    assert code == 0 and err == ""
    ratio = r["capacity"] / r["tensor_bytes"]
    assert f"footprint: {human_size(r['capacity'])} of arena for {human_size(r['tensor_bytes'])} of tensors ({ratio:.2f}x)" in out


def test_json_summary(space, capsys):
    rank_dir, tensors = space
    code, out, err = run(capsys, rank_dir, "--json")
    assert code == 0 and err == ""
    result = json.loads(out)
    (r,) = result["ranks"]
    assert r["rank"] == 0 and r["rank_dir"] == str(rank_dir) and len(r["members"]) == 2
    assert [f["status"] for f in r["files"]] == ["ok", "ok"]
    assert r["capacity"] == sum(f["size"] for f in r["files"]) == sum(f["on_disk"] for f in r["files"])
    assert r["used"] == sum(-(-e[2] // ALIGN) * ALIGN for t in r["tensors"] for e in t["extents"])
    assert r["free"] == r["capacity"] - r["used"] == 0  # close shrinks each arena to its last tensor's end
    assert r["leaked_bytes"] == 0 and r["leaked"] == []
    params = [t for n, t in tensors.items() if n.endswith("/param")]
    assert r["kinds"]["param"] == {"tensors": 5, "bytes": sum(t.nbytes for t in params)}
    by_name = {t["name"]: t for t in r["tensors"]}
    assert by_name["embed.weight/param"]["shape"] == [100, 16] and by_name["embed.weight/param"]["nbytes"] == 3200
    assert by_name["scratch/param"]["checksum"] is None
    assert "verify" not in result


def test_human_size():
    assert [human_size(n) for n in (0, 96, 4097, 4096, 12 << 10, 3 << 29, 12345, 1536 << 20)] == [
        "0B", "96B", "4.0KiB", "4KiB", "12KiB", "1.5GiB", "12.1KiB", "1.5GiB"]  # fmt: skip


def test_parent_directory_shows_every_rank(tmp_path, capsys):
    d0, d1 = tmp_path / "d0", tmp_path / "d1"
    for rank in (1, 0):
        build_space([d0, d1], {f"w{rank}/param": torch.ones(rank + 1)}, rank=rank)
    code, out, _ = run(capsys, d0, "--json")
    assert code == 0
    assert [(r["rank"], [t["name"] for t in r["tensors"]]) for r in json.loads(out)["ranks"]] == [
        (0, ["w0/param"]), (1, ["w1/param"])]  # fmt: skip
    code, out, _ = run(capsys, d0)
    assert out.index(f"rank 0: {d0 / 'rank0'}") < out.index(f"rank 1: {d0 / 'rank1'}")


def test_leaked_files_are_listed(space, capsys):
    rank_dir, _ = space
    member1 = rank_dir.parent.parent / "d1" / "rank0"
    (member1 / "arena-5.bin").write_bytes(bytes(8192))  # orphaned arena file
    (rank_dir / f".{MANIFEST_NAME}.x1y2.tmp").write_text("{")  # interrupted manifest write
    (rank_dir / "core").write_bytes(bytes(100))  # a stray
    code, out, _ = run(capsys, rank_dir, "--json")
    (r,) = json.loads(out)["ranks"]
    assert r["leaked_bytes"] == 8192 + 1 + 100
    assert {Path(x["path"]).name: x["why"] for x in r["leaked"]} == {
        "arena-5.bin": "arena file the manifest does not list",
        f".{MANIFEST_NAME}.x1y2.tmp": "temporary file of an unfinished manifest write",
        "core": "not a swap space file",
    }
    code, out, _ = run(capsys, rank_dir)
    assert code == 0
    assert f"leaked: {member1 / 'arena-5.bin'}  8KiB  (arena file the manifest does not list)" in out
    assert "leaked 8.1KiB" in out


# -- --verify ---------------------------------------------------------------------------------
def test_verify_good_space(tmp_path, capsys):
    rank_dir = build_space([tmp_path / "d0", tmp_path / "d1"], sample_tensors())
    code, out, err = run(capsys, rank_dir, "--verify")
    assert code == 0 and err == ""
    assert out.splitlines()[-1] == "9 tensors: 9 verified, 0 bad, 0 not verified (no checksum)"
    code, out, _ = run(capsys, rank_dir, "--verify", "--json")
    result = json.loads(out)
    assert code == 0 and result["verify"] == {"tensors": 9, "verified": 9, "bad": 0, "unverified": 0}
    assert {t["status"] for t in result["ranks"][0]["tensors"]} == {"ok"}


def test_verify_says_what_it_could_not_check_and_fails(space, capsys):
    """A tensor without a checksum (a version-1 manifest) is read but not verified: said, and
    the exit status is 1, not the 0 of a space whose every byte was checked."""
    rank_dir, _ = space
    code, out, err = run(capsys, rank_dir, "--verify")
    assert code == 1 and err == ""
    (line,) = [line for line in out.splitlines() if line.startswith("NOT VERIFIED")]
    assert "'scratch/param': no checksum recorded (a version-1 manifest)" in line
    assert out.splitlines()[-1] == "9 tensors: 8 verified, 0 bad, 1 not verified (no checksum)"
    code, out, _ = run(capsys, rank_dir, "--verify", "--json")
    result = json.loads(out)
    assert code == 1 and result["verify"] == {"tensors": 9, "verified": 8, "bad": 0, "unverified": 1}
    statuses = {t["name"]: t["status"] for t in result["ranks"][0]["tensors"]}
    assert statuses.pop("scratch/param") == "unverified" and set(statuses.values()) == {"ok"}


@pytest.mark.parametrize("name", ["layers.0.attn.weight/param", "embed.weight/param"])
def test_verify_names_the_corrupt_tensor(space, capsys, name):
    rank_dir, _ = space
    flip_byte(rank_dir, name)
    code, out, err = run(capsys, rank_dir, "--verify")
    assert code == 1
    (bad,) = [line for line in out.splitlines() if line.startswith("BAD")]
    m = manifest_of(rank_dir)
    file, offset, _ = m["tensors"][name]["extents"][0]
    assert repr(name) in bad and f"offset {offset}" in bad and m["files"][file]["name"] in bad
    assert out.splitlines()[-1] == "9 tensors: 7 verified, 1 bad, 1 not verified (no checksum)"
    code, out, _ = run(capsys, rank_dir, "--verify", "--json")
    assert code == 1
    assert [t["name"] for t in json.loads(out)["ranks"][0]["tensors"] if t["status"] == "bad"] == [name]


def test_verify_reports_a_short_arena_file_as_bad(space, capsys):
    rank_dir, _ = space
    member1 = rank_dir.parent.parent / "d1" / "rank0"
    os.truncate(member1 / "arena-0.bin", 0)
    code, out, _ = run(capsys, rank_dir)
    assert code == 0 and "SHORT: 0 bytes on disk" in out
    code, out, _ = run(capsys, rank_dir, "--verify")
    assert code == 1
    assert "0 bad" not in out.splitlines()[-1]
    assert all("shorter than its manifest says" in line for line in out.splitlines() if line.startswith("BAD"))


def test_verify_progress_bar_on_a_terminal(space, capsys, monkeypatch):
    rank_dir, _ = space
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, _, err = run(capsys, rank_dir, "--verify")
    assert code == 1 and "\r[" in err and "/9 tensors, " in err  # 1: scratch/param has no checksum
    assert err.endswith("\r\033[K")  # cleared at the end


# -- --tensor ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["layers.0.attn.weight/param", "layers.0.attn.bias/param", "embed.weight/param",
                                  "step/count", "mask/buffer", "scratch/param"])  # fmt: skip
def test_tensor_stats_match_torch(space, capsys, name):
    rank_dir, tensors = space
    code, out, _ = run(capsys, rank_dir, "--tensor", name, "--json")
    assert code == 0
    (record,) = json.loads(out)["records"]
    t = tensors[name].to(torch.float64)  # the tool computes in float64; exact for these dtypes
    assert record["dtype"] == dtype_name(tensors[name].dtype) and record["shape"] == list(tensors[name].shape)
    assert record["status"] == ("unverified" if name == "scratch/param" else "ok")
    s = record["stats"]
    assert s["min"] == t.min().item() and s["max"] == t.max().item()
    # Chunked float64 sums against torch's: equal to rounding (1e-12 relative).
    assert s["mean"] == pytest.approx(t.mean().item(), rel=1e-12, abs=1e-15)
    assert s["norm"] == pytest.approx(torch.linalg.vector_norm(t).item(), rel=1e-12)
    assert (s["nan"], s["inf"], s["finite"]) == (0, 0, t.numel())


def test_tensor_nan_and_inf(space, capsys):
    rank_dir, tensors = space
    name = "layers.0.norm.weight/exp_avg_sq"
    code, out, _ = run(capsys, rank_dir, "--tensor", name, "--json")
    assert code == 0
    (record,) = json.loads(out)["records"]
    t = tensors[name]
    finite = t[torch.isfinite(t)]
    s = record["stats"]
    assert (s["nan"], s["inf"], s["finite"]) == (3, 3, 294)
    assert s["min"] == finite.min().item() and s["max"] == finite.max().item()
    assert s["mean"] == pytest.approx(finite.mean().item(), rel=1e-12)


def test_tensor_text_record(space, capsys):
    rank_dir, _ = space
    code, out, _ = run(capsys, rank_dir, "--tensor", "layers.0.attn.weight/param")
    assert code == 0
    assert "dtype       float32" in out and "shape       [64, 48]" in out and "(verified)" in out
    extents = [line for line in out.splitlines() if line.startswith("  extent ")]
    assert len(extents) == 2 and str(rank_dir / "arena-0.bin") in extents[0] and "/d1/rank0/arena-0.bin" in extents[1]
    assert "NaN 0, Inf 0" in out


def test_tensor_checksum_mismatch(space, capsys):
    rank_dir, _ = space
    flip_byte(rank_dir, "embed.weight/param")
    code, out, _ = run(capsys, rank_dir, "--tensor", "embed.weight/param")
    assert code == 1 and "MISMATCH" in out and "BAD: checksum mismatch in tensor 'embed.weight/param'" in out


# -- errors: one line, exit status 2 ----------------------------------------------------------
def assert_error(capsys, args, *needles) -> str:
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("swap-inspect: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_missing_directory(tmp_path, capsys):
    assert_error(capsys, [tmp_path / "nope"], "does not exist")


def test_empty_directory(tmp_path, capsys):
    assert_error(capsys, [tmp_path], "not a swap space")


def test_a_checkpoint_root_without_latest_says_so(tmp_path, capsys):
    """A checkpoint root whose saves never finished (a `.tmp-` directory, the root's lock, no
    `latest`), and one whose `latest` is gone beside a whole checkpoint: each is said as what it
    is, not as "not a swap space" (an audit helper's note)."""
    (tmp_path / ".lock").write_text("1 host\n")
    (tmp_path / ".tmp-step-3.123.abcd").mkdir()
    assert_error(capsys, [tmp_path], "is a checkpoint root with no 'latest' file", ".tmp-step-3.123.abcd")
    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / "meta.json").write_text("{}")
    assert_error(capsys, [tmp_path], "give one checkpoint's directory: step-2")


def test_member_directory_is_not_the_space(space, capsys):
    rank_dir, _ = space
    assert_error(capsys, [rank_dir.parent.parent / "d1"], "not a swap space", "first member")


def test_unknown_manifest_version(space, capsys):
    rank_dir, _ = space
    m = manifest_of(rank_dir)
    m["version"] = 99
    (rank_dir / MANIFEST_NAME).write_text(json.dumps(m))
    assert_error(capsys, [rank_dir], "unknown version 99")


def test_escaping_file_name(space, capsys):
    rank_dir, _ = space
    m = manifest_of(rank_dir)
    m["files"][0]["name"] = "../../etc/passwd"
    (rank_dir / MANIFEST_NAME).write_text(json.dumps(m))
    assert_error(capsys, [rank_dir.parent], "files[0].name", "../../etc/passwd")


def test_member_of_another_space(space, tmp_path, capsys):
    rank_dir, _ = space
    other = build_space([tmp_path / "e0", tmp_path / "e1"], {"x/param": torch.ones(1)})
    m = manifest_of(rank_dir)
    m["members"][1] = str(other.parent.parent / "e1" / "rank0")
    (rank_dir / MANIFEST_NAME).write_text(json.dumps(m))
    assert_error(capsys, [rank_dir], "space.json: belongs to space")


def test_unknown_tensor(space, capsys):
    rank_dir, _ = space
    line = assert_error(capsys, [rank_dir, "--tensor", "layers.0.attn.weight/parma"], "9 tensors")
    assert "close matches: 'layers.0.attn.weight/param'" in line


# -- the installed script ---------------------------------------------------------------------
def test_installed_script(space):
    rank_dir, _ = space
    script = Path(sys.executable).parent / "swap-inspect"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "infinity.tools.swap_inspect"]
    proc = subprocess.run([*cmd, str(rank_dir), "--verify", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # scratch/param has no checksum: not verified
    assert json.loads(proc.stdout)["verify"]["bad"] == 0
    proc = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for section in ("usage: swap-inspect DIR", "description:", "output:", "exit status:"):
        assert section in proc.stdout
    assert swap_inspect.SYNOPSIS in proc.stdout


def test_a_checkpoint_root_shows_its_newest_checkpoint(tmp_path, capsys):
    """DIR may be a checkpoint root (its `latest` is followed) or one checkpoint: the header
    says what meta.json says, the ranks are listed as for a swap space, --json carries both."""
    import infinity
    from torch import nn

    torch.manual_seed(0)
    engine = infinity.initialize(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), {})
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path / "ck", client_state={"epoch": 1})
    engine.save_checkpoint(tmp_path / "ck", tag="best")
    engine.close()
    assert main([str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint best: {tmp_path / 'ck' / 'best'}" in out
    assert "step 1, saved by 1 rank(s) at stage 3, params fp32, 2 units" in out
    assert "0/exp_avg_sq" in out and "optimizer/steps" in out
    assert main([str(tmp_path / "ck" / "step-1"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["checkpoint"]["tag"] == "step-1" and data["checkpoint"]["client_state_keys"] == ["epoch"]
    assert [r["rank"] for r in data["ranks"]] == [0]
    (tmp_path / "ck" / "latest").write_text("../elsewhere\n")
    assert main([str(tmp_path / "ck")]) == 2
    assert "checkpoint tag '../elsewhere'" in capsys.readouterr().err


def _world_size(ckpt: Path, world: int) -> None:
    """meta.json as if ``world`` ranks had saved the checkpoint (sealed again)."""
    from infinity.checkpoint import seal

    meta = json.loads((ckpt / "meta.json").read_text())
    meta["world_size"], meta["rng"] = world, [meta["rng"][0]] * world  # each rank's RNG states
    meta["spaces"] = [meta["spaces"][0]] * world  # and spaces
    (ckpt / "meta.json").write_text(json.dumps(seal(meta)))


def test_a_checkpoint_with_a_rank_missing_or_out_of_place_is_bad(tmp_path, capsys):
    """The ranks a checkpoint's meta.json says saved it must each be there, in their own
    directory, and no other: it said "N verified, 0 bad" and exit 0 for a 2-rank checkpoint
    with rank1/ gone, or a copy of rank0/ (an audit helper's repro), which a load refuses."""
    import shutil

    import infinity
    from torch import nn

    engine = infinity.initialize(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), {})
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    ckpt = tmp_path / "ck" / "step-1"
    assert main([str(ckpt), "--verify"]) == 0
    assert "BAD" not in capsys.readouterr().out
    _world_size(ckpt, 2)  # as saved by 2 ranks, rank1/ gone
    assert main([str(tmp_path / "ck"), "--verify"]) == 1
    out = capsys.readouterr().out
    assert f"BAD {ckpt / 'rank1'}: rank 1 of 2 is missing: the checkpoint is incomplete" in out
    shutil.copytree(ckpt / "rank0", ckpt / "rank1")  # rank 0's copy in its place
    assert main([str(ckpt), "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["checkpoint"]["problems"]
    assert problems == [f"{ckpt / 'rank1'}: holds rank 0, not rank 1"]
    _world_size(ckpt, 1)  # a rank the save did not write
    assert main([str(ckpt)]) == 1
    assert f"BAD {ckpt / 'rank1'}: rank 0 is not one of the 1 rank(s) that saved the checkpoint" in capsys.readouterr().out


# -- files that cannot be read: one line, exit status 2 ---------------------------------------
def _with_bad_byte(path: Path) -> int:
    """Put a byte that is not UTF-8 into ``path`` (inside a key); return its offset."""
    raw = path.read_bytes()
    at = raw.index(b'"space_id"') + 1
    path.write_bytes(raw[:at] + b"\xff" + raw[at + 1 :])
    return at


@pytest.mark.parametrize("member", [0, 1])  # 0: the manifest; 1: the other member's space.json
def test_bytes_that_are_not_utf8(space, capsys, member):
    rank_dir, _ = space
    path = rank_dir / MANIFEST_NAME if member == 0 else rank_dir.parent.parent / "d1" / "rank0" / SPACE_NAME
    at = _with_bad_byte(path)
    assert_error(capsys, [rank_dir, "--verify"], f"{path}: not UTF-8: byte 0xff at offset {at}")


@pytest.mark.parametrize("edit, needle", [
    (lambda text: '{"x":' + "[" * 5000 + "]" * 5000 + "," + text[1:], "nested more than 100 levels deep"),
    (lambda text: '{"rank":1,' + text[1:], "key 'rank' appears twice in one object"),
])  # fmt: skip
def test_a_manifest_that_is_not_plain_json(space, capsys, edit, needle):
    rank_dir, _ = space
    path = rank_dir / MANIFEST_NAME
    path.write_text(edit(path.read_text()))
    assert_error(capsys, [rank_dir, "--verify"], f"{path}: {needle}")


@pytest.mark.parametrize("record, needle", [
    # torch multiplies every size, so the 0 does not save it: no tensor has this shape
    ({"shape": [1 << 40, 1 << 40, 0], "nbytes": 0, "extents": []}, ".shape: [1099511627776, 1099511627776, 0] is no"),
    # as many bytes as the shape says, but 4TiB past the end of a 64KiB arena file
    ({"shape": [1 << 41], "nbytes": 1 << 42, "extents": [[0, 0, 1 << 42]]},
     ".extents[0]: 4398046511104 bytes at offset 0"),
    ({"shape": [-48]}, ".shape: [-48] is not a list of sizes"),
    ({"nbytes": 100}, ".nbytes: 100 is not [48] x bfloat16"),
])  # fmt: skip
def test_a_shape_no_tensor_can_have_is_a_bad_manifest(space, capsys, record, needle):
    rank_dir, _ = space
    m = manifest_of(rank_dir)
    m["tensors"]["layers.0.attn.bias/param"].update(record)
    (rank_dir / MANIFEST_NAME).write_text(json.dumps(m))
    for args in ([], ["--verify"], ["--tensor", "layers.0.attn.bias/param"]):
        assert_error(capsys, [rank_dir, *args], "manifest.json: tensors['layers.0.attn.bias/param']" + needle)


@pytest.mark.parametrize("content, needle", [
    (b'{"format": "infinity-\xffcheckpoint"}', "not UTF-8: byte 0xff at offset 21"),
    (b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested more than 100 levels deep"),
    (b'{"step": 1, "step": 2}', "key 'step' appears twice in one object"),
])  # fmt: skip
def test_a_meta_json_that_is_not_plain_json(tmp_path, capsys, content, needle):
    """meta.json goes through the same reader: swap-inspect says what is wrong in one line, and
    load_meta (what the engine's load_checkpoint reads it with) raises CheckpointError naming it."""
    from infinity.checkpoint import CheckpointError, load_meta

    checkpoint = tmp_path / "ck" / "step-1"
    checkpoint.parent.mkdir()
    build_space([checkpoint], {"x/param": torch.ones(4)})
    (checkpoint / "meta.json").write_bytes(content)
    assert_error(capsys, [checkpoint], f"{checkpoint / 'meta.json'}: {needle}")
    with pytest.raises(CheckpointError, match=re.escape(f"{checkpoint / 'meta.json'}: {needle}")):
        load_meta(str(checkpoint))


def test_names_with_terminal_escapes_are_shown_escaped_and_json_keeps_them_exact(tmp_path, capsys):
    """A tensor name, a state kind or a stray file's name may hold control characters (an
    escape sequence that clears the screen or retitles the terminal): the human output shows
    such a name as its Python repr, every character printable; --json keeps the exact name."""
    evil, stray = "evil\x1b[2J\x07/par\x9bam", "junk\x1b]0;owned\x07"
    rank_dir = build_space([tmp_path / "d0"], {evil: torch.ones(10), "plain/param": torch.zeros(3)})
    (rank_dir / stray).write_text("x")
    outputs = []
    for args in ([], ["--verify"], ["--tensor", evil]):
        code, out, err = run(capsys, rank_dir, *args)
        assert code == 0, err
        outputs.append(out)
        assert all(line.isprintable() for line in out.splitlines()), out
    summary, verified, tensor = outputs
    assert repr(evil) in summary and repr(str(rank_dir / stray)) in summary and repr("par\x9bam") in summary
    assert "plain/param" in summary and "'plain/param'" not in summary  # printable names as they are
    assert f"  tensor      {evil!r}" in tensor.splitlines()
    code, out, _ = run(capsys, rank_dir, "--tensor", evil, "--json")
    assert code == 0 and json.loads(out)["records"][0]["name"] == evil
    code, out, _ = run(capsys, rank_dir, "--json")
    assert {t["name"] for t in json.loads(out)["ranks"][0]["tensors"]} == {evil, "plain/param"}
