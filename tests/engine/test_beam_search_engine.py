"""``LLM.beam_search`` against a beam search written out here over transformers' float32 log-probabilities: the
same beams, in the same order, with the same cumulative log-probabilities; every KV block comes back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.beam_search import BeamSearchParams


def _reference(model: transformers.PreTrainedModel, prompt: list[int], width: int, max_tokens: int,
               eos: frozenset[int], length_penalty: float) -> list[tuple[list[int], float]]:
    live, finished = [(prompt, 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
            top = logprobs.topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                (finished if token in eos else candidates).append((tokens + [token], cum + value))
        candidates.sort(key=lambda c: c[1], reverse=True)
        live = candidates[:width]
        if not live:
            break

    def score(item: tuple[list[int], float, bool]) -> float:
        tokens, cum, ended = item
        return cum / ((len(tokens) - ended) ** length_penalty)

    pool = [(t, c, True) for t, c in finished] + [(t, c, False) for t, c in live]
    return [(t, c) for t, c, _ in sorted(pool, key=score, reverse=True)[:width]]


@pytest.mark.parametrize(("width", "length_penalty"), [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beams_equal_a_search_over_transformers_logprobs(tiny_model_factory, width: int,
                                                         length_penalty: float) -> None:
    model_dir: Path = tiny_model_factory("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=64)
    eos = llm.tokenizer.eos_token_ids
    gen = torch.Generator().manual_seed(width)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (4, 19)]
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty)
    outputs = llm.beam_search(prompts, params)
    for prompt, output in zip(prompts, outputs):
        want = _reference(hf, prompt, width, 6, eos, length_penalty)
        assert [b.tokens for b in output.sequences] == [t for t, _ in want]
        for beam, (_, cum) in zip(output.sequences, want):
            assert beam.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert beam.num_prompt_tokens == len(prompt) and len(beam.output_token_ids) <= 6
            assert beam.text == llm.tokenizer.decode(beam.output_token_ids[:-1] if beam.finish_reason == "stop"
                                                     else beam.output_token_ids, skip_special_tokens=False)
    if width == 1:  # one beam that never ends early is greedy decoding
        one = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert [o.sequences[0].output_token_ids for o in one] == [g.outputs[0].token_ids for g in greedy]
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_beams_stop_at_the_context_length_and_a_prompt_that_fills_it_is_refused(tiny_model_factory) -> None:
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", max_model_len=32)
    out = llm.beam_search([list(range(1, 29))], BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True))
    assert [len(b.tokens) for b in out[0].sequences] == [32, 32]  # 28 prompt tokens + 4 steps
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([list(range(1, 33))], BeamSearchParams(beam_width=2, max_tokens=4))
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
