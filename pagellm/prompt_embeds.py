"""Prompts given as input embeddings instead of tokens (vLLM's ``--enable-prompt-embeds``).

A client that computes its own input embeddings (soft prompts, embeddings edited or mixed in by an application)
sends them as a ``[num_tokens, hidden_size]`` float tensor: ``LLM.generate({"prompt_embeds": tensor})`` offline,
or the completions API's ``prompt_embeds`` field, a base64 ``torch.save`` of the tensor as vLLM takes it. The
model runs them in place of its embedding lookup, position for position; what it generates is ordinary tokens.

``PromptEmbeds`` is the plain form that crosses processes: the rows' raw bytes, their dtype and width. The
frontend reads a client's tensor (``from_tensor``, ``load``: this module imports torch only there, so a frontend
without embeddings prompts never loads it), the engine carries the bytes to the workers, and each worker makes a
tensor of its model's dtype of them (``to_tensor``). A request's placeholder token ids (zeros, one per row) keep
the scheduler and the KV cache unchanged. Its full prompt blocks are hashed by their rows (``kv/hashing.
embeds_block_hashes``: prompts that start with the same rows, a soft prompt say, share them; a block of rows never
passes for one of other rows or of tokens), the blocks after them under a cache salt that carries ``digest``.
"""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # what the rows travel as (other float tensors become float32)


class PromptEmbeds(msgspec.Struct, array_like=True, frozen=True):
    dtype: str         # one of DTYPES
    hidden_size: int   # the width of one row
    data: bytes        # the rows, row-major

    @property
    def num_tokens(self) -> int:
        return len(self.data) // (self.hidden_size * _itemsize(self.dtype))

    def digest(self) -> str:
        """A hash of the rows and their layout (equal only for equal prompts)."""
        head = f"{self.dtype}:{self.hidden_size}:".encode()
        return hashlib.sha256(head + self.data).hexdigest()

    def last(self, count: int) -> PromptEmbeds:
        """The last ``count`` rows (a prompt cut to its tail, as ``truncate_prompt_tokens`` does)."""
        if count >= self.num_tokens:
            return self
        width = self.hidden_size * _itemsize(self.dtype)
        return PromptEmbeds(self.dtype, self.hidden_size, self.data[len(self.data) - count * width:])


    def first(self, count: int) -> PromptEmbeds:
        """The first ``count`` rows (``truncate_prompt_tokens`` with ``truncation_side`` "right")."""
        if count >= self.num_tokens:
            return self
        return PromptEmbeds(self.dtype, self.hidden_size, self.data[:count * self.hidden_size * _itemsize(self.dtype)])


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def preload() -> None:
    """Import torch now (an API server that takes embeddings prompts), not inside its first such request."""
    import torch  # noqa: F401


def from_tensor(tensor: Any) -> PromptEmbeds:
    """A client's tensor as ``PromptEmbeds``: ``[num_tokens, hidden_size]`` (or ``[1, num_tokens, hidden_size]``),
    floating point and finite; ValueError says what to fix."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        raise ValueError(f"prompt_embeds must be a dense tensor with its data, got a {tensor.layout} tensor on "
                         f"{tensor.device.type}")
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[0] == 0 or tensor.shape[1] == 0:
        raise ValueError(f"prompt_embeds must be a [num_tokens, hidden_size] tensor with at least one row, got "
                         f"shape {list(tensor.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"prompt_embeds must be floating point, got {tensor.dtype}")
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        tensor, name = tensor.float(), "float32"
    tensor = tensor.detach().cpu().contiguous()
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError("prompt_embeds holds NaN or infinite values")
    data = tensor.view(torch.uint8).numpy().tobytes()
    return PromptEmbeds(name, int(tensor.shape[1]), data)


def load(data: bytes) -> PromptEmbeds:
    """``PromptEmbeds`` from a ``torch.save``d tensor (the completions API's ``prompt_embeds``, base64-decoded).
    Loaded with ``weights_only``: a file that holds anything but tensors is refused, never run."""
    import torch

    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a damaged or foreign file
        raise ValueError(f"prompt_embeds is not a torch.save()d tensor ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'unreadable'})") from None
    return from_tensor(tensor)


def save(tensor: Any) -> bytes:
    """``tensor`` as ``torch.save`` writes it: what a client base64-encodes into ``prompt_embeds``."""
    import torch

    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def to_tensor(embeds: PromptEmbeds, dtype: torch.dtype) -> torch.Tensor:
    """The rows as a ``[num_tokens, hidden_size]`` tensor of ``dtype`` (the worker's model dtype)."""
    import torch

    rows = torch.frombuffer(bytearray(embeds.data), dtype=getattr(torch, embeds.dtype))
    return rows.view(-1, embeds.hidden_size).to(dtype)
