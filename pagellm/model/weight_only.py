"""Weight-only integer checkpoints (W4A16, W8A16): GPTQ, AWQ and compressed-tensors ``pack-quantized``, read into
the float weights they stand for, or into the 4-bit kernel's groups.

Each format stores a quantized linear layer of ``N`` outputs and ``K`` inputs as unsigned ``bits``-bit integers
``q``, packed eight (4 bits) or four (8 bits) to an int32, with a scale ``s`` and a zero point ``z`` per group of
``group_size`` inputs (``-1``: the whole row), so that ``W = (q - z) · s``:

- **GPTQ** (``quant_method: gptq``): ``qweight`` int32 [K / p, N] packed along K (input ``p·r + i`` of row ``r`` in
  bits ``bits·i``), ``qzeros`` int32 [G, N / p] packed along N, ``scales`` [G, N], ``g_idx`` [K] (each input's
  group; with ``desc_act`` not in order). ``checkpoint_format: gptq`` (the default) stores ``z - 1``, ``gptq_v2``
  stores ``z``.
- **AWQ** (``quant_method: awq``, ``version: gemm``): ``qweight`` int32 [K, N / 8] packed along N in AutoAWQ's
  order (nibble ``j`` of word ``c`` holds output ``8c + AWQ_ORDER[j]``), ``qzeros`` [G, N / 8] likewise, ``scales``
  [G, N]. Without ``zero_point``, z is 8.
- **compressed-tensors** (``format: pack-quantized``): ``weight_packed`` int32 [N, K / p] packed along K of the
  signed values ``q - 2^(bits-1)``, ``weight_scale`` [N, G], ``weight_shape`` (N, K), and for an asymmetric scheme
  ``weight_zero_point`` int32 [N / p, G] packed along N, signed likewise; symmetric: z is ``2^(bits-1)``.

``weights(...)`` turns a checkpoint's stream into Hugging Face's float names: each quantized layer becomes
``<layer>.weight``, ``(q - z) · s`` computed in the scales' dtype as the formats' own libraries compute it
(compressed-tensors' ``dequantize``, AutoAWQ's and GPTQModel's torch paths), so transformers on the decompressed
checkpoint and pagellm compute with the same weights. With ``groups=True`` (a 4-bit kernel: ``w4a16_int4``, the
checkpoint's own scheme, which the worker picks in bfloat16 where it runs, or ``--quantization w4a8_int4``) a layer
becomes ``<layer>.weight`` holding ``q`` itself and ``<layer>.weight_groups`` [N, K / 32, 2], each 32 inputs'
``(d, m) = (s, -z · s)``: the 4-bit kernels' Q4_1 form of the same weights, which keeps ``q`` and ``s`` as they are
(``m`` rounds to float16 where ``z · s`` needs more bits; symmetric schemes' ``-8 · s`` does not). An act-order GPTQ
layer (``desc_act``: each group takes inputs from all over the row) comes with its inputs sorted by group first:
``<layer>.input_order`` [K] (input ``j`` of the kernel's weight is the layer's input ``order[j]``, the groups' inputs
in their stored order), then ``q`` and its groups over the sorted inputs; the kernels take each row's inputs in that
order (``gemm.input_order``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from pagellm.ops.gemm_w4a8 import GROUP

SCHEME = "wna16"


class GroupsDoNotFit(ValueError):
    """A layer's 4-bit groups do not map onto the 4-bit kernels' (not 4 bits, or not whole runs of 32 inputs)."""
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Each format's tensors of one layer: (the packed weight, what else it needs, what it may have).
_PARTS = {"gptq": ("qweight", ("qzeros", "scales"), ("g_idx",)),
          "awq": ("qweight", ("qzeros", "scales"), ()),
          "compressed-tensors": ("weight_packed", ("weight_scale", "weight_shape"), ("weight_zero_point",))}


@dataclass(frozen=True)
class WeightOnly:
    """A weight-only checkpoint's scheme, from its ``quantization_config``."""

    method: str  # "gptq", "awq" or "compressed-tensors"
    bits: int
    group_size: int  # -1: one group per row
    symmetric: bool  # compressed-tensors and AWQ: no stored zero points (z = 2^(bits-1))
    zeros_minus_one: bool  # GPTQ's original checkpoint format

    @property
    def parts(self) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        packed, needed, optional = _PARTS[self.method]
        if self.method == "awq" and self.symmetric:
            needed = ("scales",)
        if self.method == "compressed-tensors" and not self.symmetric:
            needed = needed + optional
        return packed, needed, optional


def scheme(quant: dict[str, Any]) -> WeightOnly | None:
    """The weight-only scheme of a ``quantization_config``; ``None`` where it is not one (another compressed-tensors
    format); raises ``ValueError`` naming what pagellm does not read."""
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        if quant.get("format") != "pack-quantized":
            return None
        return _compressed_tensors(quant)
    if method not in ("gptq", "awq"):
        return None
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    if bits not in (4, 8) or (method == "awq" and bits != 4):
        raise ValueError(f"this {method} checkpoint has {bits}-bit weights; pagellm reads GPTQ with 4 or 8 bits and "
                         "AWQ with 4")
    if method == "awq" and str(quant.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"this AWQ checkpoint's version is {quant.get('version')!r}; pagellm reads version gemm "
                         "(AutoAWQ's default)")
    if method == "gptq" and quant.get("lm_head"):
        raise ValueError("this GPTQ checkpoint quantizes its LM head too; pagellm reads GPTQ decoder layers with a "
                         "float LM head")
    fmt = str(quant.get("checkpoint_format", "gptq"))
    if method == "gptq" and fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"this GPTQ checkpoint's format is {fmt!r}; pagellm reads gptq and gptq_v2")
    return WeightOnly(method, bits, group, symmetric=method == "awq" and not quant.get("zero_point", True),
                      zeros_minus_one=method == "gptq" and fmt == "gptq")


def _compressed_tensors(quant: dict[str, Any]) -> WeightOnly:
    groups = list((quant.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if len(groups) != 1 or groups[0].get("input_activations") or weights[0].get("type", "int") != "int" or \
            weights[0].get("num_bits") not in (4, 8) or weights[0].get("strategy") not in ("group", "channel") or \
            weights[0].get("actorder"):
        raise ValueError("this compressed-tensors pack-quantized checkpoint's scheme is not served: pagellm reads "
                         "one group of int weights with 4 or 8 bits, strategy group or channel, no activation "
                         f"quantization and no actorder; found {groups}")
    w = weights[0]
    group = int(w.get("group_size") or -1) if w["strategy"] == "group" else -1
    return WeightOnly("compressed-tensors", int(w["num_bits"]), group, symmetric=bool(w.get("symmetric", True)),
                      zeros_minus_one=False)


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned ``bits``-bit values of an int32 tensor packed along ``dim`` (value ``i`` of a word in bits
    ``bits·i``), as uint8, that dimension ``32 / bits`` times longer. Read through the words' bytes (little-endian:
    a byte's low nibble is the earlier value), a few passes over bytes instead of shifts over int32 words."""
    if sys.byteorder != "little":
        raise RuntimeError("reading packed int32 weights needs a little-endian CPU")
    rows, words = packed.shape
    b = packed.contiguous().view(torch.uint8).view(rows, words * 4)
    values = torch.stack((b & 15, b >> 4), dim=2).view(rows, words * 8) if bits == 4 else b
    if dim == 0:  # word (r, c) holds rows per·r .. per·r + per - 1 of column c
        per = 32 // bits
        values = values.view(rows, words, per).transpose(1, 2).reshape(rows * per, words)
    return values


def _layer(ws: WeightOnly, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor | None]:
    """``(q, z, s, g)`` of one layer: q uint8 [N, K] (GPTQ's a transposed view of its [K, N]) and, per group, z
    [N, G] (small integers) and s [N, G] in the scales' dtype; g int64 [K], each input's group, or ``None`` where the
    groups are runs of ``K / G`` inputs."""
    mid = 1 << (ws.bits - 1)
    g = None
    if ws.method == "compressed-tensors":
        n, k = (int(v) for v in t["weight_shape"].tolist())
        q = _unpack(t["weight_packed"], ws.bits, 1)[:, :k]
        s = t["weight_scale"].reshape(n, -1)
        z = _unpack(t["weight_zero_point"], ws.bits, 0)[:n] if not ws.symmetric else torch.full_like(s, mid,
                                                                                                   dtype=torch.uint8)
    elif ws.method == "gptq":
        q = _unpack(t["qweight"], ws.bits, 0).t()
        s = t["scales"].t()
        z = _unpack(t["qzeros"], ws.bits, 1).t().to(torch.int16) + int(ws.zeros_minus_one)  # as GPTQ adds it back
        if "g_idx" in t:
            g = t["g_idx"].to(torch.int64)
    else:  # AWQ: packed along N in its own order
        order = torch.tensor(AWQ_ORDER).argsort()
        q = _awq_columns(_unpack(t["qweight"], 4, 1), order).t()
        s = t["scales"].t()
        z = _awq_columns(_unpack(t["qzeros"], 4, 1), order).t() if not ws.symmetric else \
            torch.full_like(s, mid, dtype=torch.uint8)
    n, k = q.shape
    size = ws.group_size if ws.group_size > 0 else k
    runs = k % size == 0 and s.shape[1] == k // size
    if g is None and not runs:
        g = torch.arange(k) // size  # a last group shorter than the others (K not a multiple of the group size)
    elif g is not None and runs and torch.equal(g, torch.arange(k) // size):
        g = None  # runs in order (a GPTQ checkpoint without act-order still stores g_idx)
    if s.shape[0] != n or z.shape != s.shape or \
            (g is not None and (g.shape != (k,) or int(g.max()) >= s.shape[1])):
        raise ValueError(f"a {ws.method} layer's tensors do not fit together: weight [{n}, {k}], scales "
                         f"{tuple(s.shape)}, zero points {tuple(z.shape)}"
                         + (f", {g.numel()} group indices" if g is not None else ""))
    return q, z, s, g


def _awq_columns(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's packed columns back in order: word ``c``'s value ``j`` is column ``8c + AWQ_ORDER[j]``."""
    rows, cols = values.shape
    return values.view(rows, cols // 8, 8)[:, :, order].reshape(rows, cols)


def _per_input(t: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """A per-group [N, G] tensor over the inputs: gathered by ``g``, or [N, G, 1] beside [N, G, K / G] runs."""
    return t[:, g] if g is not None else t[:, :, None]


def dequantize(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """``(q - z) · s`` [N, K] per input's group, in the scales' dtype (as the formats' libraries compute it: the
    integers' difference is exact there)."""
    n, k = q.shape
    values = q if g is not None else q.view(n, s.shape[1], -1)
    w = (values.to(s.dtype) - _per_input(z, g).to(s.dtype)) * _per_input(s, g)
    return w.view(n, k)


def groups_of(ws: WeightOnly, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
              g: torch.Tensor | None) -> torch.Tensor:
    """[N, K / 32, 2] float32: each 32 inputs' ``(d, m) = (s, -z · s)`` in float16's values, for the 4-bit kernel;
    raises where the scheme does not map onto it."""
    n, k = q.shape
    if ws.bits != 4 or k % GROUP:
        raise GroupsDoNotFit(f"the 4-bit kernels keep a checkpoint's 4-bit weights in groups of {GROUP} inputs; "
                             f"this {ws.method} checkpoint has {ws.bits}-bit weights and a layer of {k} inputs. Serve "
                             "it without --quantization (its weights are then dequantized)")
    g = torch.arange(k) // (k // s.shape[1]) if g is None else g
    first = g[::GROUP]
    if not torch.equal(g.view(-1, GROUP), first[:, None].expand(-1, GROUP)):
        raise GroupsDoNotFit(f"the 4-bit kernels need each {GROUP} consecutive inputs of a layer (sorted by group) in "
                             f"one group; this {ws.method} checkpoint has groups that are not whole runs of {GROUP} "
                             "inputs. Serve it without --quantization (its weights are then dequantized)")
    d = s[:, first].to(torch.float16)
    m = (-(z[:, first].float() * s[:, first].float())).to(torch.float16)
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise ValueError(f"a {ws.method} layer's scales overflow float16; serve it without --quantization")
    return torch.stack([d, m], dim=2).float()


def weights(stream: Iterable[tuple[str, torch.Tensor]], names: set[str], ws: WeightOnly,
            groups: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint ``stream`` (whose tensors are ``names``) with each quantized layer's tensors turned into
    ``<layer>.weight`` (dequantized), or with ``groups`` into ``q`` and ``<layer>.weight_groups`` (the LM head is
    always dequantized); a layer is emitted once all its tensors have come."""
    packed, needed, optional = ws.parts
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        layer, _, part = name.rpartition(".")
        if part != packed and part not in needed and part not in optional:
            yield name, tensor
            continue
        got = pending.setdefault(layer, {})
        got[part] = tensor
        if all(p in got for p in (packed, *needed)) and \
                all(p in got for p in optional if f"{layer}.{p}" in names):
            yield from _emit(layer, pending.pop(layer), ws, groups)
    for layer, got in pending.items():
        raise ValueError(f"the {ws.method} checkpoint's layer {layer!r} lacks "
                         f"{', '.join(p for p in (packed, *needed) if p not in got)}")


def _emit(layer: str, got: dict[str, torch.Tensor], ws: WeightOnly, groups: bool) -> Iterator[tuple[str, torch.Tensor]]:
    q, z, s, g = _layer(ws, got)
    if not groups or layer.split(".")[-1] == "lm_head":
        yield f"{layer}.weight", dequantize(q.contiguous(), z, s, g)
        return
    order = None if g is None else torch.sort(g, stable=True).indices
    if order is not None and not torch.equal(order, torch.arange(g.numel())):
        yield f"{layer}.input_order", order  # first: the layer's loaders know its order before its weight is packed
        q, g = q.t().contiguous()[order].t(), g[order]  # whole rows of [K, N] gathered (GPTQ's own layout)
    q = q.contiguous()
    yield f"{layer}.weight", q
    yield f"{layer}.weight_groups", groups_of(ws, q, z, s, g)


def four_bit_fits(hf_config: dict[str, Any]) -> bool:
    """Whether a weight-only checkpoint's weights map onto the 4-bit kernels' groups, as far as its config says: 4
    bits, groups a multiple of 32 inputs (or whole rows), in order or not (act-order)."""
    quant = hf_config.get("quantization_config")
    ws = scheme(quant) if quant else None
    return ws is not None and ws.bits == 4 and not (ws.group_size > 0 and ws.group_size % GROUP)


def four_bit_hint(hf_config: dict[str, Any]) -> str | None:
    """A line suggesting ``--quantization w4a8_int4`` for a 4-bit weight-only checkpoint whose groups map onto the
    4-bit kernel's (served dequantized without it, on a CPU without AVX-512 BF16), or ``None``."""
    if not four_bit_fits(hf_config):
        return None
    ws = scheme(hf_config["quantization_config"])
    assert ws is not None
    return (f"this {ws.method} checkpoint's 4-bit weights were dequantized; --quantization w4a8_int4 keeps them in 4 "
            "bits (its integers and scales as they are; about a third of bfloat16's memory, with int8 activations)")
