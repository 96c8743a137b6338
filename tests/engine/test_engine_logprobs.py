"""Per-token logprobs end to end: values against transformers' raw logits, ranks, top-k, cumulative sums, mixed
batches, validation, AsyncLLM deltas (over the wire) and n-gram speculation.

Every value must equal ``torch.log_softmax`` of transformers' logits for the same prefix within 1e-4 (float32),
whatever the sampling settings (the values describe the model, not the sampler).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.config import CacheConfig, EngineConfig, SchedulerConfig
from pagellm.engine.async_engine import AsyncLLM
from pagellm.outputs import CompletionOutput
from pagellm.request import Request
from pagellm.sampling_params import RequestOutputKind
from pagellm.sched.output import ModelRunnerOutput, TokenLogprobs
from pagellm.sched.scheduler import Scheduler

TOL = 1e-4
MAX_TOKENS = 12


def _prompts(seed: int, lens: tuple[int, ...] = (3, 9, 17, 33)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]


_HF: dict[str, transformers.PreTrainedModel] = {}


def hf_logprobs(model_dir: Path, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V] log_softmax of transformers' logits for each generated token's prefix."""
    if str(model_dir) not in _HF:
        _HF[str(model_dir)] = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = _HF[str(model_dir)](ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) + len(generated) - 1], dim=-1)


def check_against_hf(model_dir: Path, prompt: list[int], out: CompletionOutput, k: int,
                     greedy: bool) -> list[int]:
    """Assert every entry of ``out.logprobs`` against transformers; returns the sampled tokens' ranks."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    ref = hf_logprobs(model_dir, prompt, out.token_ids)
    ranks = []
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[step]
        top_values, top_ids = row.topk(k)
        assert list(entry)[:k] == top_ids.tolist(), f"step {step}: top-{k} ids differ"
        for rank, (tid, value) in enumerate(zip(top_ids.tolist(), top_values.tolist()), start=1):
            assert entry[tid].rank == rank
            assert abs(entry[tid].logprob - value) < TOL
        assert len(entry) == k + (token not in top_ids.tolist())
        sampled = entry[token]
        assert abs(sampled.logprob - row[token].item()) < TOL
        value = row[token].item()
        lo, hi = 1 + int((row > value + TOL).sum()), 1 + int((row > value - TOL).sum())
        assert lo <= sampled.rank <= hi, f"step {step}: rank {sampled.rank} not in [{lo}, {hi}]"
        if greedy:
            assert sampled.rank == 1
        ranks.append(sampled.rank)
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)),
                                                   abs=1e-5)
    return ranks


def assert_same_logprobs(x: CompletionOutput, y: CompletionOutput) -> None:
    """Same ids, ranks and token texts in the same order; values within TOL (batching may differ)."""
    assert x.logprobs is not None and y.logprobs is not None and len(x.logprobs) == len(y.logprobs)
    for ex, ey in zip(x.logprobs, y.logprobs):
        assert list(ex) == list(ey)
        for t in ex:
            assert abs(ex[t].logprob - ey[t].logprob) < TOL
            assert (ex[t].rank, ex[t].decoded_token) == (ey[t].rank, ey[t].decoded_token)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=40)


def test_greedy_logprobs_match_transformers(llm: LLM, tiny_llama: Path) -> None:
    prompts = _prompts(seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        check_against_hf(tiny_llama, prompt, output.outputs[0], k=5, greedy=True)


def test_sampled_logprobs_are_raw_and_ranked(llm: LLM, tiny_llama: Path) -> None:
    prompts = _prompts(seed=12)
    # Temperature, top-k and min_tokens (which bans EOS) must not change the reported values.
    params = SamplingParams(temperature=1.7, top_k=100, seed=7, min_tokens=4, max_tokens=MAX_TOKENS,
                            ignore_eos=True, logprobs=3)
    ranks = []
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ranks += check_against_hf(tiny_llama, prompt, output.outputs[0], k=3, greedy=False)
    assert max(ranks) > 1, "hot sampling never picked a less likely token; the rank check is vacuous"


def test_logprobs_zero_returns_only_the_sampled_token(llm: LLM, tiny_llama: Path) -> None:
    prompt = _prompts(seed=13)[1]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None
    assert [list(entry) for entry in out.logprobs] == [[t] for t in out.token_ids]
    check_against_hf(tiny_llama, prompt, out, k=0, greedy=False)


def test_mixed_batch_only_askers_get_logprobs(llm: LLM, tiny_llama: Path) -> None:
    prompts = _prompts(seed=14)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=1, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=20),
              SamplingParams(temperature=0.9, seed=2, max_tokens=MAX_TOKENS, ignore_eos=True)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, param, output in zip(prompts, params, outputs):
        out = output.outputs[0]
        if param.logprobs is None:
            assert out.logprobs is None and out.cumulative_logprob is None
        else:
            check_against_hf(tiny_llama, prompt, out, k=param.logprobs, greedy=param.is_greedy)
    plain = llm.generate(prompts, [msgspec.structs.replace(p, logprobs=None) for p in params], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_invalid_logprobs_raise(value: object) -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="an integer >= 0"):
        SamplingParams(logprobs=-1)


def test_logprobs_cap(tiny_llama: Path) -> None:
    """More logprobs than the engine's max_logprobs (20 by default) is refused, naming the cap and the flag; the
    cap is the engine's to raise, up to the whole vocabulary (-1)."""
    SamplingParams(logprobs=20, prompt_logprobs=20).check_logprobs(20)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{field}=21 .*max_logprobs \(20\).*--max-logprobs 21"):
            SamplingParams(**{field: 21}).check_logprobs(20)
    llm = LLM(str(tiny_llama), dtype="float32", max_logprobs=-1, max_model_len=64)
    prompt = _prompts(5, (6,))[0]
    everything = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=320, prompt_logprobs=320)
    out = llm.generate([prompt], everything, use_tqdm=False)[0]
    check_against_hf(tiny_llama, prompt, out.outputs[0], k=320, greedy=True)
    assert [len(entry) for entry in out.prompt_logprobs[1:]] == [320] * (len(prompt) - 1)
    with pytest.raises(ValueError, match=r"logprobs=321 .*max_logprobs \(320\)"):
        llm.generate([prompt], msgspec.structs.replace(everything, logprobs=321), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs must be >= 0, or -1"):
        LLM(str(tiny_llama), max_logprobs=-2)


def test_token_logprobs_head_cuts_every_list() -> None:
    lp = TokenLogprobs([-0.1, -0.2, -0.3], [1, 2, 3], [[1], [2], [3]], [[-0.1], [-0.2], [-0.3]])
    assert lp.head(5) is lp
    assert lp.head(2) == TokenLogprobs([-0.1, -0.2], [1, 2], [[1], [2]], [[-0.1], [-0.2]])


def test_scheduler_cuts_logprobs_with_the_accepted_tokens() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=4), 16, 64, 3)
    sched.add_request(Request("A", list(range(100, 107)), SamplingParams(max_tokens=3, logprobs=1),
                              eos_token_ids=frozenset(), arrival_time=0.0))

    def lp(n: int) -> TokenLogprobs:
        return TokenLogprobs([-float(i) for i in range(n)], [1] * n, [[i] for i in range(n)], [[0.0]] * n)

    out = sched.schedule()
    first = sched.update_from_output(out, ModelRunnerOutput.from_rows(["A"], [[50]], {"A": [11, 12, 13]},
                                                                      {"A": lp(1)}))
    assert first.logprobs == {"A": lp(1)}
    out = sched.schedule()
    assert out.spec_token_ids == {"A": [11, 12, 13]}
    # All three drafts are accepted, but max_tokens=3 keeps only two of the four tokens.
    last = sched.update_from_output(out, ModelRunnerOutput.from_rows(["A"], [[11, 12, 13, 80]], {}, {"A": lp(4)}))
    assert last.req_ids == ["A"] and last.new_token_ids == [11, 12] and "A" in last.finish_reasons
    assert last.logprobs == {"A": lp(2)}


def _spec_prompts() -> list[list[int]]:
    return [p + p[:20] + p for p in _prompts(seed=15, lens=(16, 31, 48))]


def test_ngram_speculation_gives_the_same_logprobs(llm: LLM, tiny_llama: Path) -> None:
    prompts = _spec_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=4)
    plain = llm.generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(str(tiny_llama), dtype="float32",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    speculative = spec_llm.generate(prompts, params, use_tqdm=False)
    drafts = [s.spec_decoding for s in spec_llm.last_stats if s.spec_decoding is not None]
    assert sum(d.num_accepted_tokens for d in drafts) > 0, "no draft was accepted; nothing was tested"
    for a, b in zip(plain, speculative):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        assert x.logprobs is not None and y.logprobs is not None
        assert_same_logprobs(x, y)
    # A stop token that cuts a run of accepted drafts must cut their logprobs with them.
    stop = speculative[0].outputs[0].token_ids[6]
    cut = spec_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1,
                                                    stop_token_ids=[stop]), use_tqdm=False)
    for output in cut:
        out = output.outputs[0]
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)


def test_async_deltas_concatenate_to_the_full_lists(llm: LLM, tiny_llama: Path) -> None:
    prompts = _prompts(seed=16, lens=(5, 21))
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3,
                            output_kind=RequestOutputKind.DELTA)
    offline = llm.generate(prompts, params, use_tqdm=False)

    async def stream(engine: AsyncLLM, prompt: list[int], request_id: str) -> CompletionOutput:
        total = CompletionOutput(0, "", [], logprobs=[])
        async for delta in engine.generate(prompt, params, request_id):
            out = delta.outputs[0]
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
            total.token_ids += out.token_ids
            total.logprobs += out.logprobs  # type: ignore[operator]
            total.cumulative_logprob = out.cumulative_logprob
        return total

    async def main(engine: AsyncLLM) -> list[CompletionOutput]:
        return await asyncio.gather(*(stream(engine, p, f"r{i}") for i, p in enumerate(prompts)))

    engine = AsyncLLM.from_config(EngineConfig.from_kwargs(model=str(tiny_llama), dtype="float32"))
    try:
        streamed = asyncio.run(asyncio.wait_for(main(engine), 60))
    finally:
        engine.shutdown()
    for full, got in zip(offline, streamed):
        want = full.outputs[0]
        assert got.token_ids == want.token_ids
        assert_same_logprobs(got, want)
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-5)


def test_logprob_token_ids_give_those_tokens_values_and_ranks(llm: LLM, tiny_llama: Path) -> None:
    """vLLM's ``logprob_token_ids``: at each position the sampled token, then exactly the tokens asked (in that
    order, each once), their values and ranks transformers', beside top-k requests in the same batch and under
    speculation; it implies logprobs, and more than 128 ids or one outside the vocabulary is refused."""
    prompts = _spec_prompts()
    asked = [7, 200, 3, 7, 151]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprob_token_ids=asked),
              SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3,
                             logprob_token_ids=asked),  # the ids win over the top-k
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(str(tiny_llama), dtype="float32",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    speculative = spec_llm.generate(prompts[:1], params[:1], use_tqdm=False)[0].outputs[0]
    assert sum(s.spec_decoding.num_accepted_tokens for s in spec_llm.last_stats if s.spec_decoding) > 0
    check_against_hf(tiny_llama, prompts[2], outputs[2].outputs[0], k=2, greedy=True)
    for prompt, output in zip(prompts, outputs[:2]):
        out = output.outputs[0]
        ref = hf_logprobs(tiny_llama, prompt, out.token_ids)
        for row, token, entry in zip(ref, out.token_ids, out.logprobs):
            assert list(entry) == [token] + [t for t in [7, 200, 3, 151] if t != token]
            for tid, lp in entry.items():
                assert abs(lp.logprob - row[tid].item()) < TOL
                assert lp.rank == 1 + int((row > row[tid]).sum())
    assert_same_logprobs(outputs[0].outputs[0], speculative)
    with pytest.raises(ValueError, match="logprob_token_ids names 129 tokens; at most 128"):
        SamplingParams(logprob_token_ids=list(range(129)))
    with pytest.raises(ValueError, match=r"logprob_token_ids: token ids must be in \[0, 320\)"):
        llm.generate([[1, 2]], SamplingParams(logprob_token_ids=[5, 320]), use_tqdm=False)
