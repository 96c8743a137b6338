"""When and how ``LlamaModel.forward`` runs its decoder layers as one native call (``pagellm/ops/decoder_stack.py``).

The native path serves a forward pass when all of these hold, and returns ``None`` otherwise (the Python layers
then run, unchanged: they are its twin and oracle, and the path of float32 and every other attention backend):

- ``PAGELLM_NATIVE_DECODER`` is not ``0`` and the library builds and runs here (AVX-512 BF16);
- the model is bfloat16 (a pipeline stage runs its own layers in one call, taking the previous stage's hidden rows
  and residual, ``run_native_stage``; a tensor-parallel rank its slice of every layer, the row-parallel outputs
  and the experts' partial sums summed through the ranks' all-reduce; with expert parallelism a rank's experts do
  not route, so the Python layers run), and every GEMM weight of every layer is packed
  (``gemm.pack_parameter``), or every one quantized (``--quantization w8a8_int8``, ``w4a8_int4`` or
  ``w4a16_int4``; an act-order checkpoint's 4-bit weights with their rows' inputs gathered in order), with no
  bias on a dense MLP (q/k/v and o_proj biases, as in Qwen2 and gpt-oss, Qwen3's per-head q/k norm, Phi-4-mini's
  partial rotary embedding, SmolLM3's layers without a rotary embedding and Granite's residual multiplier and
  attention scale are served), one RMSNorm epsilon throughout, Llama's norms before each sublayer, OLMo's and
  EXAONE 4's after each (OLMo's q/k norms over all heads on one rank only) or Gemma 2 and 3's before and after
  each or Cohere's one LayerNorm before attention and the MLP side by side, SwiGLU or GeGLU's tanh form (Gemma's),
  Gemma 2's soft-capped attention scores, gpt-oss's attention sinks, the model's rotary embedding for every layer
  that rotates or, where a layer has its own (Gemma 3's sliding layers), its tables of the same shape; a mixture of
  experts' sparse layers run their native call (``ops/moe.py``, the one the Python layer makes: Mixtral, Qwen2-MoE
  with its shared expert, Qwen3-MoE, gpt-oss's biased experts, in their own format: its MXFP4 ones beside bfloat16
  attention);
- the step's positions are one per token (a Qwen2-VL step whose tokens carry M-RoPE's three, [3, T], takes the
  Python layers; its steps of text alone, whose three agree, come here);
- no request of the step runs with a LoRA adapter (those steps take the Python layers, ``pagellm/lora.py``);
- the forward context is the ``cpu_paged`` backend's (its metadata a ``CpuPagedMetadata``) and every layer to run
  has a cache bound, bfloat16 or float8 (``--kv-cache-dtype``), all of one dtype.

The weights' addresses are gathered once per model (``stack_for``) and reused; the caches are read per call, as
the self-speculative draft (``spec/draft.py``) rebinds them to its own around its passes.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm import envs
from pagellm.attention.base import current_forward_context
from pagellm.attention.cpu_paged import FLASH_MIN_TOKENS, CpuPagedMetadata
from pagellm.model.layers.activation import GeluAndMul
from pagellm.model.layers.norm import LayerNorm
from pagellm.ops import decoder_stack, gemm
from pagellm.ops.decoder_stack import DecoderStack, LayerWeights, StackShape


def _layer_weights(layer: nn.Module, rotary: nn.Module) -> LayerWeights | None:
    """The weights of one decoder layer (``rotary``: the model's own rotary embedding, whose tables the stack
    takes; a layer with another, Gemma 3's sliding ones, brings its tables), or None where it does not fit."""
    if not layer.native:  # a layer the native call does not compute
        return None
    attn, mlp = layer.self_attn, layer.mlp
    experts = None
    if not hasattr(mlp, "gate_up_proj"):  # a mixture of experts: its native call, routing included
        experts = mlp.native_experts()
        if experts is None or not experts.routes:
            return None
    linears = (attn.qkv_proj, attn.o_proj) + ((mlp.gate_up_proj, mlp.down_proj) if experts is None else ())
    if any(gemm.packed_shape(m.weight) is None for m in linears):
        return None
    if any(m.bias is not None for m in linears[2:]):  # a dense MLP's biases
        return None
    norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
    gate_up, down = (None, None) if experts is not None else (mlp.gate_up_proj.weight, mlp.down_proj.weight)
    own = attn.rotary if attn.rotary is not None and attn.rotary is not rotary else None
    return LayerWeights(_weight(layer, "input_layernorm"), attn.qkv_proj.weight, attn.qkv_proj.bias,
                        attn.o_proj.weight, _weight(layer, "post_attention_layernorm"), gate_up, down, *norms,
                        moe=experts, sliding_window=attn.attn.sliding_window, rotated=attn.rotary is not None,
                        post_ffn_norm=_weight(layer, "post_feedforward_layernorm"),  # OLMo's and Gemma's
                        pre_ffn_norm=_weight(layer, "pre_feedforward_layernorm"),  # Gemma's
                        cos=None if own is None else own.cos, sin=None if own is None else own.sin,
                        sinks=None if attn.sinks is None else attn.sinks.data, o_bias=attn.o_proj.bias)


def _weight(layer: nn.Module, norm: str) -> torch.Tensor | None:
    module = getattr(layer, norm, None)
    return None if module is None else module.weight


def _shape(model: nn.Module, weights: list[LayerWeights]) -> StackShape | None:
    """The stack's shape, or None where its layers differ in what it holds once for all (the norms' epsilon, the
    residual scale, the kind of norms)."""
    first = model.layers[0]
    attn = first.self_attn.attn
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    eps = {n.eps for layer in model.layers
           for n in (*(getattr(layer, name, None) for name in norms), layer.self_attn.q_norm, layer.self_attn.k_norm)
           if n is not None} | {model.norm.eps}
    dense = [w.down.packed_shape[1] for w in weights if w.down is not None]  # type: ignore
    residual_scales = {layer.residual_multiplier or 1.0 for layer in model.layers}
    post = {w.input_norm is None for w in weights}  # OLMo's layers (one kind throughout)
    sandwich = {w.pre_ffn_norm is not None for w in weights}  # Gemma's
    parallel = {w.post_norm is None for w in weights}  # Cohere's
    # the dense layers' gate: SiLU or GeGLU (its tanh form: the layers' ``native`` leaves the exact one out)
    gelu = {isinstance(layer.mlp.act_fn, GeluAndMul) for layer in model.layers if hasattr(layer.mlp, "act_fn")}
    if any(len(kinds) > 1 for kinds in (eps, residual_scales, post, sandwich, gelu, parallel)):
        return None
    return StackShape(model.norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
                      max(dense, default=0), eps.pop(), attn.scale, residual_scales.pop(), post.pop(),
                      first.self_attn.qk_norm_all_heads, sandwich.pop(), bool(gelu and gelu.pop()),
                      attn.softcap or 0.0, isinstance(model.norm, LayerNorm), parallel.pop())


def build_stack(model: nn.Module) -> DecoderStack | None:
    """The native stack of a ``LlamaModel``, or ``None`` where its weights do not fit the native call."""
    if not decoder_stack.available() or model.norm.weight.dtype != torch.bfloat16 or not model.layers:
        return None
    rotary = model.rotary
    parallel = model.layers[0].self_attn.qkv_proj.parallel
    weights = [_layer_weights(layer, rotary) for layer in model.layers]
    if any(w is None for w in weights):
        return None
    # the dense GEMMs' one format (a mixture's experts call their own kernels: gpt-oss's MXFP4 experts beside its
    # bfloat16 attention)
    formats = {gemm.weight_format(t) for w in weights for t in (w.qkv, w.o, w.gate_up, w.down)  # type: ignore
               if t is not None}
    if len(formats) != 1:
        return None
    shape = _shape(model, weights)
    if shape is None or rotary.cos.dtype != torch.bfloat16 or rotary.cos.shape[1] % 2 or \
            any(w.cos is not None and w.cos.shape != rotary.cos.shape for w in weights):  # type: ignore[union-attr]
        return None
    return DecoderStack(weights, shape, model.norm.weight, rotary.cos, rotary.sin,  # type: ignore[arg-type]
                        formats.pop(), parallel.all_reduce if parallel.tp_size > 1 else None)


_UNBUILT = object()


def stack_for(model: nn.Module) -> DecoderStack | None:
    """The model's native stack, built on first use and kept on the model."""
    stack = model.__dict__.get("_native_stack", _UNBUILT)
    if stack is _UNBUILT:
        stack = build_stack(model)
        model.__dict__["_native_stack"] = stack
        # The layers' attention modules, for reading their caches each call without slicing the ModuleList
        # (which builds a new one) and three module look-ups per layer.
        model.__dict__["_native_attns"] = tuple(layer.self_attn.attn for layer in model.layers)
    return stack  # type: ignore[return-value]


def _native_call(model: nn.Module, x: torch.Tensor,
                 num_layers: int | None) -> tuple[DecoderStack, list[torch.Tensor], CpuPagedMetadata] | None:
    """The stack, the caches of the layers to run and the step's metadata, where the native stack serves this call
    (see the module docstring); else None."""
    if x.dtype != torch.bfloat16 or not envs.native_decoder():
        return None
    try:
        ctx = current_forward_context()
    except RuntimeError:
        return None  # the Python layers raise the error that names the fix
    if not isinstance(ctx.metadata, CpuPagedMetadata) or ctx.lora is not None:  # adapters: the Python layers
        return None
    stack = stack_for(model)
    if stack is None:
        return None
    caches = [attn.kv_cache for attn in model.__dict__["_native_attns"][:num_layers]]
    if any(c is None or c.dtype not in decoder_stack.CACHE_DTYPES or c.dtype != caches[0].dtype for c in caches):
        return None
    return stack, caches, ctx.metadata


def run_native(model: nn.Module, x: torch.Tensor, positions: torch.Tensor,
               num_layers: int | None) -> torch.Tensor | None:
    """Final-norm hidden states of embedding rows ``x`` through the native stack, or ``None`` where it does not
    serve this call (see the module docstring)."""
    call = _native_call(model, x, num_layers) if positions.dim() == 1 else None
    if call is None:
        return None
    stack, caches, md = call
    return stack.run(x, positions, caches, md, FLASH_MIN_TOKENS)


def run_native_stage(model: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                     last: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A pipeline stage's layers in one native call: (final-norm hidden states, None) on the last stage, else the
    (hidden rows, residual) for the next; ``None`` where the native stack does not serve this call."""
    call = _native_call(model, x, None) if positions.dim() == 1 else None
    if call is None:
        return None
    stack, caches, md = call
    return stack.run_stage(x, residual, positions, caches, md, FLASH_MIN_TOKENS, last)
