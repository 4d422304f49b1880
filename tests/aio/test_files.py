"""infinity.aio.open_file: modes, O_DIRECT, and the buffered fallback where O_DIRECT is refused."""

from __future__ import annotations

import errno
import importlib
import logging
import os

import pytest

import infinity.aio as aio

_files = importlib.import_module("infinity.aio._files")


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "infinity.aio" and r.levelno >= logging.WARNING]


def test_direct_file_on_local_disk(tmp_path):
    with aio.open_file(tmp_path / "f", "w+") as f:
        if not f.direct:
            pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
        assert f.mem_align >= 1 and f.offset_align >= 1
        assert f.path == str(tmp_path / "f")


def test_buffered_file_needs_no_alignment(tmp_path):
    with aio.open_file(tmp_path / "f", "w+", direct=False) as f:
        assert not f.direct
        assert (f.mem_align, f.offset_align) == (1, 1)


def test_fallback_opens_buffered(tmp_path, o_direct_refused):
    with aio.open_file(tmp_path / "f", "w+") as f:
        assert not f.direct
        assert (f.mem_align, f.offset_align) == (1, 1)


def test_fallback_warns_once_per_filesystem(tmp_path, o_direct_refused, caplog):
    with caplog.at_level(logging.WARNING, logger="infinity.aio"):
        for name in ("a", "b", "c"):
            aio.open_file(tmp_path / name, "w+").close()
    (record,) = _warnings(caplog)
    assert "O_DIRECT" in record.getMessage()
    assert str(tmp_path / "a") in record.getMessage()


def test_fallback_warns_again_on_another_filesystem(tmp_path, shm_dir, o_direct_refused, caplog):
    if os.stat(tmp_path).st_dev == os.stat(shm_dir).st_dev:
        pytest.skip(f"{tmp_path} and {shm_dir} are on one filesystem")
    with caplog.at_level(logging.WARNING, logger="infinity.aio"):
        for directory in (tmp_path, shm_dir, tmp_path, shm_dir):
            aio.open_file(os.path.join(directory, "f"), "w+").close()
    assert len(_warnings(caplog)) == 2


@pytest.mark.parametrize("mode", ["w", "w+", "a+"])
def test_fallback_creates_file(tmp_path, o_direct_refused, mode):
    with aio.open_file(tmp_path / "f", mode) as f:
        assert not f.direct
    assert (tmp_path / "f").exists()


@pytest.mark.parametrize("mode", ["x", "x+"])
def test_fallback_exclusive_create(tmp_path, o_direct_refused, mode):
    with aio.open_file(tmp_path / "f", mode) as f:
        assert not f.direct


def test_exclusive_create_of_existing_file_raises(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        aio.open_file(tmp_path / "f", "x+")


def test_other_open_errors_are_not_swallowed(tmp_path):
    with pytest.raises(FileNotFoundError):
        aio.open_file(tmp_path / "missing", "r")


def test_unknown_mode_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="mode='rw'"):
        aio.open_file(tmp_path / "f", "rw")


def test_new_files_are_private(tmp_path):
    aio.open_file(tmp_path / "f", "w+").close()
    assert os.stat(tmp_path / "f").st_mode & 0o777 == 0o600


def test_a_plus_does_not_truncate(tmp_path):
    (tmp_path / "f").write_bytes(b"keep")
    with aio.open_file(tmp_path / "f", "a+", direct=False) as f:
        assert f.size() == 4


def test_close_is_idempotent_and_fileno_then_raises_ebadf(tmp_path):
    f = aio.open_file(tmp_path / "f", "w+")
    f.close()
    f.close()
    assert f.closed
    with pytest.raises(OSError) as exc:
        f.fileno()
    assert exc.value.errno == errno.EBADF
    assert exc.value.filename == str(tmp_path / "f")
