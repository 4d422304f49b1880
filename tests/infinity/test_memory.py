"""Peak host memory with every tier on nvme: bounded by the budget, not by the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

MiB = 1 << 20


def _measure(tmp_path, *args: str) -> dict:
    """Run _memory_child.py with ``args`` (width, layers, budget, vocab, tile size, sub-group
    size, and "cold": no engine run before the one measured) on a swap directory under ``tmp_path``; its JSON report."""
    path = tmp_path / "swap"
    path.mkdir()
    child = os.path.join(os.path.dirname(__file__), "_memory_child.py")
    out = subprocess.run([sys.executable, child, str(path), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_rss_is_bounded_by_the_budget_not_the_model(tmp_path):
    """A 67M-parameter model (1.07 GB of fp32 state: params, grads, two Adam moments) built
    straight into nvme and trained two steps, in a fresh process whose peak RSS is reset just
    before the model is built. Bound, by hand: the host budget (64 MiB: every buffer the
    engine holds; the 4 MiB layers in 2 MiB tiles and 8 MiB sub-groups, so that the step and
    its slack fit) + activations (64 layers x 8 x 1024 floats, a few copies each: < 8 MiB) +
    8 fp32 copies of the largest unit outside the pool (autograd's weight gradient, the
    builder's and initialize's transient copies: 8 x 2 MiB) + 16 MiB for the interpreter,
    torch and the allocator."""
    r = _measure(tmp_path, "1024", "64", "64MiB", "0", "2MiB", "8MiB")
    bound = 64 * MiB + 8 * MiB + 8 * r["largest_unit_bytes"] + 16 * MiB
    assert r["growth"] < bound, r
    # The bound counts on the budget holding what is read and written: a buffer taken outside
    # the pool would leave it idle (the pool's own peak cannot pass the budget: it refuses).
    assert r["pool_peak"] >= 2 * r["largest_unit_bytes"], r
    ratio = r["state_bytes"] / r["growth"]
    print(f"fp32 state {r['state_bytes'] / MiB:.0f} MiB, peak RSS growth {r['growth'] / MiB:.0f} MiB: {ratio:.1f}x")
    assert ratio >= 10, r


def test_a_vocabulary_sized_module_in_tiles_does_not_set_the_memory_floor(tmp_path):
    """An embedding and an output layer of 32768 x 64 (8 MiB of fp32 each) around 16 small
    layers, tiled at 256 KiB, trained under a 12 MiB host budget: whole, their units alone
    would need (depth + 1) x 4 + 3 x 4 bytes = 24 x 8 MiB = 192 MiB for forward and backward.
    Bound, by hand: the host budget + activations (8 ids x 32768 logits x 4 bytes, a few
    copies: < 8 MiB) + the tiled module's values whole once (`build` initialises a module
    whole: 8 MiB) + 8 fp32 copies of the largest unit outside the pool (a tile, 256 KiB) +
    16 MiB for the interpreter, torch and the allocator."""
    r = _measure(tmp_path, "64", "16", "12MiB", "32768", "256KiB", "1MiB")
    # tiles of 1024 rows (the embedding) and of 960 (the output layer, with its bias: the
    # budget's 1008 rows, down to a multiple of _units.TILE_ROW_ALIGN)
    assert r["tiles"] == 32 + 35, r
    assert r["largest_unit_bytes"] <= 256 * 1024 and r["largest_module_bytes"] > 8 * MiB, r
    bound = 12 * MiB + 8 * MiB + r["largest_module_bytes"] + 8 * r["largest_unit_bytes"] + 16 * MiB
    assert r["growth"] < bound, r
    assert r["pool_peak"] >= 2 * r["largest_unit_bytes"], r  # the tiles went through the pool
    print(f"fp32 state {r['state_bytes'] / MiB:.0f} MiB, peak RSS growth {r['growth'] / MiB:.1f} MiB, "
          f"bound {bound / MiB:.1f} MiB")


def test_peak_rss_stays_within_the_budget_with_unit_sized_gradients(tmp_path):
    """24 x Linear(2048, 2048) fp32 (16 MiB per layer: its weight gradient from autograd is as
    large as a unit), built with `infinity.build` in a process that ran no engine before (a
    user's script), every tier on nvme, host_budget 256 MiB, 32 MiB sub-groups, batch 8,
    trained two steps. The promise `memory.host_budget` makes, with a
    batch whose activations are small (8 x 2048 floats per layer: 64 KiB): the process's peak
    RSS growth from before the model is built stays within 1.25 x the budget + 128 MiB for
    what is not the pool (autograd's gradients before the hooks take them, the builder's and
    initialize's copies of a unit, glibc's free lists, the interpreter). `engine.stats()`
    reports the process's peak RSS beside the pool's: the figure the kernel gives (VmHWM)."""
    r = _measure(tmp_path, "2048", "24", "256MiB", "0", "64MiB", "32MiB", "cold")
    budget = 256 * MiB
    assert r["pool_peak"] >= 2 * r["largest_unit_bytes"], r  # the units went through the pool
    assert r["growth"] <= 1.25 * budget + 128 * MiB, r
    # The steps hold what initialize left (the pool's slab, torch) and a few of autograd's
    # unit-sized gradients at a time, which the hooks take as they come: not one per layer.
    # (With glibc's mmap threshold raised by the build's frees, backward's gradients came from
    # the heap and stayed there until the step's trim: 235 to 285 MiB here.)
    assert r["training_growth"] <= 4 * r["largest_unit_bytes"], r
    # stats() read VmHWM just before the child did, with nothing large allocated between
    assert r["stats_peak_rss"] is not None, r
    assert r["peak_rss"] - 4 * MiB <= r["stats_peak_rss"] <= r["peak_rss"], r
    print(f"peak RSS growth {r['growth'] / MiB:.0f} MiB ({r['growth'] / budget:.2f} x host_budget), "
          f"{r['training_growth'] / MiB:.0f} MiB of it in the steps, pool peak {r['pool_peak'] / MiB:.0f} MiB")
