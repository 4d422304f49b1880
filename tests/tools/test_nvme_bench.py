"""nvme-bench: its command-line contract and its size parser.

Runs use a few MiB so the whole file takes seconds; the figures themselves are not checked
(the disk is shared and noisy), only that they are there and sane. Whichever backends run
here are measured (threads always; uring once the extension is built; aiofiles if installed).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

from infinity.tools import nvme_bench
from infinity.tools.nvme_bench import format_size, parse_size

SMALL = ["--quick", "--size", "8MiB", "--repeat", "1"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The tool as a user runs it: a fresh process, its real exit status and streams."""
    cmd = [sys.executable, "-m", "infinity.tools.nvme_bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def snippet_of(stdout: str) -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    assert "[aio]" in stdout, stdout
    return tomllib.loads(stdout[stdout.index("[aio]") :])


# -- sizes ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, nbytes",
    [("4096", 4096), ("128K", 128 << 10), ("128KiB", 128 << 10), ("128kb", 128 << 10), ("4M", 4 << 20),
     ("64MiB", 64 << 20), ("1GiB", 1 << 30), ("1g", 1 << 30), ("1.5G", 3 << 29), (" 2 MiB ", 2 << 20),
     ("512B", 512), ("1PiB", 1 << 50)],
)  # fmt: skip
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "abc", "1X", "-1M", "1.5", "0.5K1", "Mi", "1iB", "1 G G"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(
    "nbytes, text", [(1 << 20, "1MiB"), (128 << 10, "128KiB"), (3 << 30, "3GiB"), (4097, "4097")]
)
def test_format_size_round_trips(nbytes, text):
    assert format_size(nbytes) == text
    assert parse_size(text) == nbytes


# -- runs -------------------------------------------------------------------------------------
def test_quick_json(tmp_path):
    proc = run_cli(str(tmp_path), *SMALL, "--json")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]  # every line is JSON
    measurements = [obj for obj in lines if obj["type"] == "measurement"]
    assert [obj["type"] for obj in lines] == ["measurement"] * len(measurements) + ["summary"]
    assert {m["backend"] for m in measurements} >= {"threads"}
    assert {m["op"] for m in measurements} == {"read", "write"}
    for m in measurements:
        assert m["block_size"] == 1 << 20 and m["queue_depth"] == 32
        assert 0 < m["gbps_min"] <= m["gbps_median"] <= m["gbps_max"] < 1000, m
        assert len(m["repeats"]) == 1
    summary = lines[-1]
    assert summary["aio"]["backend"] in ("uring", "threads")
    assert summary["aio"]["block_size"] == 1 << 20 and summary["aio"]["queue_depth"] == 32
    assert set(summary["best"]) == {"read", "write"}
    assert list(tmp_path.iterdir()) == []


def test_human_output_has_a_toml_snippet(tmp_path):
    proc = run_cli(str(tmp_path), *SMALL, "--backends", "threads")
    assert proc.returncode == 0, proc.stderr
    assert "threads" in proc.stdout and "GB/s" in proc.stdout
    assert snippet_of(proc.stdout) == {"aio": {"backend": "threads", "block_size": "1MiB", "queue_depth": 32}}
    assert proc.stderr == ""  # no progress bar when stderr is not a terminal
    assert list(tmp_path.iterdir()) == []


def test_unavailable_backend_is_skipped_with_its_reason(tmp_path, capsys, monkeypatch):
    reason = "io_uring_setup: EPERM (test)"
    real = nvme_bench.probe_backends
    down = nvme_bench.aio.BackendStatus(False, reason)
    monkeypatch.setattr(nvme_bench, "probe_backends", lambda: {**real(), "uring": down})
    assert nvme_bench.main([str(tmp_path), *SMALL, "--backends", "uring,threads", "--ops", "read"]) == 0
    out = capsys.readouterr().out
    assert f"uring: skipped: {reason}" in out
    assert snippet_of(out)["aio"]["backend"] == "threads"
    assert list(tmp_path.iterdir()) == []


def test_block_size_and_queue_depth_sweep(tmp_path, capsys):
    sweep = ["--block-sizes", "256K,1M", "--queue-depths", "2,8"]
    assert nvme_bench.main([str(tmp_path), *SMALL, "--backends", "threads", *sweep, "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    settings = {(m["op"], m["block_size"], m["queue_depth"]) for m in lines if m["type"] == "measurement"}
    expected = {(op, bs, qd) for op in ("read", "write") for bs in (256 << 10, 1 << 20) for qd in (2, 8)}
    assert settings == expected
    best = lines[-1]["aio"]
    assert (best["block_size"], best["queue_depth"]) in {(bs, qd) for _, bs, qd in settings}


def test_buffered_fallback_is_said(tmp_path, capsys, monkeypatch):
    """Where the filesystem refuses O_DIRECT (EINVAL, as tmpfs did before Linux 6.6)."""
    real_open = os.open

    def refuse_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_direct)
    assert nvme_bench.main([str(tmp_path), *SMALL, "--json"]) == 0
    captured = capsys.readouterr()
    assert "O_DIRECT was refused" in captured.err
    summary = json.loads(captured.out.splitlines()[-1])
    assert summary["direct"] is False and any("O_DIRECT" in note for note in summary["notes"])
    assert list(tmp_path.iterdir()) == []


def test_slow_figures_keep_their_precision_in_json():
    # A run 90x slower than fio printed ratio 0.0112 for 0.011230, 1.9e-3 off the ratio of the
    # printed figures themselves (the CI failure of test_fio_comparison).
    r = nvme_bench.Result(backend="threads", op="read", block_size=1 << 20, queue_depth=4,
                          gbps=[0.0312299, 0.0312201, 0.03121], fio_gbps=[2.780962])  # fmt: skip
    out = r.to_json()
    assert out["gbps_median"] == pytest.approx(0.03122, rel=1e-4)
    assert out["ratio"] == pytest.approx(0.0312201 / 2.780962, rel=1e-4)
    assert out["ratio"] == pytest.approx(out["gbps_median"] / out["fio_gbps"], rel=1e-4)


@pytest.mark.fio
@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_comparison(tmp_path):
    proc = run_cli(str(tmp_path), *SMALL, "--backends", "threads", "--fio", "--json")
    assert proc.returncode == 0, proc.stderr
    measurements = [json.loads(line) for line in proc.stdout.splitlines()][:-1]
    for m in measurements:
        assert m["fio_gbps"] > 0 and len(m["fio_repeats"]) == 1
        assert m["ratio"] == pytest.approx(m["gbps_median"] / m["fio_gbps"], rel=1e-3)
    assert list(tmp_path.iterdir()) == []


def test_fio_missing_is_bad_input(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(nvme_bench.shutil, "which", lambda name: None)
    assert nvme_bench.main([str(tmp_path), *SMALL, "--fio"]) == 2
    assert "fio" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# -- bad input: one line on stderr naming the value, exit status 2, nothing left behind --------
def _unwritable_dir(tmp_path) -> str:
    if os.geteuid() != 0:
        path = tmp_path / "ro"
        path.mkdir(mode=0o500)
        return str(path)
    # root ignores permission bits; /proc/sys refuses new files even to root.
    if not os.path.isdir("/proc/sys"):
        pytest.skip("running as root and /proc/sys is missing: no directory here refuses root")
    return "/proc/sys"


@pytest.mark.parametrize(
    "case, args, named",
    [
        ("missing", ["{tmp}/nope"], "nope"),
        ("a file", ["{tmp}/file"], "file"),
        ("parent is a file", ["{tmp}/file/sub"], "sub"),
        ("unwritable", ["{ro}"], "not writable"),
        ("no room", ["{tmp}", "--size", "1PiB"], "1PiB"),
        ("not a multiple", ["{tmp}", "--size", "3MiB", "--block-sizes", "2M"], "3MiB"),
        ("bad size", ["{tmp}", "--size", "lots"], "lots"),
        ("zero size", ["{tmp}", "--size", "0"], "'0'"),
        ("unaligned block", ["{tmp}", "--size", "1000", "--block-sizes", "1000"], "1000"),
        ("negative depth", ["{tmp}", "--queue-depths", "8,-4"], "-4"),
        ("zero repeat", ["{tmp}", "--repeat", "0"], "--repeat"),
        ("unknown backend", ["{tmp}", "--backends", "threads,spdk"], "spdk"),
        ("unknown op", ["{tmp}", "--ops", "read,trim"], "trim"),
    ],
)
def test_bad_input(tmp_path, capsys, case, args, named):
    (tmp_path / "file").write_text("not a directory")
    before = sorted(tmp_path.iterdir())
    ro = _unwritable_dir(tmp_path) if case == "unwritable" else ""
    argv = [a.format(tmp=tmp_path, ro=ro) for a in args] + ["--quick"]
    assert nvme_bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nvme-bench: error: "), err
    assert named in err
    assert sorted(tmp_path.iterdir()) == before


def test_no_room_says_a_small_free_space_in_its_own_unit(tmp_path, monkeypatch):
    """50 MiB free was said as "0.0GiB free" (an audit helper's note)."""
    real = os.statvfs
    monkeypatch.setattr(nvme_bench.os, "statvfs", lambda d: os.statvfs_result(
        (4096, 4096, 1 << 20, 12800, 12800, 0, 0, 0, 0, 255)) if d == str(tmp_path) else real(d))  # fmt: skip
    with pytest.raises(nvme_bench.BadInput, match=r"--size=1GiB does not fit in .*: 50(\.0)? ?MiB free"):
        nvme_bench.check_directory(str(tmp_path), 1 << 30)


def test_bad_input_exit_status_of_the_command(tmp_path):
    proc = run_cli(str(tmp_path), "--backends", "nope", "--quick")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "'nope'" in proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []


def test_argparse_errors_exit_2(tmp_path):
    proc = run_cli(str(tmp_path), "--no-such-option")
    assert proc.returncode == 2 and "--no-such-option" in proc.stderr


def test_help_reads_like_a_man_page():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for section in ("usage: nvme-bench PATH", "description:", "output:", "exit status:"):
        assert section in proc.stdout
