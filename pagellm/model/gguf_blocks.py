"""A GGUF's quantized blocks kept as they are: 4-bit ones for the 4-bit kernels (``--quantization w4a16_int4`` or
``w4a8_int4``), and every kept block type decoded at load for the others.

Three of llama.cpp's block types are affine per 32 inputs, ``w = d · q + m`` with ``q`` in [0, 15], which is the
4-bit kernels' own form (``ops/gemm_w4a8.py``):

- **Q4_0**: blocks of 32 in 18 bytes: ``d`` (float16), then 16 bytes whose low nibbles are the block's first 16
  values and high nibbles its last 16; ``w = d · (q - 8)``, so ``m = -8 · d``.
- **Q4_1**: blocks of 32 in 20 bytes: ``d`` and ``m`` (float16), then the nibbles as Q4_0's.
- **Q4_K**: super-blocks of 256 in 144 bytes: ``d`` and ``dmin`` (float16), twelve bytes holding eight 6-bit scales
  ``sc`` and eight 6-bit minima ``mn`` (one per 32; ``_k_scales``), then 128 bytes: each 32 bytes hold one 64
  inputs' nibbles, the low ones the first 32 and the high ones the next 32; ``w = d · sc · q - dmin · mn``, so a
  group's ``(d, m) = (d · sc, -dmin · mn)``.

Every other block type of llama.cpp's common files is kept as well, and always comes as values: Q8_0, the 5-bit
Q5_0, Q5_1 and Q5_K, Q6_K (a Q4_K_M file's v and down projections in half its layers, and its embeddings), Q2_K and
Q3_K, and the non-linear IQ4_NL and IQ4_XS (their layouts are in ``ops/csrc/gguf_blocks.h``); so are float16 and
bfloat16 matrices (``FLOATS``), in their own two bytes. Only the 1-to-3-bit IQ and ternary types are still written
in float32. The embeddings and the LM head in any of these types are kept too, and always come as values.

The conversion (``gguf_convert``) writes each such decoder matrix's blocks, row by row as the file holds them (q/k
rows unpermuted as the float weights are, a stacked expert tensor split per expert), into ``BLOCKS_FILE`` with each
tensor's block type in the file's metadata, and writes no float32 copy of them: a 7B Q4_K_M file converts to its 4 GB
of blocks and its norms, not 28 GB of float32. ``loader.iter_weights`` reads them from here (``weights``): with
``groups`` (the 4-bit kernels) a Q4 matrix comes as ``<layer>.weight`` holding ``q`` and ``<layer>.weight_groups``
[N, K / 32, 2] holding each group's ``(d, m)`` in float32, computed as gguf's own ``dequantize`` computes them; any
other (every other type, or every matrix without ``groups``) comes as its values in the model's dtype, in one native
pass (``values``; in float32, gguf's dequantized value bit for bit), or, a float16 or bfloat16 one, as stored for the
loaders to convert as they copy; a quantized layer then quantizes them at load as it does a float layer's. The
kernels keep ``d`` and ``m`` in float16: exact for Q4_0 and Q4_1 (the file's own float16 numbers), and for Q4_K
within float16's rounding of ``d · sc`` and ``dmin · mn`` (a relative 2^-11, eight times closer than bfloat16 weights
are to the file). Readers other than pagellm (transformers, vLLM, peft) need every weight as a
float tensor: ``loader.hf_model_dir`` writes the matrices' float32 copies once (``float_weights``) for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pagellm.ops import fused

BLOCKS_FILE = "gguf_blocks.safetensors"
# The 4-bit block types: block type → (inputs per block, bytes per block, where its nibbles start, bytes per run of
# nibbles).
LAYOUTS = fused.Q4_LAYOUTS
KINDS = fused.GGUF_BLOCKS  # every block type kept → (inputs, bytes) per block
FLOATS = {"F16": torch.float16, "BF16": torch.bfloat16}  # kept in their own two bytes a value
# The decoder matrices the 4-bit kernels run (the router and the embeddings are not among them).
_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                          "gate_up_proj", "w1", "w2", "w3"})


# Kept as blocks too, and always loaded as values: the 4-bit kernels do not run them.
_VALUES_ONLY = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def kept(hf_name: str, kind: str) -> bool:
    """Whether the conversion keeps this tensor's blocks: a decoder layer's matrix, the embeddings or the LM head in
    one of ``KINDS``."""
    return kind in KINDS and (_projection(hf_name) or hf_name in _VALUES_ONLY)


def _projection(hf_name: str) -> bool:
    """A decoder layer's matrix that the 4-bit kernels run."""
    parts = hf_name.split(".")
    return parts[-1] == "weight" and parts[-2] in _PROJECTIONS and ".layers." in hf_name


def decode(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, groups)`` of one matrix's blocks ``raw`` (uint8 [N, bytes per row]): ``q`` uint8 [N, K] in [0, 15] and
    ``groups`` float32 [N, K / 32, 2] each 32 inputs' ``(d, m)``, so that ``d · q + m`` is gguf's dequantized value."""
    blocks = _blocks(raw, kind)
    _, size, nibbles_at, run = LAYOUTS[kind]
    nibbles = blocks[..., nibbles_at:].reshape(*blocks.shape[:2], -1, run)  # the block's runs
    return _nibbles(nibbles).reshape(raw.shape[0], -1), _groups(blocks, kind)


def values(raw: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The [N, K] values of one matrix's blocks (uint8 [N, bytes per row]): gguf's ``dequantize`` bit for bit in
    float32, or those rounded to bfloat16 (``dtype``). Quantized blocks take one native pass
    (``fused.dequantize_gguf``, into ``out`` where given) or, where that library does not build or is not built yet,
    its twin: ``_values`` for the Q4 types, ``_q8_0_values``, a view for float16 and bfloat16, and gguf's own numpy
    ``dequantize`` for the others (new tensors)."""
    decoded = fused.dequantize_gguf(raw, kind, dtype, out)
    if decoded is not None:
        return decoded
    if kind in FLOATS:
        return as_stored(raw, kind).to(dtype)
    if kind in LAYOUTS:
        return _values(*decode(raw, kind)).to(dtype)
    if kind == "Q8_0":
        return _q8_0_values(raw).to(dtype)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(_blocks(raw, kind).numpy(), GGMLQuantizationType[kind])).reshape(
        raw.shape[0], -1).to(dtype)


def as_stored(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """A float16 or bfloat16 matrix's [N, K] values, a view of its bytes (uint8 [N, 2 K])."""
    return _blocks(raw, kind).view(FLOATS[kind]).reshape(raw.shape[0], -1)


def _values(q: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``d · q + m`` in float32 from ``decode``'s integers and groups: ``fused.dequantize_gguf``'s twin."""
    rows = q.shape[0]
    return (q.float().view(rows, -1, 32) * groups[..., :1] + groups[..., 1:]).view(rows, -1)


def _q8_0_values(raw: torch.Tensor) -> torch.Tensor:
    """Q8_0's ``d · q`` in float32 (blocks of 32 in 34 bytes: ``d`` float16, then 32 signed bytes ``q``)."""
    blocks = _blocks(raw, "Q8_0")
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (_half(blocks[..., 0:2])[..., None] * q).reshape(raw.shape[0], -1)


def _blocks(raw: torch.Tensor, kind: str) -> torch.Tensor:
    _, size = KINDS[kind]
    n, row_bytes = raw.shape
    if row_bytes % size:
        raise ValueError(f"a {kind} row of {row_bytes} bytes is not whole {size}-byte blocks")
    return raw.contiguous().view(n, row_bytes // size, size)


def _groups(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """Each 32 inputs' ``(d, m)``, float32 [N, K / 32, 2], computed as gguf's ``dequantize`` computes them."""
    n = blocks.shape[0]
    d = _half(blocks[..., 0:2])
    if kind == "Q4_K":  # w = d · sc · q - dmin · mn
        sc, mn = _k_scales(blocks[..., 4:16])
        scale, minimum = d[..., None] * sc.float(), -(_half(blocks[..., 2:4])[..., None] * mn.float())
        return torch.stack([scale, minimum], dim=3).reshape(n, -1, 2)
    m = _half(blocks[..., 2:4]) if kind == "Q4_1" else -8.0 * d
    return torch.stack([d, m], dim=2)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and minima of Q4_K's twelve bytes: the first four of each in the low 6 bits of bytes
    0-3 and 4-7; the last four in bytes 8-11's nibbles (scales low, minima high), their top 2 bits in the top bits of
    bytes 0-3 (scales) and 4-7 (minima)."""
    lo, hi, rest = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (rest & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([hi & 63, (rest >> 4) | ((hi >> 6) << 4)], dim=-1)
    return sc, mn


def _half(two_bytes: torch.Tensor) -> torch.Tensor:
    """The float16 in each pair of bytes (little-endian), as float32 [..]."""
    return two_bytes.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """Each run of bytes (the last dimension) as twice as many values: the low nibbles, then the high ones."""
    return torch.cat([b & 15, b >> 4], dim=-1)


def weights(blocks: Path, files: list[Path], groups: bool, dtype: torch.dtype | None = None,
            transient: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a converted GGUF: the ``BLOCKS_FILE``'s matrices and the float ``files``' other tensors, one
    layer after another (a quantized load packs each layer as soon as it is whole, ``linear.loaded_whole``).

    With ``groups`` a matrix comes as ``<layer>.weight`` (``q``) and ``<layer>.weight_groups``; without, as its
    values ``d · q + m`` in ``dtype`` (``values``; float32 by default, gguf's own ``dequantize`` bit for bit). A
    float16 or bfloat16 matrix comes as stored where a ``dtype`` is asked, a view of the file that the model's
    loaders convert as they copy it into place (``linear._copy``), not through a converted copy of its own. A float
    copy of the matrix in ``files`` (``loader.hf_model_dir``'s, for other readers) is not read. With ``transient``
    the values are decoded into one buffer the stream reuses (each valid until the next tensor is drawn, for loaders
    that copy each into place): a 1B model's load then faults in no new pages for its 2 GB of decoded values."""
    from safetensors import safe_open

    scratch: dict[torch.dtype, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(path), framework="pt")) for path in [blocks, *files]]
        kinds = handles[0].metadata() or {}
        source = {name: handle for handle in reversed(handles) for name in handle.keys()}
        for name in sorted(source, key=_layer_order):
            tensor = source[name].get_tensor(name)
            if source[name] is not handles[0]:
                yield name, tensor
                continue
            if groups and kinds[name] in LAYOUTS and _projection(name):
                q, scales = decode(tensor, kinds[name])
                yield name, q
                yield f"{name.removesuffix('.weight')}.weight_groups", scales
            elif dtype is not None and kinds[name] in FLOATS:  # as stored: the loaders convert as they copy
                yield name, as_stored(tensor, kinds[name])
            else:
                into = dtype or torch.float32
                yield name, values(tensor, kinds[name], into,
                                   _scratch(scratch, tensor, kinds[name], into) if transient else None)


def _scratch(buffers: dict[torch.dtype, torch.Tensor], raw: torch.Tensor, kind: str,
             dtype: torch.dtype) -> torch.Tensor:
    """A [N, K] view of the stream's grow-only ``dtype`` buffer for the values of blocks ``raw``."""
    per, size = KINDS[kind]
    rows, cols = raw.shape[0], raw.shape[1] // size * per
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < rows * cols:
        buffer = buffers[dtype] = torch.empty(rows * cols, dtype=dtype)
    return buffer[:rows * cols].view(rows, cols)


def _layer_order(name: str) -> tuple[int, str]:
    """The embeddings, then each decoder layer in turn, then the final norm and the LM head."""
    parts = name.split(".")
    if "layers" in parts[:-1] and parts[parts.index("layers") + 1].isdigit():
        return int(parts[parts.index("layers") + 1]), name
    return (-1 if "embed" in name else 1 << 30), name


def float_weights(blocks: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``BLOCKS_FILE``'s matrices in float32, for readers that need every weight as a float tensor."""
    return weights(blocks, [], groups=False)


def save(arrays: dict[str, tuple[np.ndarray, str]], path: Path) -> None:
    """Write ``{hf_name: (blocks uint8 [N, bytes per row], kind)}`` as a ``BLOCKS_FILE``."""
    from safetensors.numpy import save_file

    save_file({name: np.ascontiguousarray(raw) for name, (raw, _) in arrays.items()}, str(path),
              metadata={name: kind for name, (_, kind) in arrays.items()})
