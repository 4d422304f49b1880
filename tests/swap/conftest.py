"""Fixtures for the swap layer tests."""

from __future__ import annotations

import pytest

import infinity.swap as swap


@pytest.fixture
def dirs(tmp_path):
    """dirs(n): n fresh directories standing for n drives."""

    def make(n: int = 1) -> list[str]:
        out = []
        for k in range(n):
            d = tmp_path / f"drive{k}"
            d.mkdir(exist_ok=True)
            out.append(str(d))
        return out

    return make


@pytest.fixture
def open_space(dirs):
    """open_space(n_dirs=1, **kwargs): a SwapSpace closed after the test (small grow steps)."""
    spaces = []

    def make(n_dirs: int = 1, **kwargs) -> swap.SwapSpace:
        kwargs.setdefault("grow_step", 4 << 20)
        kwargs.setdefault("host_budget", 256 << 20)
        space = swap.SwapSpace(kwargs.pop("paths", None) or dirs(n_dirs), **kwargs)
        spaces.append(space)
        return space

    yield make
    for space in spaces:
        if not space._closed:
            space.close()
