"""KV blocks handed between engines through shared storage: the connector of disaggregated prefill and decode
(vLLM's ``SharedStorageConnector`` role), configured by ``config.KVTransferConfig``.

Contract:
- Blocks are stored by their prefix-cache hash (``kv/hashing.py``: a chained hash of the whole prefix, so a stored
  block is valid for any prompt that begins with the same tokens) under ``<shared_storage_path>/<fingerprint>/``,
  one safetensors file per block holding its K/V rows in every layer (``[layers, 2, block_size, kv_heads,
  head_dim]``). The fingerprint (``layout_dir``) covers what makes KV bytes interchangeable: the model's weights
  file names and sizes, architecture, layer/head shapes, block size and KV dtype, so engines of another model never
  read each other's blocks.
- ``StoredBlocks`` (the scheduler's side, no torch): ``count(hashes)`` is how many of ``hashes``, in order, are
  stored (a lookup stops at the first missing one, as a prefix must be unbroken).
- ``KVStore`` (the worker's side): ``save(block_ids, hashes)`` writes the blocks not stored yet (to a temporary name,
  then renamed: a reader never sees half a file); ``load(block_ids, hashes)`` copies stored blocks into the given
  blocks of every layer's cache, and raises naming the block when its file is gone or does not fit.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUFFIX = ".safetensors"


def layout_dir(root: str, model_dir: Path, layout: dict[str, Any]) -> Path:
    """The folder of this model's blocks under ``root`` (see the module doc), created when missing."""
    files = sorted((p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors"))
    key = repr((files, sorted(layout.items())))
    folder = Path(root) / f"{model_dir.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class StoredBlocks:
    """Which blocks are stored (the scheduler asks before computing a new request's prompt)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def count(self, hashes: Sequence[bytes]) -> int:
        for index, block_hash in enumerate(hashes):
            if not os.path.exists(os.path.join(self.folder, block_hash.hex() + SUFFIX)):
                return index
        return len(hashes)


class KVStore:
    """Saves and loads blocks of one worker's KV caches (one ``[2, blocks, block_size, heads, dim]`` per layer)."""

    def __init__(self, folder: Path, kv_caches: list[Any]) -> None:
        self.folder = folder
        self.kv_caches = kv_caches

    def _path(self, block_hash: bytes) -> Path:
        return self.folder / (block_hash.hex() + SUFFIX)

    def save(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> int:
        """Store the blocks not stored yet; returns how many it wrote."""
        import torch
        from safetensors.torch import save_file

        written = 0
        for block_id, block_hash in zip(block_ids, hashes):
            path = self._path(block_hash)
            if path.exists():
                continue
            rows = torch.stack([cache[:, block_id] for cache in self.kv_caches])
            handle, partial = tempfile.mkstemp(dir=self.folder, suffix=".partial")
            os.close(handle)
            save_file({"kv": rows.contiguous()}, partial)
            os.replace(partial, path)
            written += 1
        return written

    def load(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> None:
        from safetensors import safe_open

        for block_id, block_hash in zip(block_ids, hashes):
            path = self._path(block_hash)
            try:
                with safe_open(str(path), framework="pt") as stored:
                    rows = stored.get_tensor("kv")
            except (OSError, RuntimeError) as exc:
                raise RuntimeError(f"stored KV block {path} cannot be read ({exc}); it was found when the request "
                                   "was scheduled, so something removed or damaged it") from None
            expected = (len(self.kv_caches), *self.kv_caches[0][:, block_id].shape)
            if tuple(rows.shape) != expected or rows.dtype != self.kv_caches[0].dtype:
                raise RuntimeError(f"stored KV block {path} holds {tuple(rows.shape)} {rows.dtype}, this engine's "
                                   f"blocks are {expected} {self.kv_caches[0].dtype}")
            for layer, cache in enumerate(self.kv_caches):
                cache[:, block_id].copy_(rows[layer])
