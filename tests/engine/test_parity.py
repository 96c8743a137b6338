"""Greedy parity with transformers on tiny random models (dense and mixture-of-experts), in every scheduling mode.

Our engine's greedy tokens must equal ``transformers`` ``generate()`` token for token (float32). Where a float tie
flips a token, both candidates must be within each other's top-2 at that step; the sequences are compared no
further after such a flip. No other slack.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.ops.decoder_stack import DecoderStack
from pagellm.sampling_params import StructuredOutputsParams

MAX_TOKENS = 24
PROMPT_LENS = [3, 7, 16, 17, 31, 33, 48, 64, 90, 121]


def _prompts(seed: int, shared_prefix: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 256, (shared_prefix,), generator=gen).tolist()
    return [prefix + torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]


_REFERENCE_CACHE: dict[tuple, tuple[list[int], torch.Tensor]] = {}


def hf_reference(model_dir: Path, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and per-step logits for one prompt (cached per model and prompt)."""
    key = (str(model_dir), tuple(prompt))
    if key not in _REFERENCE_CACHE:
        model = _hf_model(model_dir)
        ids = torch.tensor([prompt])
        # An explicit mask: otherwise generate() takes prompt tokens equal to the pad id for padding.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        _REFERENCE_CACHE[key] = (tokens, torch.stack(out.logits, dim=1)[0].float())
    return _REFERENCE_CACHE[key]


_HF_MODELS: dict[str, transformers.PreTrainedModel] = {}


def _hf_model(model_dir: Path) -> transformers.PreTrainedModel:
    if str(model_dir) not in _HF_MODELS:
        _HF_MODELS[str(model_dir)] = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval()
    return _HF_MODELS[str(model_dir)]


def prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Each prompt token's log-probability as the engine scores the prompt (the first token has none)."""
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """The same as transformers computes them in float32."""
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


def assert_greedy_parity(model_dir: Path, prompts: list[list[int]], ours: list[list[int]]) -> None:
    flips = 0
    for prompt, got in zip(prompts, ours):
        ref, logits = hf_reference(model_dir, prompt)
        assert len(got) == len(ref) == MAX_TOKENS
        for step, (a, b) in enumerate(zip(got, ref)):
            if a == b:
                continue
            top2 = logits[step].topk(2).indices.tolist()
            assert a in top2 and b in top2, f"step {step}: ours {a}, transformers {b}, top-2 {top2}"
            flips += 1
            break
    assert flips <= len(prompts) // 4, f"{flips} float-tie flips out of {len(prompts)} prompts is not a tie"


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


ARCHS = ["llama", "qwen2", "qwen3", "phi3", "smollm3", "granite", "olmo2", "olmo3", "exaone4", "ernie4_5", "cohere",
         "cohere2", "granite4", "gemma", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe", "granitemoe",
         "gpt_oss"]

def assert_seeded_grammar(llm: LLM, seed: int) -> None:
    """Regex-constrained samples have the regex's shape, and the same seed gives the same texts again (what
    parallel ranks must agree on)."""
    so = StructuredOutputsParams(regex="[0-9]{3}-[a-z]{2}")
    params = SamplingParams(temperature=1.0, seed=seed, structured_outputs=so, max_tokens=12)
    texts = [o.outputs[0].text for o in llm.generate(["Q:"] * 3, params, use_tqdm=False)]
    assert all(len(t) == 6 and t[:3].isdigit() and t[3] == "-" for t in texts)
    assert [o.outputs[0].text for o in llm.generate(["Q:"] * 3, params, use_tqdm=False)] == texts


def scored(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], float]]:
    """Greedy tokens (12 per prompt) and their summed logprob: the logits' bits show through it."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
            for o in llm.generate(prompts, params, use_tqdm=False)]


def scored_with_and_without_the_stack(monkeypatch: pytest.MonkeyPatch, model_dir: Path, prompts: list[list[int]],
                                      method: str = "run", **llm_kwargs) -> dict[str, list]:
    """``scored`` from a fresh bfloat16 engine with the native decoder stack on ("1") and off ("0"); the stack's
    ``method`` (``run``, or a pipeline stage's ``run_stage``) must have run on rank 0 exactly when it was on."""
    calls: list[int] = []
    real = getattr(DecoderStack, method)
    monkeypatch.setattr(DecoderStack, method, lambda self, *a: calls.append(1) or real(self, *a))
    results = {}
    for native in ("1", "0"):
        monkeypatch.setenv("PAGELLM_NATIVE_DECODER", native)
        llm = LLM(str(model_dir), dtype="bfloat16", **llm_kwargs)
        try:
            results[native] = scored(llm, prompts)
        finally:
            llm.shutdown()
        assert bool(calls) == (native == "1")
        calls.clear()
    return results


MODES = {
    "chunked": dict(max_num_batched_tokens=40),
    "unchunked": dict(enable_chunked_prefill=False),
    "no-prefix-cache": dict(enable_prefix_caching=False, max_num_batched_tokens=64),
    "torch-ref-attention": dict(attention_backend="torch_ref", max_num_batched_tokens=64),
    # long_prefill_token_threshold: several prompts in 12-token chunks side by side
    "long-prefill-cap": dict(max_num_batched_tokens=64, long_prefill_token_threshold=12),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_parity_modes(tiny_model_factory, arch: str, mode: str) -> None:
    model_dir = tiny_model_factory(arch)
    llm = LLM(str(model_dir), dtype="float32", **MODES[mode])
    prompts = _prompts(seed=1)
    assert_greedy_parity(model_dir, prompts, run(llm, prompts))


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3", "smollm3", "granite", "granitemoe", "olmo2", "olmo3",
                                  "exaone4", "ernie4_5", "cohere", "cohere2", "granite4", "gpt_oss"])
def test_prompt_logprobs_of_each_familys_own_parts_are_transformers(tiny_model_factory, arch: str) -> None:
    """Each family's own parts to within 1e-5 of transformers' log-probabilities, where a greedy token could hide a
    small slip: Gemma's (GeGLU's tanh, norms scaling by 1 + w, the scaled embeddings; Gemma 3's norms around each
    sublayer, its attention scale and two rope bases), SmolLM3's NoPE layer, Granite's multipliers, OLMo's norms
    after each sublayer and across all heads, OLMo 3's sliding layer, EXAONE 4's per-head norms and NoPE full layer,
    ERNIE 4.5's and Cohere's interleaved rotary pairs, Cohere's LayerNorms, side-by-side sublayers and logit scale,
    Command R7B's NoPE full layer, gpt-oss's sinks, biases, clamped experts and YaRN past its original context."""
    model_dir = tiny_model_factory(arch)
    prompt = _prompts(seed=7)[-1]  # 121 tokens: past Gemma 3's 16-token window
    llm = LLM(str(model_dir), dtype="float32")
    ours, theirs = prompt_logprobs(llm, prompt), hf_prompt_logprobs(model_dir, prompt)
    assert (ours - theirs).abs().max().item() < 1e-5


def test_gemma2s_capped_scores_run_on_the_cpu_kernel_as_on_its_twin(tiny_model_factory) -> None:
    """Gemma 2's soft-capped attention scores take the C++ paged kernel (``auto``; the tiny model's cap of 1 bends
    nearly every score): its prompt log-probabilities are the reference backend's, in float32 within 1e-5."""
    model_dir, prompt = tiny_model_factory("gemma2"), _prompts(seed=9)[-1]
    results = {}
    for backend in ("auto", "torch_ref"):
        llm = LLM(str(model_dir), dtype="float32", attention_backend=backend)
        try:
            assert llm.engine.core.executor.worker.runner.backend.name == ("torch_ref" if backend == "torch_ref"
                                                                              else "cpu_paged")
            results[backend] = prompt_logprobs(llm, prompt)
        finally:
            llm.shutdown()
    assert (results["auto"] - results["torch_ref"]).abs().max().item() < 1e-5


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3", "cohere2", "gpt_oss"])
def test_gemma_gpt_oss_and_cohere_in_bfloat16_keep_to_transformers(tiny_model_factory,
                                                                   monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """Gemma's, Cohere's and gpt-oss's bfloat16 steps take the native decoder stack (Gemma's layers: soft caps,
    GeGLU, four norms, Gemma 3's sliding layers' own rope base; Cohere's LayerNorm and parallel sublayers; gpt-oss's
    sinks, o_proj bias and biased experts), within bfloat16's rounding of transformers' float32 log-probabilities."""
    calls: list[int] = []
    real = DecoderStack.run
    monkeypatch.setattr(DecoderStack, "run", lambda self, *a: calls.append(1) or real(self, *a))
    model_dir = tiny_model_factory(arch)
    prompt = _prompts(seed=7)[-1]
    llm = LLM(str(model_dir), dtype="bfloat16")
    ours, theirs = prompt_logprobs(llm, prompt), hf_prompt_logprobs(model_dir, prompt)
    assert calls and (ours - theirs).abs().mean().item() < 0.03


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_prefix_cache_hits(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=128)
    prompts = _prompts(seed=2, shared_prefix=37)
    first = run(llm, prompts)
    hits_first = sum(s.prefix_cache_hits for s in llm.last_stats)
    second = run(llm, prompts)  # every prompt now hits its own blocks
    hits_second = sum(s.prefix_cache_hits for s in llm.last_stats)
    assert hits_first > 0, "prompts sharing a 37-token prefix must hit the cache within one batch"
    assert hits_second > hits_first
    assert_greedy_parity(model_dir, prompts, first)
    assert second == first


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_under_preemption(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    # 2 layers x 2 KV heads x 16 dims x 2 (K and V) x 4 bytes = 512 B per token: 24 blocks of 16 tokens.
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=24 * 16 * 512, max_model_len=160)
    prompts = _prompts(seed=3)
    ours = run(llm, prompts)
    assert sum(s.num_preemptions for s in llm.last_stats) > 0, "the pool was meant to force preemptions"
    assert_greedy_parity(model_dir, prompts, ours)
    assert llm.engine.core.scheduler.kv.num_free_blocks == llm.engine.core.scheduler.kv.pool.num_blocks


def test_greedy_parity_llama3_rope_scaling(tiny_model_factory) -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    model_dir = tiny_model_factory("llama", seed=5, rope_parameters=rope)
    llm = LLM(str(model_dir), dtype="float32")
    prompts = _prompts(seed=4)
    assert_greedy_parity(model_dir, prompts, run(llm, prompts))


def test_greedy_parity_mistral_tied_embeddings(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("mistral", seed=6, tie_word_embeddings=True)
    llm = LLM(str(model_dir), dtype="float32")
    prompts = _prompts(seed=5)
    assert_greedy_parity(model_dir, prompts, run(llm, prompts))


def test_ngram_speculation_is_lossless(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama")
    # Repetitive prompts give the n-gram proposer material to draft from.
    base = _prompts(seed=7)
    prompts = [p + p[:20] + p for p in base[:6]]
    plain = run(LLM(str(model_dir), dtype="float32"), prompts)
    spec_llm = LLM(str(model_dir), dtype="float32", speculative_config={"method": "ngram",
                                                                         "num_speculative_tokens": 3,
                                                                         "disable_by_batch_size": None})
    speculative = run(spec_llm, prompts)
    drafts = [s.spec_decoding for s in spec_llm.last_stats if s.spec_decoding is not None]
    assert sum(d.num_draft_tokens for d in drafts) > 0, "the proposer never drafted"
    assert speculative == plain


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7],
            "long_factor": [1.0, 1.3, 1.8, 2.5, 3.5, 5.0, 7.0, 9.0]}


def test_phi3_longrope_equals_transformers_in_both_regimes(tiny_model_factory) -> None:
    """LongRoPE (Phi-3 128k, Phi-3.5; here an original context of 64 in 512): an engine whose max_model_len fits
    the original context takes the short factors and equals transformers on every sequence; a longer one takes the
    long factors and equals transformers on prompts longer than the original context (where transformers takes
    them too); the two sets give other tokens."""
    model_dir = tiny_model_factory("phi3", seed=9, rope_parameters=LONGROPE, original_max_position_embeddings=64)
    short_prompts = _prompts(seed=21)[:6]  # up to 33 tokens, + 24 generated: within 64
    short = LLM(str(model_dir), dtype="float32", max_model_len=64)
    short_tokens = run(short, short_prompts)
    assert_greedy_parity(model_dir, short_prompts, short_tokens)
    long = LLM(str(model_dir), dtype="float32")
    long_prompts = _prompts(seed=22, shared_prefix=70)  # 73 to 191 tokens: past the original context
    assert_greedy_parity(model_dir, long_prompts, run(long, long_prompts))
    assert run(long, short_prompts) != short_tokens


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0},
                                  {**LONGROPE, "short_factor": LONGROPE["short_factor"][::2],
                                   "long_factor": LONGROPE["long_factor"][::2]}], ids=["default", "longrope"])
def test_phi4_minis_partial_rotary_embedding_equals_transformers(tiny_model_factory, rope: dict) -> None:
    """Phi-4-mini turns the first 3/4 of each head's dimensions (here half: 8 of 16) and passes the rest through,
    with LongRoPE's factors over those it turns; greedy output equals transformers' (past LongRoPE's original
    context, where both take the long factors), and the untouched dimensions matter."""
    partial = {**rope, "partial_rotary_factor": 0.5}
    model_dir = tiny_model_factory("phi3", seed=8, rope_parameters=partial, original_max_position_embeddings=64)
    prompts = _prompts(seed=23, shared_prefix=70) if rope["rope_type"] == "longrope" else _prompts(seed=23)
    tokens = run(LLM(str(model_dir), dtype="float32"), prompts)
    assert_greedy_parity(model_dir, prompts, tokens)
    if rope["rope_type"] == "default":
        whole = tiny_model_factory("phi3", seed=8, rope_parameters=rope, original_max_position_embeddings=64)
        assert run(LLM(str(whole), dtype="float32"), prompts) != tokens


def test_a_partial_rotary_factor_that_turns_no_whole_pairs_is_refused(tiny_model_factory) -> None:
    partial = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.3125}
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.3125 gives 5 rotated dimensions of each head's "
                                         r"16; it must give an even number from 2 to 16"):
        LLM(str(tiny_model_factory("phi3", seed=8, rope_parameters=partial)), dtype="float32")
