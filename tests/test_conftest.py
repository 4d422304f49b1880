"""The fixtures of tests/conftest.py that every test runs under."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

INNER = '''
def test_passes(tmp_path):
    (tmp_path / "arena").write_bytes(b"x" * (1 << 20))

def test_fails(tmp_path):
    (tmp_path / "arena").write_bytes(b"x" * (1 << 20))
    assert False, "kept to be looked at"

def test_without_tmp_path():
    pass
'''


def test_tmp_path_is_removed_after_a_passing_test_and_kept_after_a_failing_one(tmp_path):
    """A suite run under this conftest (in a child pytest, with its own --basetemp) leaves
    nothing of a test that passed and everything of one that failed."""
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), suite / "conftest.py")
    (suite / "test_inner.py").write_text(INNER)
    (suite / "pytest.ini").write_text("[pytest]\n")
    base = tmp_path / "base"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={base}",
                           f"--rootdir={suite}", "-c", str(suite / "pytest.ini"), str(suite)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "1 failed, 2 passed" in done.stdout, done.stdout + done.stderr
    left = sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())
    assert left == ["test_fails0/arena"], left
