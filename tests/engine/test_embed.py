"""Embeddings by last-token pooling (``LLM.embed``, ``SamplingParams.pooling``): the final hidden state of each
prompt's last token equals transformers' ``last_hidden_state`` in float32, whatever chunking, prefix-cache hits or
generation requests share its steps, and every KV block comes back; ``LLM.score`` is the cosine of two of them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams


def _reference(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 256, (33,), generator=gen).tolist()
    return [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 9, 30)] + [[7], shared[:20]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_embeddings_are_the_last_hidden_state_under_chunks_and_cache_hits(tiny_model_factory, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=16)  # prompts longer than a step: chunked
    prompts = _prompts()
    reference = _reference(model_dir, prompts)
    for run in range(2):  # the second run finds the prompts' blocks cached
        embeddings = llm.embed(prompts, use_tqdm=False)
        for out, ref, prompt in zip(embeddings, reference, prompts):
            assert out.prompt_token_ids == prompt and out.finished
            assert out.outputs.embedding is out.embedding and out.outputs.hidden_size == 64  # vLLM's shape too
            torch.testing.assert_close(torch.tensor(out.embedding), ref / ref.norm(), atol=2e-6, rtol=0)
        if run == 1:
            assert sum(e.num_cached_tokens for e in embeddings) > 0
    raw = llm.embed(prompts[:1], normalize=False, use_tqdm=False)[0].embedding
    torch.testing.assert_close(torch.tensor(raw), reference[0], atol=1e-5, rtol=1e-5)
    assert math.isclose(sum(x * x for x in llm.embed("some text", use_tqdm=False)[0].embedding), 1.0, rel_tol=1e-5)
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_embedding_and_generation_requests_share_steps(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=64)
    prompts = _prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    pooling = SamplingParams(max_tokens=1, temperature=0.0, pooling=True, detokenize=False)
    mixed = llm.generate(prompts + prompts, [greedy] * len(prompts) + [pooling] * len(prompts), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:len(prompts)]] == alone
    assert all(o.pooled is None for o in mixed[:len(prompts)])
    for out, ref in zip(mixed[len(prompts):], _reference(tiny_llama, prompts)):
        torch.testing.assert_close(torch.tensor(out.pooled), ref, atol=1e-5, rtol=1e-5)


def test_a_pooling_request_must_be_one_greedy_token() -> None:
    for bad in (dict(max_tokens=2), dict(max_tokens=1, n=2), dict(max_tokens=None)):
        with pytest.raises(ValueError, match="a pooling \\(embedding\\) request runs as one greedy token"):
            SamplingParams(pooling=True, **bad)


def test_a_base_model_checkpoint_serves_embeddings_only(tiny_qwen2: Path, tmp_path: Path) -> None:
    # What embedding models ship (e5-mistral's MistralModel, ...): the base model alone, no LM head, no "model." prefix.
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).model
    base.save_pretrained(tmp_path)
    transformers.AutoTokenizer.from_pretrained(tiny_qwen2).save_pretrained(tmp_path)
    assert transformers.AutoConfig.from_pretrained(tmp_path).architectures == ["Qwen2Model"]
    llm = LLM(str(tmp_path), dtype="float32")
    prompts = _prompts()
    for out, ref in zip(llm.embed(prompts, use_tqdm=False), _reference(tmp_path, prompts)):
        torch.testing.assert_close(torch.tensor(out.embedding), ref / ref.norm(), atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="no language-model head: it serves embeddings only"):
        llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)


def test_score_pairs_texts_and_takes_the_cosine_of_transformers_embeddings(tiny_llama: Path) -> None:
    """``LLM.score`` pairs 1–N and N–N (vLLM's rule) and each score is the cosine similarity of transformers'
    last-token hidden states of the two texts."""
    llm = LLM(str(tiny_llama), dtype="float32")
    texts = ["The cat sat.", "A dog ran far away.", "The cat sat on a mat."]
    ids = [llm.tokenizer.encode(t) for t in texts]
    ref = [torch.nn.functional.normalize(v, dim=0) for v in _reference(tiny_llama, ids)]
    one_to_many = llm.score(texts[0], texts, use_tqdm=False)
    assert [(o.index, o.text_1, o.text_2) for o in one_to_many] == [(i, texts[0], t) for i, t in enumerate(texts)]
    assert [o.outputs.score for o in one_to_many] == pytest.approx([float(ref[0] @ r) for r in ref], abs=1e-5)
    assert one_to_many[0].outputs.score == pytest.approx(1.0, abs=1e-5)
    pairwise = llm.score(texts[1:], texts[:2], use_tqdm=False)
    assert [o.outputs.score for o in pairwise] == pytest.approx([float(ref[1] @ ref[0]), float(ref[2] @ ref[1])],
                                                                abs=1e-5)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(texts[:2], texts)
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
