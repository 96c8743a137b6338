"""``quantization="w8a8_int8"`` and ``"w4a8_int4"`` (``--quantization``) through the whole engine, on tiny models:
the decoder layers' weights become int8 or 4-bit (the LM head stays bfloat16), greedy tokens equal those of the
plain-PyTorch twin (the format's ``reference_linear`` in place of its kernel, Python layers), self-speculative
decoding stays lossless, every block comes back, and a setting the engine cannot serve is refused with what to
change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.ops import gemm, gemm_w4a8, gemm_w4a16, gemm_w8a8

kernel = pytest.mark.skipif(not gemm_w8a8.available(), reason="the int8 GEMM needs AVX-512 VNNI and a compiler")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
KV = 256 * 16 * 2048


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (4, 21, 50)]
    return [p + p[:5] + p for p in prompts]  # repetition: self-speculative drafts get accepted


def _greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


def _scored(llm: LLM) -> list[tuple[list[int], float]]:
    """Greedy tokens and their summed logprob (the logits' bits show through it)."""
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in outs]


def _all_free(llm: LLM) -> bool:
    kv = llm.engine.core.scheduler.kv
    return kv.num_free_blocks == kv.pool.num_blocks and not llm.engine.has_unfinished_requests()


def _twin(fmt):  # noqa: ANN001, ANN202
    """``fmt.packed_linear`` through its plain-PyTorch twin."""
    def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        k = x.shape[-1]
        y = fmt.reference_linear(x.reshape(-1, k).to(torch.bfloat16), *fmt.unpack(packed, n, k), bias)
        return y.view(*x.shape[:-1], n)
    return linear


@kernel
@pytest.mark.parametrize(("arch", "fmt"), [("llama", gemm_w8a8), ("qwen2", gemm_w8a8), ("qwen2_moe", gemm_w8a8),
                                           ("llama", gemm_w4a8), ("qwen2_moe", gemm_w4a8)],
                         ids=["llama-w8a8", "qwen2-w8a8", "qwen2_moe-w8a8", "llama-w4a8", "qwen2_moe-w4a8"])
def test_quantized_engine_matches_its_plain_pytorch_twin(tiny_model_factory, monkeypatch: pytest.MonkeyPatch,
                                                         arch: str, fmt) -> None:  # noqa: ANN001
    path = tiny_model_factory(arch)
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory=KV, quantization=fmt.FORMAT, max_num_batched_tokens=32)
    model = llm.engine.core.executor.worker.runner.model
    layer = model.model.layers[0]
    mlps = [*layer.mlp.experts, layer.mlp.shared_expert] if arch == "qwen2_moe" else [layer.mlp]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *(m.gate_up_proj for m in mlps),
                   *(m.down_proj for m in mlps)):
        assert gemm.weight_format(linear.weight) == fmt.FORMAT and linear.weight.dtype == torch.int8
    if arch == "qwen2_moe":  # the router stays bfloat16 (packed, never quantized)
        assert gemm.weight_format(layer.mlp.gate.weight) == "bf16"
    assert gemm.weight_format(model.lm_head.weight) == "bf16"
    fast = _scored(llm)
    assert _all_free(llm)
    monkeypatch.setenv("PAGELLM_NATIVE_DECODER", "0")
    monkeypatch.setattr(fmt, "packed_linear", _twin(fmt))
    twin = LLM(str(path), dtype="bfloat16", kv_cache_memory=KV, quantization=fmt.FORMAT, max_num_batched_tokens=32)
    assert _scored(twin) == fast
    assert all(len(tokens) == GREEDY.max_tokens for tokens, _ in fast)
    # and it is not the bfloat16 model's output by accident
    plain = LLM(str(path), dtype="bfloat16", kv_cache_memory=KV, max_num_batched_tokens=32)
    assert [score for _, score in _scored(plain)] != [score for _, score in fast]


@kernel
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_an_int8_lm_head_matches_its_plain_pytorch_twin(tiny_model_factory, monkeypatch: pytest.MonkeyPatch,
                                                        tied: bool) -> None:
    """``quantize_lm_head``: the LM head's rows int8 (over 4-bit decoder layers here); a tied embedding reads its
    rows out of that same int8 matrix, dequantized. Greedy tokens and logprobs equal the twin's (both kernels'
    plain-PyTorch twins, Python layers), and the head's rounding shows in them."""
    path = tiny_model_factory("llama", tie_word_embeddings=tied)
    kwargs = dict(dtype="bfloat16", kv_cache_memory=KV, quantization="w4a8_int4", quantize_lm_head=True,
                  max_num_batched_tokens=32)
    llm = LLM(str(path), **kwargs)
    model = llm.engine.core.executor.worker.runner.model
    head, table = model.lm_head.weight, model.model.embed_tokens.weight
    assert gemm.weight_format(head) == "w8a8_int8" and (table is head) == tied
    ids = torch.tensor([0, 5, 257, 3])
    assert torch.equal(model.model.embed_tokens(ids), gemm.plain(table)[ids])
    fast = _scored(llm)
    assert _all_free(llm)
    monkeypatch.setenv("PAGELLM_NATIVE_DECODER", "0")
    for fmt in (gemm_w8a8, gemm_w4a8):
        monkeypatch.setattr(fmt, "packed_linear", _twin(fmt))
    assert _scored(LLM(str(path), **kwargs)) == fast
    plain_head = LLM(str(path), **{**kwargs, "quantize_lm_head": False})
    assert [score for _, score in _scored(plain_head)] != [score for _, score in fast]


def test_an_int8_lm_head_on_a_float32_model_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="quantize_lm_head runs on bfloat16 models; set dtype bfloat16"):
        LLM(str(tiny_llama), dtype="float32", quantize_lm_head=True)


@kernel
@pytest.mark.parametrize("quantization", ["w8a8_int8", "w4a8_int4", "w4a16_int4"])
def test_self_speculative_decoding_over_quantized_weights_is_lossless(tiny_llama: Path, quantization: str) -> None:
    if quantization == "w4a16_int4" and not gemm_w4a16.available():
        pytest.skip("the W4A16 kernel needs AVX-512 BF16 and VNNI")
    kwargs = dict(dtype="bfloat16", kv_cache_memory=KV, quantization=quantization, max_num_batched_tokens=64)
    plain = _greedy(LLM(str(tiny_llama), **kwargs))
    spec = LLM(str(tiny_llama), speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                                    "draft_layers": 1, "disable_by_batch_size": None}, **kwargs)
    assert _greedy(spec) == plain
    assert _all_free(spec)


def test_an_unknown_quantization_names_the_choice(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="quantization='int4' is not supported; use w8a8_int8, w4a8_int4, "
                                         "w4a16_int4 or leave it unset"):
        LLM(str(tiny_llama), quantization="int4")


@pytest.mark.parametrize("quantization", ["w8a8_int8", "w4a8_int4"])
def test_quantized_weights_on_a_float32_model_are_refused(tiny_llama: Path, quantization: str) -> None:
    with pytest.raises(ValueError, match=f"quantization={quantization} runs on bfloat16 models; set dtype bfloat16"):
        LLM(str(tiny_llama), dtype="float32", quantization=quantization)


@pytest.mark.parametrize(("quantization", "int8_head"), [(None, False), ("w8a8_int8", False), ("w4a8_int4", False),
                                                         (None, True), ("w4a8_int4", True)])
def test_a_quantized_kernel_is_built_at_start_only_when_asked(monkeypatch: pytest.MonkeyPatch,
                                                             quantization: str | None, int8_head: bool) -> None:
    from pagellm import native_build
    from pagellm.worker import worker

    started: list[Path] = []
    monkeypatch.setattr(native_build, "start_in_background", lambda jobs: started.extend(j.args[0] for j in jobs))
    worker._start_kernel_builds(torch.bfloat16, torch.bfloat16, "auto", quantization, int8_head)
    for fmt, head in ((gemm_w8a8, int8_head), (gemm_w4a8, False)):
        assert (fmt.SOURCE in started) == ((quantization == fmt.FORMAT or head) and fmt.runs_here())
