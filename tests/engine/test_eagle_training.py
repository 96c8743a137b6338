"""EAGLE heads as files and as training makes them: missing or mismatched head files are ValueErrors naming the
fix; ``pagellm train-draft --method eagle`` writes a loadable head; a head trained on the tiny target's own
continuations is accepted on them; the attention helpers of drafting and training match float64 references; the
shipped head for the built-in model is accepted on held-out HumanEval prompts (the real model in float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams
from tests.engine.test_eagle import _train
from tests.engine.test_spec_decode import GREEDY, SMALL_KV, _run


def test_eagle_file_errors(tiny_llama: Path, tmp_path: Path) -> None:
    from pagellm.spec.medusa import MedusaHeads

    with pytest.raises(ValueError, match="train-draft --method eagle"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
            speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path / "no")})
    medusa = tmp_path / "medusa.safetensors"
    MedusaHeads(64, 2).save(medusa)
    with pytest.raises(ValueError, match="not an EAGLE head.*train-draft --method eagle"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
            speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": str(medusa)})
    with pytest.raises(ValueError, match="eagle needs 'model'"):
        LLM(str(tiny_llama), speculative_config={"method": "eagle", "num_speculative_tokens": 2})


def test_train_draft_cli_writes_a_loadable_eagle_head(tiny_llama: Path, tmp_path: Path) -> None:
    from pagellm.cli import main
    from pagellm.spec.medusa import describe

    out = tmp_path / "head.safetensors"
    assert main(["train-draft", "--method", "eagle", "--model", str(tiny_llama), "--out", str(out),
                 "--dtype", "float32", "--chat-prompts", "1", "--code-prompts", "2", "--max-tokens", "12",
                 "--code-max-tokens", "16", "--code-samples", "1",
                 "--steps", "5", "--batch", "2", "--window", "8", "--draft-vocab-size", "100"]) == 0
    assert out.with_suffix(".png").stat().st_size > 0
    meta = describe(out)
    assert meta["method"] == "eagle" and "--method eagle" in meta["command"] and "--window 8" in meta["command"]
    assert meta["sequences"] == str(1 + 2 + 2)  # a chat, two greedy code continuations, one sample of each
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
              speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": str(out)})
    assert len(llm.engine.core.executor.worker.runner.proposer.vocab_rows) <= 100
    assert len(_run(llm, [[1, 2, 3, 4]], GREEDY)[0]) == GREEDY.max_tokens


def test_trained_head_is_accepted_on_its_training_prompts(tiny_llama: Path, tmp_path: Path) -> None:
    """Training and drafting agree on the head's inputs: a head trained on the target's own continuations has
    its drafts accepted on those prompts (an untrained head is accepted about never), output still identical."""
    codes = ["def add(a, b):\n    ", "for i in range(10):\n", "hello there, how are you?", "import os\n"]
    path = tmp_path / "trained-eagle.safetensors"
    sequences = _train(tiny_llama, path, codes, steps=200, unroll=1, max_tokens=40)
    spec = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
               speculative_config={"method": "eagle", "num_speculative_tokens": 3, "model": str(path)})
    outs = spec.generate(codes, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [s.tokens[s.prompt_len:] for s in sequences]
    stats = [s.spec_decoding for s in spec.last_stats if s.spec_decoding is not None]
    drafts, accepted = sum(s.num_drafts for s in stats), sum(s.num_accepted_tokens for s in stats)
    assert 1 + accepted / drafts >= 2.0, (drafts, accepted)


def test_segment_attention_matches_each_segment_alone() -> None:
    """Batched padded segments give each segment exactly its own causal attention (float64 reference)."""
    from pagellm.spec.eagle_head import segment_attention

    gen = torch.Generator().manual_seed(0)
    segments = [3, 1, 5]
    q, k, v = (torch.randn(9, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    out = segment_attention(q, k, v, segments, 0.5)
    start = 0
    for n in segments:
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
        scores = (qs @ ks.transpose(1, 2)) * 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(out[start:start + n], (scores.softmax(-1) @ vs).transpose(0, 1))
        start += n


def test_masked_attention_gives_each_query_its_own_rows() -> None:
    """Each draft query attends to exactly the cached rows its mask allows, every query head through its own kv
    head (grouped-query attention: head h reads kv head h // groups); float64 reference per query and head."""
    from pagellm.spec.eagle_head import masked_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 4, generator=gen, dtype=torch.float64)        # 3 queries, 6 heads over 2 kv heads
    k, v = (torch.randn(7, 2, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    rows = [[0, 1, 2], [0, 1, 2, 4], [5, 6]]                               # a window + ancestors, another plan
    mask = torch.zeros(3, 7, dtype=torch.bool)
    for i, allowed in enumerate(rows):
        mask[i, allowed] = True
    out = masked_attention(q, k, v, mask, 0.5)
    for i, allowed in enumerate(rows):
        for h in range(6):
            keys, values = k[allowed, h // 3], v[allowed, h // 3]
            weights = ((keys @ q[i, h]) * 0.5).softmax(-1)
            torch.testing.assert_close(out[i, h], weights @ values)


def test_unrolled_mask_attends_like_the_draft_depths() -> None:
    """Training pass k's row i sees the true pairs up to row i - k and one row of each later pass, ending
    with itself: what the k-th draft depth sees at inference."""
    from pagellm.spec.train_eagle import unrolled_mask

    mask = unrolled_mask(4, 3)
    allowed = lambda k, i: [(j, m) for j in range(3) for m in range(4) if mask[k, i, j * 4 + m]]  # noqa: E731
    assert allowed(0, 2) == [(0, 0), (0, 1), (0, 2)]
    assert allowed(1, 2) == [(0, 0), (0, 1), (1, 2)]
    assert allowed(2, 3) == [(0, 0), (0, 1), (1, 2), (2, 3)]


def test_shipped_head_is_accepted_on_held_out_code() -> None:
    """The head committed for the built-in model (found without a 'model' key) loads on the real SmolLM2-135M,
    keeps greedy output identical (float32) and is accepted on two held-out HumanEval prompts (problems 150
    and 151; training used the first 64) at a mean acceptance length of at least SHIPPED_MIN_ACCEPTANCE with the
    dynamic tree (measured when the head was trained: see docs/speculative.md)."""
    from pagellm.spec.train import code_prompts

    prompts = code_prompts(2, 150)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected = _run(LLM(dtype="float32"), prompts, params)
    llm = LLM(dtype="float32", speculative_config={"method": "eagle", "num_speculative_tokens": 5,
                                                   "eagle_topk": 4, "num_draft_tokens": 12})
    assert _run(llm, prompts, params) == expected
    stats = [s.spec_decoding for s in llm.last_stats if s.spec_decoding is not None]
    drafts, accepted = sum(s.num_drafts for s in stats), sum(s.num_accepted_tokens for s in stats)
    assert 1 + accepted / drafts >= SHIPPED_MIN_ACCEPTANCE, (drafts, accepted)


SHIPPED_MIN_ACCEPTANCE = 2.0
