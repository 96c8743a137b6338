"""Sliding-window models (Mistral v0.1's config, Phi-3's, Qwen's ``use_sliding_window`` with its full-attention
layers, Mixtral, the Qwen mixtures of experts, Gemma 2's and Gemma 3's global layers) served past their window:
greedy output equals transformers' in every scheduling mode, with prefix-cache hits, under preemption and with
speculative decoding; and the context length is the model's, not the window's."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.model.arch import ArchConfig
from pagellm.ops import decoder_stack
from tests.engine.test_parity import (MODES, _hf_model, _prompts, assert_greedy_parity, hf_reference, run,
                                      scored_with_and_without_the_stack)

WINDOW = 20  # prompts run to 121 tokens and 24 more are generated: most tokens see only part of their context
# arch → the config that slides (Qwen2's and Qwen3's first max_window_layers layers, Qwen2-MoE's odd-numbered ones
# attend to every key)
WINDOWED = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "phi3": dict(sliding_window=WINDOW),
    "mixtral": dict(sliding_window=WINDOW),
    "qwen2_moe": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=WINDOW),
    "gemma2": dict(sliding_window=WINDOW),  # every other layer slides
    "gemma3": dict(sliding_window=WINDOW, sliding_window_pattern=2, layer_types=None),  # every 2nd layer is global
}
# The layers that slide, as transformers builds them (2 layers each)
SLIDING_LAYERS = {"mistral": [0, 1], "qwen2": [1], "qwen3": [1], "phi3": [0, 1], "mixtral": [0, 1], "qwen2_moe": [0],
                  "qwen3_moe": [0, 1], "gemma2": [0], "gemma3": [0]}


def _windowed(tiny_model_factory, arch: str):  # noqa: ANN001, ANN202
    return tiny_model_factory(arch, seed=11, **WINDOWED[arch])


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_the_layers_that_slide_are_transformers(tiny_model_factory, arch: str) -> None:
    model_dir = _windowed(tiny_model_factory, arch)
    hf = transformers.AutoConfig.from_pretrained(model_dir)
    kinds = getattr(hf, "layer_types", None)
    if kinds is not None:  # the families that name each layer's kind: the same layers
        assert [i for i, kind in enumerate(kinds) if kind == "sliding_attention"] == SLIDING_LAYERS[arch]
    # from the config as saved, and as older checkpoints write it (no layer_types: the family's rule)
    for cfg in (hf.to_dict(), {k: v for k, v in hf.to_dict().items() if k != "layer_types"}):
        ours = ArchConfig.from_hf(cfg)
        assert [i for i in range(ours.num_layers) if ours.layer_window(i) == WINDOW] == SLIDING_LAYERS[arch]


def test_gemma3s_first_config_layout_reads_as_transformers_5s(tiny_model_factory) -> None:
    """Gemma 3's checkpoints as first published (rope_theta, rope_local_base_freq, rope_scaling, and a global layer
    every sliding_window_pattern-th) and as transformers 5 saves them (rope_parameters by layer type, layer_types)
    make the same model."""
    saved = transformers.AutoConfig.from_pretrained(_windowed(tiny_model_factory, "gemma3")).to_dict()
    rope = saved["rope_parameters"]
    first = {k: v for k, v in saved.items() if k not in ("rope_parameters", "layer_types")}
    first.update(rope_theta=rope["full_attention"]["rope_theta"], sliding_window_pattern=2, rope_scaling=None,
                 rope_local_base_freq=rope["sliding_attention"]["rope_theta"])
    ours = ArchConfig.from_hf(first)
    assert ours == ArchConfig.from_hf(saved)
    assert (ours.rope_theta, ours.local_rope_theta, ours.attn_scale) == (100000.0, 1000.0, 24 ** -0.5)
    scaled = ArchConfig.from_hf({**first, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert scaled.rope_scaling == {"rope_type": "linear", "factor": 8.0} and scaled.local_rope_theta == 1000.0
    with pytest.raises(ValueError, match="attn_logit_softcapping is Gemma 2's; a Gemma 3 config with it"):
        ArchConfig.from_hf({**first, "attn_logit_softcapping": 50.0})


@pytest.mark.parametrize("arch", list(WINDOWED))
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_parity_past_the_window(tiny_model_factory, arch: str, mode: str) -> None:
    model_dir = _windowed(tiny_model_factory, arch)
    llm = LLM(str(model_dir), dtype="float32", **MODES[mode])
    assert llm.input_processor.max_model_len == 512  # the model's context, not the window
    prompts = _prompts(seed=12)
    assert_greedy_parity(model_dir, prompts, run(llm, prompts))


def test_the_window_changes_transformers_output(tiny_model_factory) -> None:
    """The parity above means something: the same weights without the window generate other tokens."""
    windowed = _windowed(tiny_model_factory, "mistral")
    full = tiny_model_factory("mistral", seed=11, sliding_window=None)
    prompts = _prompts(seed=12)
    differ = sum(hf_reference(windowed, p)[0] != hf_reference(full, p)[0] for p in prompts)
    assert differ >= len(prompts) // 2


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma3"])
def test_greedy_parity_past_the_window_with_prefix_hits_and_preemption(tiny_model_factory, arch: str) -> None:
    model_dir = _windowed(tiny_model_factory, arch)
    prompts = _prompts(seed=13, shared_prefix=37)
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=128)
    first = run(llm, prompts)
    second = run(llm, prompts)
    assert sum(s.prefix_cache_hits for s in llm.last_stats) > 0
    assert_greedy_parity(model_dir, prompts, first)
    assert second == first
    # 2 layers x 2 KV heads x 16 dims x 2 (K and V) x 4 bytes = 512 B per token: 24 blocks of 16 tokens.
    small = LLM(str(model_dir), dtype="float32", kv_cache_memory=24 * 16 * 512, max_model_len=200)
    preempted = run(small, prompts)
    assert sum(s.num_preemptions for s in small.last_stats) > 0
    assert_greedy_parity(model_dir, prompts, preempted)
    kv = small.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_ngram_speculation_past_the_window_is_lossless(tiny_model_factory) -> None:
    model_dir = _windowed(tiny_model_factory, "mistral")
    base = _prompts(seed=14)
    prompts = [p + p[:20] + p for p in base[:6]]
    plain = run(LLM(str(model_dir), dtype="float32"), prompts)
    spec = LLM(str(model_dir), dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None})
    assert run(spec, prompts) == plain
    drafts = [s.spec_decoding for s in spec.last_stats if s.spec_decoding is not None]
    assert sum(d.num_draft_tokens for d in drafts) > 0, "the proposer never drafted"


def test_drafts_as_deep_as_the_window_are_refused(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("mistral", seed=11, sliding_window=4)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=4 must be below the model's sliding window \(4\)"):
        LLM(str(model_dir), dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4})


@pytest.mark.skipif(not decoder_stack.available(), reason="the native decoder stack does not run here")
def test_bfloat16_past_the_window_native_stack_equals_the_python_layers(tiny_model_factory, monkeypatch) -> None:
    """bfloat16 runs every layer in the one-call native stack, windowed layers included (Qwen2's full-attention
    layer beside its sliding one): the same tokens and logprobs as the Python layers, bit for bit."""
    results = scored_with_and_without_the_stack(monkeypatch, _windowed(tiny_model_factory, "qwen2"),
                                                _prompts(seed=15)[-4:])
    assert results["1"] == results["0"]


@pytest.mark.parametrize("arch,released", [("mistral", True), ("qwen3_moe", True), ("qwen2", False)])
def test_a_long_request_holds_only_its_windows_blocks(tiny_model_factory, arch: str, released: bool) -> None:
    """Where every layer slides, a request gives back the blocks behind its window as it moves on: one request of
    121 + 120 tokens, in chunks of 16, holds at most 3 blocks of 16 (window 20) instead of 15; greedy output still
    equals transformers', and every block comes back. A model with a full-attention layer (Qwen2's first) keeps
    them all."""
    model_dir = _windowed(tiny_model_factory, arch)
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=16, enable_chunked_prefill=True)
    kv = llm.engine.core.scheduler.kv
    assert kv.sliding_window == (WINDOW if released else 0)
    prompt = _prompts(seed=16)[-1]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True), use_tqdm=False)
    peak = round(max(s.kv_cache_usage for s in llm.last_stats) * kv.pool.num_blocks)
    assert peak == (3 if released else 15)
    assert kv.num_free_blocks == kv.pool.num_blocks
    _assert_long_parity(model_dir, prompt, list(out[0].outputs[0].token_ids))


def _assert_long_parity(model_dir, prompt: list[int], ours: list[int]) -> None:  # noqa: ANN001
    """test_parity's rule over a longer continuation: equal tokens up to a float tie, where both candidates are in
    transformers' top 2."""
    ids = torch.tensor([prompt])
    out = _hf_model(model_dir).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(ours),
                                        do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                                        return_dict_in_generate=True)
    ref = out.sequences[0, len(prompt):].tolist()
    step = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if step is not None:
        top2 = out.logits[step][0].topk(2).indices.tolist()
        assert ours[step] in top2 and ref[step] in top2, f"step {step}: ours {ours[step]}, transformers {ref[step]}"


def test_a_prompt_whose_first_blocks_were_evicted_still_hits_its_window(tiny_model_factory) -> None:
    """A hit needs only the blocks the next token's window sees: after another request reuses (evicts) a prompt's
    first blocks, the same prompt again hits all but its last block's tokens and generates the same tokens."""
    model_dir = _windowed(tiny_model_factory, "mistral")
    # 512 B per token: 32 blocks of 16, one max_model_len request's worth
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=32 * 16 * 512, max_model_len=512)
    prompt, other = _prompts(seed=17)[-1], _prompts(seed=18)[-1]  # 121 tokens each
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.generate([other], SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True), use_tqdm=False)
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_evictions > 0  # the other request reused some of the first one's blocks
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 112  # 7 full blocks, the last token always computed
    assert again.outputs[0].token_ids == first
    assert kv.num_free_blocks == kv.pool.num_blocks


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_disable_sliding_window_caps_the_context_to_the_window(tiny_model_factory, arch: str) -> None:
    """vLLM's ``disable_sliding_window``: full attention in every layer, the context capped to the window, inside
    which greedy output is transformers' (which slides, and sees every key there too)."""
    model_dir = _windowed(tiny_model_factory, arch)
    llm = LLM(str(model_dir), dtype="float32", disable_sliding_window=True)
    assert llm.input_processor.max_model_len == WINDOW
    worker = llm.engine.core.executor.worker
    assert all(worker.arch.layer_window(i) is None for i in range(worker.arch.num_layers))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    prompts = [[5, 17, 3, 99, 42, 8], [61, 2, 2, 30]]
    params = SamplingParams(temperature=0.0, max_tokens=WINDOW - 6, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=WINDOW - 6, do_sample=False,
                              min_new_tokens=WINDOW - 6)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(1, WINDOW + 2))], params, use_tqdm=False)
    with pytest.raises(ValueError, match="sliding window"):
        LLM(str(model_dir), dtype="float32", disable_sliding_window=True, max_model_len=WINDOW + 1)
