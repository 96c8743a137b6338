"""The native bfloat16 decoder stack (``model/native_stack.py``) against its twin, the Python layers, on the same
packed model: identical hidden states and identical cache contents for mixed steps (decodes, prompt chunks after a
cached prefix, fresh prompts, speculative chains and draft trees), for every layer count; the Python path where
the native one must not run; and identical greedy tokens through the engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.attention.base import CommonAttentionInputs, forward_context, new_kv_cache, quantize_kv
from pagellm.attention.cpu_paged import CpuPagedBackend
from pagellm.attention.torch_ref import TorchRefBackend
from pagellm.model import native_stack
from pagellm.model.arch import ArchConfig
from pagellm.model.layers.linear import pack_weights
from pagellm.model.llama import LlamaForCausalLM
from pagellm.ops import decoder_stack, gemm, gemm_w4a16, gemm_w8a8
from pagellm.ops.decoder_stack import DecoderStack
from pagellm.spec.tree import row_mask, static_tree

BS, NUM_BLOCKS = 8, 48


def _model(head_dim: int, bias: bool, dtype: torch.dtype = torch.bfloat16, layers: int = 3,
           quantization: str | None = None, intermediate: int = 160, window: int | None = None,
           full_attention_layers: tuple[int, ...] = (), rotary_dim: int | None = None) -> LlamaForCausalLM:
    heads, kv_heads = 4, 2
    cfg = ArchConfig("LlamaForCausalLM", 300, heads * head_dim, intermediate, layers, heads, kv_heads, head_dim,
                     rotary_dim or head_dim, 1e-5, 10000.0, None, 256, False, bias, window,
                     full_attention_layers=full_attention_layers)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param, dtype=torch.float32) * (0.5 if "bias" in name else 0.1) +
                        (1.0 if "norm" in name else 0.0))
    pack_weights(model, quantization)
    return model


def _bind(model: LlamaForCausalLM, caches: list[torch.Tensor]) -> None:
    for attn, cache in zip(model.attention_layers(), caches):
        attn.kv_cache = cache


def _caches(model: LlamaForCausalLM, seed: int, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Caches holding random context (what earlier steps wrote) for every layer; of the model's dtype or ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or model.model.norm.weight.dtype
    out = []
    for attn in model.attention_layers():
        cache = new_kv_cache(NUM_BLOCKS, BS, attn.num_kv_heads, attn.head_dim, dtype)
        cache.view(torch.uint8).copy_(quantize_kv(torch.randn(cache.shape, generator=gen), dtype).view(torch.uint8))
        out.append(cache)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (float8 tensors have no torch.equal)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _mixed_step(vocab: int) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionInputs]:
    """Rows: a decode, a prompt chunk after a 20-token prefix, a fresh prompt, a 1+root+3 chain, a draft tree."""
    starts, counts = [37, 20, 0, 11, 25], [1, 13, 9, 5, 10]
    trees = {3: row_mask(5, [-1, 0, 1]), 4: row_mask(10, static_tree([3, 2]))}
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    width = max(-(-(s + c) // BS) for s, c in zip(starts, counts))
    table = np.array([[order.pop() for _ in range(width)] for _ in starts], dtype=np.int64)
    positions = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts)])
    rows = np.repeat(np.arange(len(starts)), counts)
    slots = table[rows, positions // BS] * BS + positions % BS
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    common = CommonAttentionInputs(qsl, np.array(starts) + np.array(counts), table, torch.from_numpy(slots), BS,
                                   trees)
    ids = torch.randint(0, vocab, (int(qsl[-1]),), generator=gen)
    return ids, torch.from_numpy(positions), common


def _forward(model: LlamaForCausalLM, caches: list[torch.Tensor], backend, common: CommonAttentionInputs,
             ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None) -> torch.Tensor:
    _bind(model, caches)
    with torch.inference_mode(), forward_context(backend, backend.build(common)):
        return model(ids, positions, num_layers)


def _count_native(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = DecoderStack.run

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecoderStack, "run", counted)
    return calls


def _native_then_python(model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch, common: CommonAttentionInputs,
                        ids: torch.Tensor, positions: torch.Tensor, kv_dtype: torch.dtype | None = None) -> tuple:
    """One step through the native stack (which must run, once), then through the Python layers, each over its own
    copy of the same caches: (native, python, native caches, python caches). Leaves the stack switched off."""
    calls = _count_native(monkeypatch)
    native_caches = _caches(model, seed=3, dtype=kv_dtype)
    native = _forward(model, native_caches, CpuPagedBackend(), common, ids, positions, None)
    assert len(calls) == 1
    monkeypatch.setenv("PAGELLM_NATIVE_DECODER", "0")
    python_caches = _caches(model, seed=3, dtype=kv_dtype)
    python = _forward(model, python_caches, CpuPagedBackend(), common, ids, positions, None)
    assert len(calls) == 1  # the switch keeps the Python layers
    return native, python, native_caches, python_caches


def _stack_equals_python_and_differs_from(model: LlamaForCausalLM, other: LlamaForCausalLM,
                                          monkeypatch: pytest.MonkeyPatch, common: CommonAttentionInputs,
                                          ids: torch.Tensor, positions: torch.Tensor) -> None:
    """The native stack's step equals the Python layers' (hidden states and caches, bit for bit), and differs from
    the stack's step over ``other``, the same weights without the feature under test."""
    native, python, native_caches, python_caches = _native_then_python(model, monkeypatch, common, ids, positions)
    assert torch.equal(native, python)
    assert all(torch.equal(a, b) for a, b in zip(native_caches, python_caches))
    monkeypatch.setenv("PAGELLM_NATIVE_DECODER", "1")
    assert not torch.equal(native, _forward(other, _caches(model, seed=3), CpuPagedBackend(), common, ids,
                                            positions, None))


def test_the_native_stack_runs_on_this_machine() -> None:
    assert decoder_stack.available()  # CI machines have AVX-512 BF16 or AVX2 + FMA: the tests below must exercise it


@pytest.mark.parametrize("head_dim,bias", [(64, False), (64, True), (16, True)], ids=["hd64", "hd64-bias", "hd16"])
@pytest.mark.parametrize("num_layers", [None, 2, 0], ids=["all", "first-2", "none"])
def test_native_stack_equals_the_python_layers(monkeypatch: pytest.MonkeyPatch, head_dim: int, bias: bool,
                                               num_layers: int | None, isa: str) -> None:
    """On AMX and AVX-512 BF16 the stack's MLP is the one-pass gate/up GEMM with SiLU·mul; the Python layers make the
    two calls."""
    model = _model(head_dim, bias)
    ids, positions, common = _mixed_step(model.cfg.vocab_size)
    backend = CpuPagedBackend()
    calls = _count_native(monkeypatch)
    native_caches = _caches(model, seed=3)
    native = _forward(model, native_caches, backend, common, ids, positions, num_layers)
    assert len(calls) == 1
    monkeypatch.setenv("PAGELLM_NATIVE_DECODER", "0")
    python_caches = _caches(model, seed=3)
    python = _forward(model, python_caches, backend, common, ids, positions, num_layers)
    assert len(calls) == 1  # the switch keeps the Python layers
    assert native.dtype == torch.bfloat16 and native.shape == (len(ids), model.cfg.hidden_size)
    assert torch.equal(native, python)
    for a, b in zip(native_caches, python_caches):
        assert torch.equal(a, b)
    untouched = _caches(model, seed=3)
    layers = model.cfg.num_layers if num_layers is None else num_layers
    for i, (written, before) in enumerate(zip(native_caches, untouched)):
        assert torch.equal(written, before) == (i >= layers)  # exactly the layers run wrote their K/V


@pytest.mark.parametrize("window", [3, 9])
def test_native_stack_with_a_sliding_window_equals_the_python_layers(monkeypatch: pytest.MonkeyPatch,
                                                                     window: int) -> None:
    """Windowed layers (here layers 0 and 2; layer 1 attends to every key, as a Qwen layer below max_window_layers)
    attend inside the window in the stack as in the Python layers: the same bits; and the window matters."""
    model = _model(64, False, window=window, full_attention_layers=(1,))
    assert [a.sliding_window for a in model.attention_layers()] == [window, None, window]
    ids, positions, common = _mixed_step(model.cfg.vocab_size)
    common = dataclasses.replace(common, positions=positions.numpy())
    _stack_equals_python_and_differs_from(model, _model(64, False), monkeypatch, common, ids, positions)


@pytest.mark.parametrize("rotary_dim", [48, 16])
def test_native_stack_with_a_partial_rotary_embedding_equals_the_python_layers(monkeypatch: pytest.MonkeyPatch,
                                                                               rotary_dim: int) -> None:
    """Phi-4-mini's partial rotary embedding (here 48 or 16 of 64 dimensions turned, the rest passed through): the
    stack equals the Python layers bit for bit; and the embedding's width matters."""
    model = _model(64, False, rotary_dim=rotary_dim)
    assert model.model.layers[0].self_attn.rotary.cos.shape[1] == rotary_dim
    ids, positions, common = _mixed_step(model.cfg.vocab_size)
    _stack_equals_python_and_differs_from(model, _model(64, False), monkeypatch, common, ids, positions)


@pytest.mark.skipif(not gemm_w8a8.available(), reason="the int8 GEMM needs AVX-512 VNNI")
@pytest.mark.parametrize("quantization", ["w8a8_int8", "w4a8_int4", "w4a16_int4"])
@pytest.mark.parametrize("bias,intermediate", [(False, 160), (True, 160), (False, 168)],
                         ids=["no-bias", "qkv-bias", "gate-not-whole-panels"])
def test_native_stack_over_quantized_weights_equals_the_python_layers(monkeypatch: pytest.MonkeyPatch, bias: bool,
                                                                      intermediate: int, quantization: str) -> None:
    """``--quantization w8a8_int8`` or ``w4a8_int4``: the stack calls the quantized GEMM where the layers do, the
    gate/up one with SiLU·mul in one pass (an intermediate size of whole panels of 16) or in two calls (168, and for
    4 bits down_proj's inputs not whole groups of 32), as the layers make them; ``w4a16_int4`` likewise."""
    if quantization == "w4a16_int4" and not gemm_w4a16.available():
        pytest.skip("the W4A16 kernel needs AVX-512 BF16 and VNNI")
    model = _model(64, bias, quantization=quantization, intermediate=intermediate)
    assert gemm.weight_format(model.model.layers[0].mlp.down_proj.weight) == quantization
    assert gemm.weight_format(model.lm_head.weight) == "bf16"  # the LM head stays bfloat16
    ids, positions, common = _mixed_step(model.cfg.vocab_size)
    # and the quantized weights were used: the bfloat16 model's hidden states differ
    _stack_equals_python_and_differs_from(model, _model(64, bias, intermediate=intermediate), monkeypatch, common,
                                          ids, positions)


@pytest.mark.skipif(not gemm_w8a8.available(), reason="the 4-bit GEMM needs AVX-512 VNNI")
@pytest.mark.parametrize("quantization", ["w4a8_int4", "w4a16_int4"])
@pytest.mark.parametrize("intermediate", [160, 168], ids=["gate-up-one-pass", "gate-up-two-calls"])
def test_native_stack_over_act_order_weights_equals_the_python_layers(monkeypatch: pytest.MonkeyPatch,
                                                                      intermediate: int, quantization: str) -> None:
    """4-bit weights whose inputs come in an order of their own (an act-order GPTQ checkpoint's, ``input_order``):
    the stack reorders each GEMM's input rows as the Python layers' ``index_select`` does, and so uses the orders:
    the same weights taken in order give other hidden states."""
    if quantization == "w4a16_int4" and not gemm_w4a16.available():
        pytest.skip("the W4A16 kernel needs AVX-512 BF16 and VNNI")
    model = _model(64, True, quantization=quantization, intermediate=intermediate)
    gen = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear.weight.input_order = torch.randperm(gemm.packed_shape(linear.weight)[1], generator=gen)
    ids, positions, common = _mixed_step(model.cfg.vocab_size)
    _stack_equals_python_and_differs_from(model, _model(64, True, quantization=quantization,
                                                        intermediate=intermediate), monkeypatch, common, ids,
                                          positions)
    down = model.model.layers[0].mlp.down_proj.weight
    down.input_order = torch.arange(1, intermediate + 1)  # an input past the row's end: refused, never read
    with pytest.raises(ValueError, match=r"input order must be contiguous int64 \[K\] in \[0, K\)"):
        native_stack.build_stack(model.model)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_native_stack_with_float8_caches_equals_the_python_layers(monkeypatch: pytest.MonkeyPatch,
                                                                  kv_dtype: torch.dtype) -> None:
    """``--kv-cache-dtype fp8*``: the stack rounds each K/V row into the cache as the Python layers' write does
    (torch's float8 conversion) and attends through the float8 entry of the same kernel: the same bits."""
    model = _model(64, False)
    ids, positions, common = _mixed_step(model.cfg.vocab_size)
    native, python, native_caches, python_caches = _native_then_python(model, monkeypatch, common, ids, positions,
                                                                       kv_dtype)
    assert torch.equal(native, python)
    assert all(_same(a, b) for a, b in zip(native_caches, python_caches))
    assert not any(_same(a, b) for a, b in zip(native_caches, _caches(model, seed=3, dtype=kv_dtype)))
    bf16 = _forward(model, _caches(model, seed=3), CpuPagedBackend(), common, ids, positions, None)
    assert not torch.equal(native, bf16)  # the rounded context changed the result


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_native_rounding_into_float8_is_torchs(kv_dtype: torch.dtype) -> None:
    """Every bfloat16 value (the vector path, and the scalar tail of rows not a multiple of 16 long) rounds into
    the same float8 bits as ``quantize_kv``: ties to even, saturation at the format's largest finite value, every
    NaN to 0xff."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    expected = quantize_kv(every, kv_dtype)
    assert _same(decoder_stack.fp8_from_bf16(every, kv_dtype), expected)
    tails = every[:15 * 4369].view(4369, 15)  # 15 values a call: the scalar path alone
    assert _same(torch.cat([decoder_stack.fp8_from_bf16(row, kv_dtype) for row in tails]), expected[:15 * 4369])
    assert quantize_kv(torch.tensor([1e6, -1e6]), kv_dtype).float().tolist() == [torch.finfo(kv_dtype).max,
                                                                                 -torch.finfo(kv_dtype).max]


def test_native_stack_follows_its_caches_from_call_to_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack binds the caches once and rebinds only when other tensors come (the self-speculative draft's):
    each call writes into and reads from the caches it was given, also after a call whose caches were refused."""
    model = _model(16, False)
    ids, positions, common = _mixed_step(model.cfg.vocab_size)
    backend = CpuPagedBackend()
    first, second = _caches(model, seed=3), _caches(model, seed=4)
    outs = [_forward(model, caches, backend, common, ids, positions, None) for caches in (first, second)]
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        _forward(model, [first[0], first[1][:, :NUM_BLOCKS // 2], first[2]], backend, common, ids, positions, None)
    outs.append(_forward(model, second, backend, common, ids, positions, None))  # the last bound, not the refused
    monkeypatch.setenv("PAGELLM_NATIVE_DECODER", "0")
    ref_first, ref_second = _caches(model, seed=3), _caches(model, seed=4)
    refs = [_forward(model, caches, backend, common, ids, positions, None)
            for caches in (ref_first, ref_second, ref_second)]
    assert all(torch.equal(out, ref) for out, ref in zip(outs, refs))
    assert all(torch.equal(a, b) for a, b in zip(first + second, ref_first + ref_second))


def test_python_layers_serve_float32_and_other_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_native(monkeypatch)
    fp32 = _model(16, False, torch.float32)
    assert native_stack.build_stack(fp32.model) is None
    ids, positions, common = _mixed_step(fp32.cfg.vocab_size)
    _forward(fp32, _caches(fp32, 0), CpuPagedBackend(), common, ids, positions, None)
    bf16 = _model(16, False)
    common.tree_masks = None  # torch_ref serves trees through its reference path; keep this step causal
    ref = _forward(bf16, _caches(bf16, 0), TorchRefBackend(), common, ids, positions, None)
    assert calls == []
    native = _forward(bf16, _caches(bf16, 0), CpuPagedBackend(), common, ids, positions, None)
    assert calls == [1]
    torch.testing.assert_close(native.float(), ref.float(), atol=0.1, rtol=0.05)  # other kernels: rounding only


def test_native_stack_rejects_misfit_inputs() -> None:
    model = _model(16, False)
    stack = native_stack.stack_for(model.model)
    ids, positions, common = _mixed_step(model.cfg.vocab_size)
    md = CpuPagedBackend().build(common)
    x = model.model.embed_tokens(ids)
    caches = _caches(model, 0)
    with pytest.raises(ValueError, match="one position and one cache slot per token"):
        stack.run(x, positions[:-1], caches, md, 2)
    with pytest.raises(ValueError, match="asked for 4 layers of a 3-layer stack"):
        stack.run(x, positions, caches + caches[:1], md, 2)
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        stack.run(x, positions, [c.float() for c in caches], md, 2)
    snapshot = [c.clone() for c in caches]
    with pytest.raises(IndexError, match=r"cache slots must lie in \[0, 384\)"):
        stack.run(x, positions, caches, dataclasses.replace(md, slot_mapping=md.slot_mapping + 384), 2)
    with pytest.raises(IndexError, match=r"positions in \[0, 256\)"):
        stack.run(x, positions + 256, caches, md, 2)
    assert all(torch.equal(a, b) for a, b in zip(caches, snapshot))  # nothing written


def test_native_stack_refuses_layers_unlike_their_shape() -> None:
    """A layer's norms must be its kind's (Gemma's four with ``sandwich``, Cohere's one with ``parallel``), its own
    rotary tables the stack's shape and its sinks one float32 per head: each misfit is refused by name when the
    stack is built, never read out of bounds."""
    model = _model(16, False)
    rotary = model.model.layers[0].self_attn.rotary
    weights = [native_stack._layer_weights(layer, rotary) for layer in model.model.layers]
    shape = native_stack.stack_for(model.model).shape
    norm = model.model.norm.weight

    def build(layers: list, stack_shape: object = shape) -> DecoderStack:
        return DecoderStack(layers, stack_shape, norm, rotary.cos, rotary.sin)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="with sandwich one after it too"):
        build(weights, dataclasses.replace(shape, sandwich=True))
    with pytest.raises(ValueError, match="with parallel none but the input norm"):
        build(weights, dataclasses.replace(shape, parallel=True))
    sandwich = [dataclasses.replace(w, pre_ffn_norm=norm, post_ffn_norm=norm) for w in weights]
    with pytest.raises(ValueError, match="OLMo's norms .*, Gemma's .* or Cohere's"):
        build(sandwich, dataclasses.replace(shape, sandwich=True, post_norms=True))
    assert build(sandwich, dataclasses.replace(shape, sandwich=True)).shape.sandwich
    parallel = [dataclasses.replace(w, post_norm=None) for w in weights]
    assert build(parallel, dataclasses.replace(shape, parallel=True, layer_norm=True)).shape.parallel
    short = [dataclasses.replace(weights[0], cos=rotary.cos[:8].contiguous(), sin=rotary.sin[:8].contiguous()),
             *weights[1:]]
    with pytest.raises(ValueError, match="rotary tables come together, each of the stack's shape"):
        build(short)
    heads = shape.heads
    for sinks in (torch.zeros(heads, dtype=torch.bfloat16), torch.zeros(heads + 1)):  # float32, one per head
        with pytest.raises(ValueError, match=f"attention sinks are contiguous float32 \\[{heads}\\]"):
            build([dataclasses.replace(weights[0], sinks=sinks), *weights[1:]])


def test_the_all_reduce_sums_each_row_parallel_output_and_its_failure_surfaces() -> None:
    """A tensor-parallel rank's stack calls the ranks' all-reduce on o_proj's and down_proj's output rows of every
    layer, in place; a collective that raises (a dead rank) fails the call with its error, and the next call runs."""
    model = _model(64, False)
    single = native_stack.stack_for(model.model)
    rotary = model.model.layers[0].self_attn.rotary
    weights = [native_stack._layer_weights(layer, rotary) for layer in model.model.layers]
    ids, positions, common = _mixed_step(model.cfg.vocab_size)
    md = CpuPagedBackend().build(common)
    x = model.model.embed_tokens(ids)
    sums: list[torch.Tensor] = []
    stack = DecoderStack(weights, single.shape, model.model.norm.weight, rotary.cos, rotary.sin,  # type: ignore
                         all_reduce=lambda t: sums.append(t.clone()) or t.mul_(0))
    zeroed = stack.run(x, positions, _caches(model, 3), md, 2)
    assert [tuple(t.shape) for t in sums] == [(len(ids) * model.cfg.hidden_size,)] * 6  # 3 x (o_proj, down_proj)
    assert not torch.equal(zeroed, single.run(x, positions, _caches(model, 3), md, 2))  # the sums took effect
    dead = [RuntimeError("rank 1 died")]

    def flaky(t: torch.Tensor) -> torch.Tensor:  # fails once, then sums a single rank's rows: the identity
        if dead:
            raise dead.pop()
        return t

    stack = DecoderStack(weights, single.shape, model.model.norm.weight, rotary.cos, rotary.sin,  # type: ignore
                         all_reduce=flaky)
    with pytest.raises(RuntimeError, match="rank 1 died"):
        stack.run(x, positions, _caches(model, 3), md, 2)
    assert torch.equal(stack.run(x, positions, _caches(model, 3), md, 2),
                       single.run(x, positions, _caches(model, 3), md, 2))


def _greedy(path: Path, monkeypatch: pytest.MonkeyPatch, native: bool, **kwargs) -> list[list[int]]:
    monkeypatch.setenv("PAGELLM_NATIVE_DECODER", "1" if native else "0")
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory=256 * 16 * 2 * 2 * 2 * 16 * 2, **kwargs)
    gen = torch.Generator().manual_seed(4)
    prompts = []
    for n in (5, 17, 40):
        p = torch.randint(0, 256, (n,), generator=gen).tolist()
        prompts.append(p + p[:6] + p)  # repetition: drafts get accepted
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("spec", [None, {"method": "draft_model", "num_speculative_tokens": 3, "draft_layers": 1,
                                         "disable_by_batch_size": None}], ids=["plain", "self-spec"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_engine_greedy_tokens_are_identical(tiny_model_factory, monkeypatch: pytest.MonkeyPatch, arch: str,
                                            spec: dict | None) -> None:
    path = tiny_model_factory(arch)
    calls = _count_native(monkeypatch)
    kwargs = dict(max_num_batched_tokens=32, attention_backend="cpu_paged", speculative_config=spec)
    native = _greedy(path, monkeypatch, True, **kwargs)
    assert calls  # the engine's steps (and the self-speculative draft's passes) took the native stack
    taken = len(calls)
    assert _greedy(path, monkeypatch, False, **kwargs) == native
    assert len(calls) == taken


def test_engine_greedy_tokens_are_identical_over_a_float8_cache(tiny_model_factory,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_model_factory("llama")
    calls = _count_native(monkeypatch)
    kwargs = dict(max_num_batched_tokens=32, attention_backend="cpu_paged", kv_cache_dtype="fp8")
    native = _greedy(path, monkeypatch, True, **kwargs)
    assert calls
    assert _greedy(path, monkeypatch, False, **kwargs) == native


@pytest.mark.skipif(not gemm_w8a8.available(), reason="the int8 GEMM needs AVX-512 VNNI")
@pytest.mark.parametrize(("arch", "quantization"), [("llama", "w8a8_int8"), ("qwen2", "w8a8_int8"),
                                                    ("qwen3", "w8a8_int8"), ("qwen3", "w4a8_int4"),
                                                    ("llama", "w4a16_int4")])
def test_engine_greedy_tokens_are_identical_with_quantized_weights(tiny_model_factory, monkeypatch: pytest.MonkeyPatch,
                                                                   arch: str, quantization: str) -> None:
    if quantization == "w4a16_int4" and not gemm_w4a16.available():
        pytest.skip("the W4A16 kernel needs AVX-512 BF16 and VNNI")
    path = tiny_model_factory(arch)
    calls = _count_native(monkeypatch)
    kwargs = dict(max_num_batched_tokens=32, attention_backend="cpu_paged", quantization=quantization)
    native = _greedy(path, monkeypatch, True, **kwargs)
    assert calls
    assert _greedy(path, monkeypatch, False, **kwargs) == native
