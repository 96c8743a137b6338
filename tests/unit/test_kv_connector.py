"""The shared-storage KV connector's store: blocks saved from one cache load into another bit for bit, a lookup
counts only an unbroken run of stored blocks, a saved block is not written twice, and a block that vanished or does
not fit this engine's cache is an error naming it."""

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


def test_a_missing_or_foreign_block_is_an_error_that_names_it(tmp_path: Path) -> None:
    store = KVStore(tmp_path, _caches(0))
    with pytest.raises(RuntimeError, match=r"stored KV block .*0a0a0a.*\.safetensors cannot be read"):
        store.load([0], [b"\x0a" * 16])
    store.save([0], [b"\x0b" * 16])
    with pytest.raises(RuntimeError, match=r"holds \(3, 2, 4, 2, 16\) torch.float32, this engine's blocks are "
                                           r"\(2, 2, 4, 2, 16\)"):
        KVStore(tmp_path, _caches(1, layers=2)).load([0], [b"\x0b" * 16])


def test_each_model_layout_has_its_own_folder(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x" * 10)
    first = layout_dir(str(tmp_path / "kv"), model, {"block_size": 16})
    assert first == layout_dir(str(tmp_path / "kv"), model, {"block_size": 16}) and first.is_dir()
    assert first != layout_dir(str(tmp_path / "kv"), model, {"block_size": 32})
    (model / "model.safetensors").write_bytes(b"x" * 11)  # other weights
    assert first != layout_dir(str(tmp_path / "kv"), model, {"block_size": 16})
