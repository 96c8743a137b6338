"""EAGLE end to end on the tiny random Llama: a head trained for a few steps with the train-draft pipeline loads
from its file, greedy output is token-identical with and without it, sampled requests run to completion with
their draft distributions verified, no KV block leaks, and a missing or mismatched head file is a ValueError."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import SpeculativeConfig
from tests.engine.test_spec_decode import GREEDY, SMALL_KV, _drafted, _prompts, _run, assert_no_leaks


@pytest.fixture(scope="module")
def eagle_file(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An EAGLE head trained for the tiny model with the train-draft pipeline (a few steps, tiny prompts)."""
    from pagellm.spec.train import frozen_target, generate_sequences, hidden_states, train_eagle

    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV)
    codes = ["def add(a, b):\n    ", "for i in range(10):\n", "hello there, how are you?"]
    sequences = generate_sequences(llm, [[{"role": "user", "content": "hi"}]], codes, max_tokens=24)
    hidden, tokens = hidden_states(tiny_llama, sequences)
    target = frozen_target(llm.engine.core.executor.worker.runner.model)
    head, losses = train_eagle(hidden, tokens, target, steps=30, batch=4, lr=3e-3, seed=0, window=16)
    assert losses[-1] < losses[0]
    path = tmp_path_factory.mktemp("eagle") / "eagle.safetensors"
    head.save(path, {"command": "test"})
    return path


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV)


@pytest.mark.parametrize("tree", [None, [2, 2, 1]], ids=["chain", "tree"])
def test_eagle_greedy_identical_and_sampled_runs(tiny_llama: Path, plain: LLM, eagle_file: Path, tree) -> None:
    prompts = _prompts(6, n=4)
    expected = _run(plain, prompts, GREEDY)
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(eagle_file), "tree": tree}
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV, speculative_config=spec)
    assert _run(llm, prompts, GREEDY) == expected
    drafted, accepted = _drafted(llm)
    assert drafted > 0 and 0 <= accepted <= drafted
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)
    first = _run(llm, prompts, sampled)
    assert all(len(t) == 12 for t in first)
    assert _run(llm, prompts, sampled) == first  # seeded requests reproduce, drafts or not
    assert_no_leaks(llm)
    runner = llm.engine.core.executor.worker.runner
    assert set(runner.proposer.history) <= set(runner.states)  # finished requests' windows were released


def test_eagle_window_follows_accepted_tokens(tiny_llama: Path, eagle_file: Path) -> None:
    """The proposer's per-request window keeps only pairs whose token is still the request's token there."""
    from pagellm.spec.base import ProposalRequest
    from pagellm.spec.eagle import EagleProposer

    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV)
    target = llm.engine.core.executor.worker.runner.model
    proposer = EagleProposer.from_config(
        SpeculativeConfig(method="eagle", num_speculative_tokens=2, model=str(eagle_file)), target, torch.float32)
    h = torch.zeros(target.cfg.hidden_size)
    ask = lambda toks: ProposalRequest("r", toks, GREEDY, 0, 2, h)  # noqa: E731
    assert len(proposer.propose([ask([1, 2, 3])])[0].tokens) == 2
    proposer.propose([ask([1, 2, 3, 4, 5])])
    assert [(p, t) for p, t, _ in proposer.history["r"]] == [(2, 3), (4, 5)]
    proposer.propose([ask([1, 2, 9, 4])])   # position 2 changed (preempted and resampled): its pair goes
    assert [(p, t) for p, t, _ in proposer.history["r"]] == [(3, 4)]
    proposer.release(["r"])
    assert proposer.history == {}


def test_eagle_tree_children_are_the_heads_top_candidates(tiny_llama: Path, eagle_file: Path) -> None:
    """Tree nodes come breadth-first in static_tree's numbering; each node's children are the head's best
    candidates after that node's own path, so the first-ranked path equals the greedy chain."""
    from pagellm.spec.base import ProposalRequest
    from pagellm.spec.eagle import EagleProposer
    from pagellm.spec.tree import static_tree

    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV)
    target = llm.engine.core.executor.worker.runner.model
    head = EagleProposer.from_config(
        SpeculativeConfig(method="eagle", num_speculative_tokens=3, model=str(eagle_file)), target,
        torch.float32).head
    h = torch.randn(target.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ask = ProposalRequest("r", [5, 6, 7, 8], GREEDY, 0, 20, h)
    chain = EagleProposer(head, target, 3).propose([ask])[0]
    tree = EagleProposer(head, target, 3, [2, 2, 1]).propose([ask])[0]
    assert tree.parents == static_tree([2, 2, 1]) and len(tree.tokens) == 10
    assert [tree.tokens[0], tree.tokens[2], tree.tokens[6]] == chain.tokens  # rank-0 path: nodes 0, 2, 6
    assert tree.tokens[0] != tree.tokens[1]


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
                 "--chat-prompts", "1", "--code-prompts", "2", "--max-tokens", "12", "--steps", "5",
                 "--batch", "2"]) == 0
    assert out.with_suffix(".png").stat().st_size > 0
    meta = describe(out)
    assert meta["method"] == "eagle" and "--method eagle" in meta["command"]
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
              speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": str(out)})
    assert len(_run(llm, [[1, 2, 3, 4]], GREEDY)[0]) == GREEDY.max_tokens


def test_trained_head_is_accepted_on_its_training_prompts(tiny_llama: Path) -> None:
    """Training and drafting agree on the head's inputs: a head trained on the target's own continuations has
    its drafts accepted on those prompts (an untrained head is accepted about never), output still identical."""
    from pagellm.spec.train import frozen_target, generate_sequences, hidden_states, train_eagle

    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV)
    codes = ["def add(a, b):\n    ", "for i in range(10):\n", "hello there, how are you?", "import os\n"]
    sequences = generate_sequences(llm, [], codes, max_tokens=40)
    hidden, tokens = hidden_states(tiny_llama, sequences)
    head, _ = train_eagle(hidden, tokens, frozen_target(llm.engine.core.executor.worker.runner.model), steps=200,
                          batch=4, lr=3e-3, seed=0, window=16)
    path = tiny_llama.parent / "trained-eagle.safetensors"
    head.save(path)
    spec = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
               speculative_config={"method": "eagle", "num_speculative_tokens": 3, "model": str(path)})
    params = SamplingParams(temperature=0.0, max_tokens=40)
    outs = spec.generate(codes, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [seq[n:] for seq, n in sequences]
    stats = [s.spec_decoding for s in spec.last_stats if s.spec_decoding is not None]
    drafts, accepted = sum(s.num_drafts for s in stats), sum(s.num_accepted_tokens for s in stats)
    assert 1 + accepted / drafts >= 2.0, (drafts, accepted)


def test_segment_attention_matches_each_segment_alone() -> None:
    """Batched padded segments give each segment exactly its own causal attention (float64 reference)."""
    from pagellm.spec.eagle import segment_attention

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
