"""The bfloat16 decoder stack in one native call (``csrc/decoder_stack.cpp``): embedding rows in, the first
``num_layers`` Llama decoder layers (each writing its K/V rows into its paged cache and attending with the paged
attention kernel), final RMSNorm, hidden states out.

The library calls the packed GEMM (``gemm.py``), the fused element-wise ops (``fused.py``) and the paged attention
kernel (``attention/cpu_paged.py``) through the addresses of their C entry points in their own libraries (so the
stack builds in a fraction of a second and always runs the kernels' current code), in exactly the sequence of the
Python layers, so its output equals the Python path's bit for bit; the Python layers are its plain-PyTorch twin
and test oracle. ``DecoderStack`` holds
the weights' addresses (made once per model) and takes per call the step's tokens, positions, caches and the
``CpuPagedMetadata`` fields. ``available()`` says whether the library runs here (the packed GEMM's: AVX-512 BF16
or AVX2 + FMA, and a compiler).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pagellm.attention import cpu_paged
from pagellm.ops import fused, gemm, moe
from pagellm.ops.build import entry_address as _address
from pagellm.ops.build import load_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decoder_stack.cpp"
ATTENTION = cpu_paged.SOURCE  # the attention kernel's library (its float8 entries': cpu_paged.FP8_SOURCE)
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Kernels(ctypes.Structure):  # csrc StackKernels: the kernels' entry points
    _fields_ = [(name, _P) for name in ("linear", "add_rms_norm", "silu_and_mul", "rotary", "attention",
                                        "linear_silu_mul", "moe", "all_reduce", "gelu_and_mul", "add_layer_norm")]


_Reduce = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)  # csrc StackKernels::all_reduce


def _reduce_callback(all_reduce: Callable[[torch.Tensor], object], errors: list[BaseException]) -> _Reduce:
    """The stack's all-reduce on tensor-parallel ranks: the caller's collective over a bfloat16 view of the stack's
    rows. An exception (a dead rank) cannot cross the C call: it is kept in ``errors`` for ``DecoderStack`` to raise
    once the native call returns, and the step's later reductions are skipped."""
    def call(ptr: int, n: int) -> None:
        if errors:
            return
        try:
            all_reduce(torch.frombuffer((ctypes.c_uint16 * n).from_address(ptr), dtype=torch.bfloat16))
        except BaseException as exc:  # noqa: BLE001 (raised again by the caller)
            errors.append(exc)
    return _Reduce(call)


_GEMMS = ("qkv", "o", "gate_up", "down")  # a layer's GEMM weights


class _Layer(ctypes.Structure):  # csrc StackLayer
    _fields_ = [(name, _P) for name in ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down",
                                        "k_cache", "v_cache", "q_norm", "k_norm", "moe")]
    _fields_ += [("windowed", _I), ("rotated", _I)]
    _fields_ += [(f"{name}_order", _P) for name in _GEMMS]
    _fields_ += [(name, _P) for name in ("post_ffn_norm", "pre_ffn_norm", "cos", "sin", "sinks", "o_bias")]


class _Shape(ctypes.Structure):  # csrc StackShape
    _fields_ = [(name, _I) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size",
                                        "cache_slots", "max_positions", "rot_dim")]
    _fields_ += [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("kv_format", _I),
                 ("residual_scale", ctypes.c_float), ("post_norms", _I), ("qk_all_heads", _I), ("sandwich", _I),
                 ("gelu", _I), ("softcap", ctypes.c_float), ("layer_norm", _I), ("parallel", _I)]


# csrc KvFormat of each cache dtype the stack serves.
_KV_FORMATS = {torch.bfloat16: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
CACHE_DTYPES = frozenset(_KV_FORMATS)


class _Step(ctypes.Structure):  # csrc StackStep
    _fields_ = [(name, _I) for name in ("tokens", "rows", "max_blocks", "tree_words", "flash_min_tokens")]
    _fields_ += [(name, _P) for name in ("positions", "slots", "block_table", "query_start", "seq_lens", "ctx_end",
                                         "tree_bits", "ctx_start")]


@functools.lru_cache(maxsize=None)
def _kernels(cache_dtype: torch.dtype, weight_format: str = "bf16") -> _Kernels:
    """The kernels the stack calls over caches of ``cache_dtype`` and GEMM weights of ``weight_format``
    (``gemm.weight_format``; their libraries loaded, built if need be; the paged attention entry is
    ``cpu_paged.load_kernel()``'s for bfloat16 queries over that cache)."""
    gemm_lib, fused_lib = gemm._lib(), fused._lib()
    assert gemm_lib is not None and fused_lib is not None
    if weight_format in gemm.QUANTIZED:
        linear, linear_silu_mul = gemm.QUANTIZED[weight_format].entry_addresses()
    else:
        linear = _address(gemm_lib.pagellm_packed_linear_bf16)
        linear_silu_mul = _address(gemm_lib.pagellm_packed_linear_silu_mul_bf16)
    return _Kernels(linear, _address(fused_lib.pagellm_add_rms_norm_bf16),
                    _address(fused_lib.pagellm_silu_and_mul_bf16), _address(fused_lib.pagellm_rotary_bf16),
                    _address(cpu_paged.load_kernel().entry(torch.bfloat16, cache_dtype)), linear_silu_mul,
                    moe.forward_entry() if moe.available() else None, None,  # all_reduce: set per stack
                    _address(fused_lib.pagellm_gelu_tanh_and_mul_bf16),
                    _address(fused_lib.pagellm_add_layer_norm_bf16))


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    """The stack's library, or ``None`` where it or the kernels it calls (over bfloat16 caches) do not run here."""
    if gemm._lib() is None or fused._lib() is None:
        return None
    try:
        lib = load_library(SOURCE)
        _kernels(torch.bfloat16)
    except (RuntimeError, OSError) as exc:
        logger.warning("native decoder stack unavailable (%s); using the Python layers", exc)
        return None
    lib.pagellm_decoder_stack_bf16.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Layer), _I,
                                               ctypes.POINTER(_Shape), ctypes.POINTER(_Step), _P, _P, _P, _P, _P, _P,
                                               _P]
    lib.pagellm_decoder_stack_bf16.restype = ctypes.c_int
    lib.pagellm_stack_fp8_from_bf16.argtypes = [_P, _I, _I, _P]
    lib.pagellm_stack_fp8_from_bf16.restype = None
    return lib


def available() -> bool:
    return _lib() is not None


def fp8_from_bf16(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bfloat16 values rounded into float8 ``dtype`` as the stack writes them into a float8 cache (for tests)."""
    loaded = _lib()
    assert loaded is not None, "native decoder stack is not available on this machine"
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    loaded.pagellm_stack_fp8_from_bf16(x.data_ptr(), x.numel(), _KV_FORMATS[dtype], out.data_ptr())
    return out


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's bfloat16 weights; the four GEMM weights packed (``gemm.pack``), or all four quantized
    (``gemm_w8a8`` or ``gemm_w4a8``'s ``quantize_parameter``; a 4-bit act-order one with its ``gemm.input_order``,
    which the stack gathers each input row in); a sparse layer of a mixture of experts has its routed experts
    (``moe``, a ``moe.Experts`` that routes, in a format of its own: it calls its own kernels) in place of gate_up
    and down."""

    input_norm: torch.Tensor | None  # None: OLMo's layer (StackShape.post_norms)
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor | None  # None: Cohere's layer (StackShape.parallel)
    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # [head_dim] RMSNorm weights over each head's q and k (Qwen3), both or none
    k_norm: torch.Tensor | None = None
    moe: moe.Experts | None = None
    sliding_window: int | None = None  # the layer attends to the keys of its last this many positions only
    rotated: bool = True  # False: a NoPE layer (SmolLM3's), its q and k not rotated
    post_ffn_norm: torch.Tensor | None = None  # OLMo's and Gemma's norm on the MLP's output (post_norm: on
    pre_ffn_norm: torch.Tensor | None = None   # attention's); Gemma's before the MLP (StackShape.sandwich)
    cos: torch.Tensor | None = None  # the layer's own rotary tables (Gemma 3's sliding layers' base), as the stack's
    sin: torch.Tensor | None = None  # [max_positions, rot_dim]; None: the stack's
    sinks: torch.Tensor | None = None  # gpt-oss's attention sinks: float32 [heads], one logit per head
    o_bias: torch.Tensor | None = None  # o_proj's bias (gpt-oss's), added after the ranks' sum


@dataclass(frozen=True)
class StackShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float
    residual_scale: float = 1.0  # each sublayer's output times this before it joins the residual (Granite's)
    # OLMo's layer (and EXAONE 4's): no norm before attention or the MLP, each one's output normed before it joins the
    # residual stream, their input; its q and k norms over all of a token's heads (qk_all_heads: OLMo's)
    post_norms: bool = False
    qk_all_heads: bool = False
    # Gemma 2 and 3's layer: Llama's norms before attention and the MLP (pre_ffn_norm), and OLMo's on each one's
    # output (post_norm, post_ffn_norm)
    sandwich: bool = False
    gelu: bool = False  # the MLP's gate is GeGLU (Gemma's, gelu's tanh form), not SiLU
    softcap: float = 0.0  # attention scores capped at softcap * tanh(score / softcap) (Gemma 2's); 0: not capped
    layer_norm: bool = False  # the hidden states' norms are Cohere's LayerNorm, not RMSNorm
    parallel: bool = False  # Cohere's layer: one norm, attention and the MLP side by side on its output


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _index(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def _checked_tensors(layers: list[LayerWeights], final_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     weight_format: str, heads: int) -> list:
    """Every tensor the stack points at (to keep alive), once the layers are checked to fit the native call."""
    if any((w.q_norm is None) != (w.k_norm is None) for w in layers):
        raise ValueError("the native decoder stack takes q and k norm weights together, or neither")
    vectors = [final_norm, cos, sin, *(t for w in layers for t in (w.input_norm, w.qkv_bias, w.post_norm,
                                                                    w.q_norm, w.k_norm, w.post_ffn_norm,
                                                                    w.pre_ffn_norm, w.cos, w.sin, w.o_bias)
                                       if t is not None)]
    sinks = [w.sinks for w in layers if w.sinks is not None]
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.shape != (heads,) for t in sinks):
        raise ValueError(f"attention sinks are contiguous float32 [{heads}], one per query head")
    if any((w.cos is None) != (w.sin is None) or (w.cos is not None and (w.cos.shape != cos.shape or
                                                                        w.sin.shape != sin.shape)) for w in layers):
        raise ValueError(f"a layer's own rotary tables come together, each of the stack's shape {tuple(cos.shape)}")
    gemms = [t for w in layers for t in (w.qkv, w.o, w.gate_up, w.down) if t is not None]
    gemm_dtype = torch.int8 if weight_format in gemm.QUANTIZED else torch.bfloat16
    if any(t.dtype != torch.bfloat16 for t in vectors) or any(t.dtype != gemm_dtype for t in gemms) or \
            not all(t.is_contiguous() for t in (*vectors, *gemms)):
        raise ValueError(f"the native decoder stack takes contiguous bfloat16 weights ({weight_format} GEMM "
                         "weights)")
    orders = [(t, order) for t in gemms if (order := gemm.input_order(t)) is not None]
    if any(order.dtype != torch.int64 or not order.is_contiguous() or order.shape != (gemm.packed_shape(t)[1],)
           or int(order.min()) < 0 or int(order.max()) >= order.numel() for t, order in orders):
        raise ValueError("an act-order GEMM weight's input order must be contiguous int64 [K] in [0, K)")
    if any((w.moe is None) == (w.gate_up is None or w.down is None) or (w.moe is not None and not w.moe.routes)
           for w in layers):
        raise ValueError("each layer of the native decoder stack takes gate_up and down, or routed experts (moe)")
    return [*vectors, *sinks, *gemms, *(order for _, order in orders), *(w.moe for w in layers if w.moe is not None)]


def _check_norms(layers: list[LayerWeights], shape: StackShape) -> None:
    """Each layer's norms as its kind has them: Llama's before each sublayer (input_norm, post_norm), OLMo's after
    each (post_norms: post_norm, post_ffn_norm), Gemma's before and after each (sandwich: all four) or Cohere's one
    (parallel: input_norm)."""
    if shape.post_norms + shape.sandwich + shape.parallel > 1:
        raise ValueError("a native decoder stack's layers have OLMo's norms (post_norms), Gemma's (sandwich) or "
                         "Cohere's (parallel)")
    want = (not shape.post_norms, not shape.parallel, shape.post_norms or shape.sandwich, shape.sandwich)
    if any((w.input_norm is not None, w.post_norm is not None, w.post_ffn_norm is not None,
            w.pre_ffn_norm is not None) != want for w in layers):
        raise ValueError("the native decoder stack takes an input norm per layer and a norm before the MLP (with "
                         "sandwich one after it too; with parallel none but the input norm), or with post_norms a "
                         "norm on each sublayer's output instead")


class DecoderStack:
    """A model's decoder stack bound to the native call (weights' addresses made once; the tensors kept alive).
    On tensor-parallel ranks (``all_reduce``: the ranks' in-place sum) the layers' row-parallel outputs are summed
    through it, as the Python layers sum them."""

    def __init__(self, layers: list[LayerWeights], shape: StackShape, final_norm: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, weight_format: str = "bf16",
                 all_reduce: Callable[[torch.Tensor], object] | None = None) -> None:
        loaded = _lib()
        assert loaded is not None, "native decoder stack is not available on this machine"
        self._keep = _checked_tensors(layers, final_norm, cos, sin, weight_format, shape.heads)
        _check_norms(layers, shape)
        windows = {w.sliding_window for w in layers} - {None}
        if len(windows) > 1:
            raise ValueError(f"the native decoder stack takes one sliding window, not {sorted(windows)}")
        self.sliding_window = windows.pop() if windows else None  # the windowed layers' (StackStep.ctx_start)
        self.weight_format = weight_format
        self._errors: list[BaseException] = []  # from the all-reduce callback, raised after the call
        self._reduce = None if all_reduce is None else _reduce_callback(all_reduce, self._errors)
        self._fn, self._kernels = loaded.pagellm_decoder_stack_bf16, self._kernel_table(torch.bfloat16)
        self._bound: tuple[torch.Tensor, ...] = ()  # the caches the layers point at now (see _bind_caches)
        self.shape = shape
        self._final_norm, self._cos, self._sin = final_norm.data_ptr(), cos.data_ptr(), sin.data_ptr()
        self._layers = (_Layer * len(layers))()
        for slot, w in zip(self._layers, layers):
            for name in ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down", "q_norm", "k_norm",
                         "post_ffn_norm", "pre_ffn_norm", "cos", "sin", "sinks", "o_bias"):
                setattr(slot, name, _ptr(getattr(w, name)))
            slot.moe = None if w.moe is None else w.moe.address
            slot.windowed, slot.rotated = int(w.sliding_window is not None), int(w.rotated)
            for name in _GEMMS:
                weight = getattr(w, name)
                setattr(slot, f"{name}_order", None if weight is None else _ptr(gemm.input_order(weight)))
        self._shape = _Shape(shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate, 1, 0,
                             cos.shape[0], cos.shape[1], shape.eps, shape.scale, 0, shape.residual_scale,
                             int(shape.post_norms), int(shape.qk_all_heads), int(shape.sandwich), int(shape.gelu),
                             shape.softcap, int(shape.layer_norm), int(shape.parallel))

    def _kernel_table(self, cache_dtype: torch.dtype) -> object:
        """The kernels' entry points for ``cache_dtype`` caches, with this stack's all-reduce (kept alive here)."""
        self._table = _Kernels.from_buffer_copy(_kernels(cache_dtype, self.weight_format))
        self._table.all_reduce = None if self._reduce is None else ctypes.cast(self._reduce, ctypes.c_void_p).value
        return ctypes.byref(self._table)

    def _bind_caches(self, caches: list[torch.Tensor]) -> None:
        """Point the layers at their [2, num_blocks, block_size, kv_heads, head_dim] caches (checked; one shape and
        one dtype: bfloat16 or a float8 one, ``CACHE_DTYPES``).
        The same tensors as the last call's are bound already (the common case: only the self-speculative draft
        binds others, around its passes)."""
        if len(caches) == len(self._bound) and all(c is b for c, b in zip(caches, self._bound)):
            return
        self._bound = ()  # until every layer is bound (a refused cache leaves the layers half pointed)
        s = self.shape
        for slot, cache in zip(self._layers, caches):
            if (cache.dtype not in CACHE_DTYPES or cache.dim() != 5 or not cache.is_contiguous()
                    or tuple(cache.shape[3:]) != (s.kv_heads, s.head_dim) or cache.shape != caches[0].shape
                    or cache.dtype != caches[0].dtype):
                raise ValueError("the native decoder stack needs contiguous bfloat16 or float8 [2, blocks, "
                                 f"block_size, {s.kv_heads}, {s.head_dim}] caches, all of one dtype")
            slot.k_cache = cache.data_ptr()
            slot.v_cache = cache[1].data_ptr()
        dtype = caches[0].dtype if caches else torch.bfloat16
        self._shape.kv_format = _KV_FORMATS[dtype]
        self._kernels = self._kernel_table(dtype)
        self._shape.block_size = caches[0].shape[2] if caches else 1
        self._shape.cache_slots = caches[0].shape[1] * caches[0].shape[2] if caches else 0
        self._bound = tuple(caches)

    def run(self, x: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor], md: object,
            flash_min_tokens: int) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of embedding rows ``x`` after ``len(caches)`` layers; ``md`` is the
        step's ``CpuPagedMetadata`` (slot_mapping, query_start_loc, seq_lens, block_table, ctx_end, tree_bits)."""
        return self._call(x, None, positions, caches, md, flash_min_tokens, True)[0]

    def run_stage(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                  caches: list[torch.Tensor], md: object, flash_min_tokens: int,
                  last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pipeline stage: its layers over the previous stage's hidden rows ``x`` and ``residual`` (or, on the
        first stage, embedding rows and None); the last stage returns (final-norm hidden states, None), the others
        (x, residual) for the next stage."""
        if residual is not None and (residual.dtype != torch.bfloat16 or residual.shape != x.shape):
            raise ValueError(f"the residual must match the hidden rows: bfloat16 {tuple(x.shape)}")
        if not last and not caches:
            raise ValueError("a stage before the last runs at least one layer")
        return self._call(x, residual, positions, caches, md, flash_min_tokens, last)

    def _call(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
              caches: list[torch.Tensor], md: object, flash_min_tokens: int,
              final_norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if len(caches) > len(self._layers):
            raise ValueError(f"asked for {len(caches)} layers of a {len(self._layers)}-layer stack")
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.shape.hidden:
            raise ValueError(f"the native decoder stack takes bfloat16 [T, {self.shape.hidden}] rows")
        x = x.contiguous()
        residual = None if residual is None else residual.contiguous()
        self._bind_caches(caches)
        positions, slots = _index(positions), _index(md.slot_mapping)  # type: ignore[attr-defined]
        if not positions.shape[0] == slots.shape[0] == x.shape[0]:
            raise ValueError("the native decoder stack needs one position and one cache slot per token")
        bits = md.tree_bits  # type: ignore[attr-defined]
        table = md.block_table  # type: ignore[attr-defined]
        step = _Step(x.shape[0], md.seq_lens.shape[0], table.shape[1],  # type: ignore[attr-defined]
                     0 if bits is None else bits.shape[1], flash_min_tokens, positions.data_ptr(),
                     slots.data_ptr(), table.data_ptr(), md.query_start_loc.data_ptr(),  # type: ignore[attr-defined]
                     md.seq_lens.data_ptr(), md.ctx_end.data_ptr(), _ptr(bits),  # type: ignore[attr-defined]
                     _ptr(md.ctx_start(self.sliding_window)))  # type: ignore[attr-defined]
        out = torch.empty_like(x)
        residual_out = None if final_norm else torch.empty_like(x)
        if self._fn(self._kernels, self._layers, len(caches), ctypes.byref(self._shape), ctypes.byref(step),
                    x.data_ptr(), _ptr(residual), self._cos, self._sin, self._final_norm if final_norm else None,
                    out.data_ptr(), _ptr(residual_out)):
            raise IndexError(f"cache slots must lie in [0, {self._shape.cache_slots}) and positions in "
                             f"[0, {self._shape.max_positions})")
        if self._errors:  # an all-reduce failed (a rank died): this step's rows are lost
            error = self._errors.pop()
            self._errors.clear()
            raise error
        return out, residual_out
