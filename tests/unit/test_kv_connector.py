"""The shared-storage KV connector's store: blocks saved from one cache load into another bit for bit, a lookup
counts only an unbroken run of stored blocks, a saved block is not written twice, and loading stops, with a warning
naming the file, at a block that vanished or does not fit this engine's cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagellm.disagg.connector import KVStore, StoredBlocks, layout_dir


def _caches(seed: int, layers: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 8, 4, 2, 16, generator=gen) for _ in range(layers)]  # [2, blocks, bs, heads, dim]


def test_saved_blocks_load_into_other_block_ids_bit_for_bit(tmp_path: Path) -> None:
    source, target = _caches(0), _caches(1)
    hashes = [bytes([i]) * 16 for i in range(3)]
    store = KVStore(tmp_path, source)
    assert store.save([5, 2, 7], hashes) == 3 and store.save([5, 2, 7], hashes) == 0  # written once
    KVStore(tmp_path, target).load([0, 1, 3], hashes)
    for src, dst in zip(source, target):
        assert torch.equal(dst[:, [0, 1, 3]], src[:, [5, 2, 7]])
    assert not list(tmp_path.glob("*.partial"))
    stored = StoredBlocks(str(tmp_path))
    assert stored.count(hashes) == 3
    assert stored.count([hashes[0], b"\x09" * 16, hashes[2]]) == 1  # a prefix must be unbroken
    assert stored.count([]) == 0


def test_loading_stops_at_a_missing_or_foreign_block_and_says_so(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    store = KVStore(tmp_path, _caches(0))
    store.save([0, 1], [b"\x0b" * 16, b"\x0c" * 16])
    target = KVStore(tmp_path, _caches(1))
    assert target.load([3, 4, 5], [b"\x0b" * 16, b"\x0a" * 16, b"\x0c" * 16]) == 1  # the second is gone
    assert "0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a.safetensors cannot be read" in caplog.text
    assert torch.equal(target.kv_caches[0][:, 3], store.kv_caches[0][:, 0])
    assert KVStore(tmp_path, _caches(1, layers=2)).load([0], [b"\x0b" * 16]) == 0
    assert "holds (3, 2, 4, 2, 16) torch.float32, this engine's blocks are (2, 2, 4, 2, 16)" in caplog.text


def test_each_model_layout_has_its_own_folder(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x" * 10)
    first = layout_dir(str(tmp_path / "kv"), model, {"block_size": 16})
    assert first == layout_dir(str(tmp_path / "kv"), model, {"block_size": 16}) and first.is_dir()
    assert first != layout_dir(str(tmp_path / "kv"), model, {"block_size": 32})
    (model / "model.safetensors").write_bytes(b"x" * 11)  # other weights
    assert first != layout_dir(str(tmp_path / "kv"), model, {"block_size": 16})


def test_a_store_past_its_size_drops_the_least_recently_used_blocks(tmp_path: Path) -> None:
    import os

    caches = _caches(0)
    KVStore(tmp_path, caches).save([0], [b"\x00" * 16])
    size = next(tmp_path.glob("*.safetensors")).stat().st_size  # one block's file
    folder = tmp_path / "store"
    folder.mkdir()
    store = KVStore(folder, caches, max_bytes=int(size * 3.5))  # room for three blocks
    hashes = [bytes([i + 1]) * 16 for i in range(5)]
    for i, block_hash in enumerate(hashes[:3]):
        store.save([i], [block_hash])
        os.utime(store._path(block_hash), (1000 + i, 1000 + i))  # saved one after another
    assert store.load([6], [hashes[0]]) == 1  # the oldest is used again: now the newest
    store.save([3], [hashes[3]])  # four blocks: over the limit, the least recently used go down to 90 %
    left = {p.name for p in folder.glob("*.safetensors")}
    assert left == {h.hex() + ".safetensors" for h in (hashes[0], hashes[2], hashes[3])}
    assert store.used <= 0.9 * store.max_bytes and StoredBlocks(str(folder)).count(hashes[:2]) == 1
