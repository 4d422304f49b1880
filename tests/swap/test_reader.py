"""SpaceReader: the read-only view swap-inspect uses."""

from __future__ import annotations

import os

import pytest
import torch

import infinity.swap as swap


def test_reader_reads_what_the_space_wrote(open_space, dirs):
    paths = dirs(2)
    space = open_space(paths=paths, verify="always", stripe_threshold=64 * 1024)
    tensors = {"a/param": torch.randn(100_000), "b/param": torch.arange(10, dtype=torch.int64)}
    for name, t in tensors.items():
        space.put(name, t).result()
    space.flush()
    with swap.SpaceReader(space.rank_dirs[0]) as reader:  # while the space still holds its lock
        for name, t in tensors.items():
            assert torch.equal(reader.read(name, verify=True), t)


def test_a_missing_arena_file_only_affects_the_tensors_in_it(open_space, dirs):
    space = open_space(paths=dirs(2), stripe_threshold=1 << 30)  # no striping: one file each
    space.put("a/param", torch.ones(1000)).result()
    space.put("b/param", torch.ones(1000)).result()
    space.close()
    on_file = {n: space.info(n).extents[0].file for n in ("a/param", "b/param")}
    assert sorted(on_file.values()) == [0, 1]
    lost = next(n for n, f in on_file.items() if f == 1)
    kept = next(n for n, f in on_file.items() if f == 0)
    os.unlink(os.path.join(space.rank_dirs[1], "arena-0.bin"))
    with swap.SpaceReader(space.rank_dirs[0]) as reader:
        assert torch.equal(reader.read(kept), torch.ones(1000))
        with pytest.raises(FileNotFoundError):
            reader.read(lost)


def test_a_directory_without_a_manifest_is_not_a_space(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a swap space"):
        swap.SpaceReader(tmp_path)


def test_read_chunks_gives_a_striped_tensor_in_bounded_pieces_and_checks_the_whole(open_space, dirs):
    """Pieces of 8 KiB over a tensor striped in 4 KiB extents over two files, its last extent
    short: their concatenation is the tensor; a flipped byte in the last extent is reported
    as the tensor's checksum mismatch, after the last piece."""
    space = open_space(paths=dirs(2), stripe_size=4096, stripe_threshold=8192)
    t = torch.randn(10_000, dtype=torch.float64)  # 80,000 bytes: 20 extents, the last 2,368 bytes
    space.put("a/param", t).result()
    space.close()
    extents = space.info("a/param").extents
    assert len({e.file for e in extents}) == 2 and extents[-1].nbytes % 4096
    with swap.SpaceReader(space.rank_dirs[0]) as reader:
        pieces = [p.clone() for p in reader.read_chunks("a/param", verify=True, chunk_bytes=8192)]
        assert [p.numel() for p in pieces] == [1024] * 9 + [784]
        assert torch.equal(torch.cat(pieces), t)
        last = extents[-1]
        path = reader.file_path(last.file)
    with open(path, "r+b") as f:
        f.seek(last.offset + 8)
        byte = f.read(1)
        f.seek(last.offset + 8)
        f.write(bytes([byte[0] ^ 0xFF]))
    with swap.SpaceReader(space.rank_dirs[0]) as reader:
        seen = 0
        with pytest.raises(swap.SwapCorruption, match="'a/param'"):
            for p in reader.read_chunks("a/param", verify=True, chunk_bytes=8192):
                seen += p.numel()
        assert seen == t.numel()
