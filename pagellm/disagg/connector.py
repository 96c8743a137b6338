"""KV blocks handed between engines through shared storage: the connector of disaggregated prefill and decode
(vLLM's ``SharedStorageConnector`` role), configured by ``config.KVTransferConfig``.

Contract:
- Blocks are stored by their prefix-cache hash (``kv/hashing.py``, or ``kv/hash_algos.py`` with
  ``--prefix-caching-hash-algo``, which both servers must then share: a chained hash of the whole prefix, so a stored
  block is valid for any prompt that begins with the same tokens) under ``<shared_storage_path>/<fingerprint>/``,
  one safetensors file per block holding its K/V rows in every layer (``[layers, 2, block_size, kv_heads,
  head_dim]``). The fingerprint (``layout_dir``) covers what makes KV bytes interchangeable: the model's weights
  file names and sizes, architecture, layer/head shapes, block size and KV dtype, so engines of another model never
  read each other's blocks.
- ``StoredBlocks`` (the scheduler's side, no torch): ``count(hashes)`` is how many of ``hashes``, in order, are
  stored (a lookup stops at the first missing one, as a prefix must be unbroken).
- ``KVStore`` (the worker's side): ``save(block_ids, hashes)`` writes the blocks not stored yet (to a temporary name,
  then renamed: a reader never sees half a file); ``load(block_ids, hashes)`` copies stored blocks into the given
  blocks of every layer's cache and returns how many it could: a block whose file is gone, damaged or of another
  layout stops it (a warning names the file), and the runner computes that block and the rest in the same step.
- With ``max_bytes`` (``kv_connector_extra_config.max_storage_bytes``) a saving store keeps the folder under that
  size: past it, the least recently used blocks (saved or loaded longest ago) go until 90 % of it is left.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagellm.kv.hash_algos import VllmBlockHasher
from pagellm.kv.hashing import extend_block_hashes

logger = logging.getLogger(__name__)

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

    def __init__(self, folder: Path, kv_caches: list[Any], max_bytes: int | None = None,
                 hasher: VllmBlockHasher | None = None) -> None:
        self.folder = folder
        self.kv_caches = kv_caches
        self.max_bytes = max_bytes
        self.hasher = hasher  # the prefix cache's, when it hashes as vLLM does (--prefix-caching-hash-algo)
        self.used = self._scan_bytes() if max_bytes else 0

    def _scan_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.glob("*" + SUFFIX))

    def prune(self) -> int:
        """Remove the least recently used blocks (oldest modification time: saving or loading a block renews it)
        until the folder holds at most 90 % of ``max_bytes``; returns how many it removed."""
        files = []
        for path in self.folder.glob("*" + SUFFIX):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another engine pruned it meanwhile
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        self.used = sum(size for _, size, _ in files)
        removed = 0
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if self.used <= 0.9 * self.max_bytes:  # type: ignore[operator]
                break
            path.unlink(missing_ok=True)
            self.used -= size
            removed += 1
        return removed

    def hash_tokens(self, token_ids: list[int], block_size: int) -> list[bytes]:
        """The names of the full blocks of ``token_ids``: their hashes as the prefix cache computes them for a
        request without a salt or an adapter (both servers must hash alike)."""
        if self.hasher is not None:
            return self.hasher.token_hashes(token_ids, block_size)  # type: ignore[return-value]
        hashes: list = []
        extend_block_hashes(hashes, token_ids, block_size)
        return hashes

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
                _renew(path)
                continue
            rows = torch.stack([cache[:, block_id] for cache in self.kv_caches])
            handle, partial = tempfile.mkstemp(dir=self.folder, suffix=".partial")
            os.close(handle)
            save_file({"kv": rows.contiguous()}, partial)
            os.replace(partial, path)
            written += 1
            self.used += path.stat().st_size
        if self.max_bytes and self.used > self.max_bytes:
            self.prune()
        return written

    def load(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> int:
        """Copy the stored blocks in, in order; returns how many it loaded before one that cannot be (removed or
        damaged since the scheduler found it, or of another layout: logged), which the caller computes instead."""
        from safetensors import safe_open

        for index, (block_id, block_hash) in enumerate(zip(block_ids, hashes)):
            path = self._path(block_hash)
            try:
                with safe_open(str(path), framework="pt") as stored:
                    rows = stored.get_tensor("kv")
            except (OSError, RuntimeError, ValueError) as exc:
                logger.warning("stored KV block %s cannot be read (%s): computing it instead", path, exc)
                return index
            expected = (len(self.kv_caches), *self.kv_caches[0][:, block_id].shape)
            if tuple(rows.shape) != expected or rows.dtype != self.kv_caches[0].dtype:
                logger.warning("stored KV block %s holds %s %s, this engine's blocks are %s %s: computing it "
                               "instead", path, tuple(rows.shape), rows.dtype, expected, self.kv_caches[0].dtype)
                return index
            for layer, cache in enumerate(self.kv_caches):
                cache[:, block_id].copy_(rows[layer])
            _renew(path)
        return len(block_ids)


def _renew(path: Path) -> None:
    """Mark a block as just used (pruning removes the least recently used first)."""
    try:
        os.utime(path)
    except OSError:  # pruned meanwhile: nothing to renew
        pass
