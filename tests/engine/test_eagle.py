"""EAGLE end to end on the tiny random Llama: heads trained with the train-draft pipeline load from their files;
greedy output is token-identical with and without them (chain, static tree, EAGLE-2 dynamic tree; under
preemption and prefix-cache hits); the runner hands the proposer every accepted row's hidden state; drafting with
cached keys/values equals recomputing the layer; sampled requests run with their draft distributions verified;
no KV block leaks. Head files, training and the shipped head: ``test_eagle_training.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagellm import LLM, SamplingParams
from pagellm.config import SpeculativeConfig
from pagellm.spec.base import ProposalRequest
from pagellm.spec.eagle import EagleProposer
from pagellm.spec.tree import best_subtree, depths
from tests.engine.test_spec_decode import ANY_BATCH, GREEDY, SMALL_KV, _drafted, _prompts, _run, assert_no_leaks

SHAPES = {
    "chain": {"num_speculative_tokens": 3},
    "tree": {"num_speculative_tokens": 3, "tree": [2, 2, 1]},
    "dynamic": {"num_speculative_tokens": 3, "eagle_topk": 2, "num_draft_tokens": 5},
    "dynamic+lookup": {"num_speculative_tokens": 3, "eagle_topk": 2, "num_draft_tokens": 5,
                       "prompt_lookup_tokens": 3, "prompt_lookup_min": 1},
}


def _train(tiny_llama: Path, path: Path, prompts: list, steps: int, unroll: int, max_tokens: int = 24) -> list:
    """Train a head on the tiny target's own continuations of ``prompts``; returns the sequences."""
    from pagellm.spec.train import frozen_target, generate_sequences, training_llm
    from pagellm.spec.train_eagle import EagleRecipe, train_eagle

    llm = training_llm(str(tiny_llama), "float32", kv_cache_memory=SMALL_KV)
    sequences = generate_sequences(llm, [], prompts, max_tokens=max_tokens)
    target = frozen_target(llm.engine.core.executor.worker.runner.model)
    head, losses = train_eagle(sequences, target, EagleRecipe(steps=steps, batch=4, lr=3e-3, window=16,
                                                              unroll=unroll))
    assert losses[-1] < losses[0]
    head.save(path, {"command": "test"})
    return sequences


@pytest.fixture(scope="module")
def eagle_file(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head trained (80 steps, two unrolled passes) on the tiny target's continuations of the test prompts,
    so that its drafts are often accepted and every code path of verification runs."""
    path = tmp_path_factory.mktemp("eagle") / "eagle.safetensors"
    _train(tiny_llama, path, _prompts(6, n=4) + _prompts(7, n=4), steps=80, unroll=2, max_tokens=32)
    return path


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV)


def _proposer(tiny_llama: Path, eagle_file: Path, **spec) -> tuple[EagleProposer, torch.nn.Module]:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV)
    target = llm.engine.core.executor.worker.runner.model
    config = SpeculativeConfig(method="eagle", model=str(eagle_file), **{"num_speculative_tokens": 3, **spec})
    return EagleProposer.from_config(config, target, torch.float32), target


@pytest.mark.parametrize("shape", list(SHAPES))
def test_eagle_greedy_identical_with_prefix_hits_and_sampled_runs(tiny_llama: Path, plain: LLM, eagle_file: Path,
                                                                  shape: str) -> None:
    prompts = _prompts(6, n=4)
    expected = _run(plain, prompts, GREEDY)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
              speculative_config={"method": "eagle", "model": str(eagle_file), **SHAPES[shape], **ANY_BATCH})
    assert _run(llm, prompts, GREEDY) == expected
    drafted, accepted = _drafted(llm)
    assert drafted > 0 and accepted > 0
    assert _run(llm, prompts, GREEDY) == expected  # again, now from prefix-cache hits
    assert sum(s.prefix_cache_hits for s in llm.last_stats) > 0
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)
    first = _run(llm, prompts, sampled)
    assert all(len(t) == 12 for t in first)
    assert _run(llm, prompts, sampled) == first  # seeded requests reproduce, drafts or not
    assert_no_leaks(llm)
    runner = llm.engine.core.executor.worker.runner
    assert set(runner.proposer.windows) <= set(runner.states)  # finished requests' windows were released


@pytest.mark.parametrize("shape", list(SHAPES))
def test_eagle_greedy_identical_under_preemption(tiny_llama: Path, plain: LLM, eagle_file: Path,
                                                                  shape: str) -> None:
    prompts = _prompts(7)
    expected = _run(plain, prompts, GREEDY)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV // 8, max_num_seqs=6,
              speculative_config={"method": "eagle", "model": str(eagle_file), **SHAPES[shape], **ANY_BATCH})
    assert _run(llm, prompts, GREEDY) == expected
    assert sum(s.num_preemptions for s in llm.last_stats) > 0, "the pool was meant to force preemptions"
    assert _drafted(llm)[1] > 0
    assert_no_leaks(llm)


class _Spy:
    """Wraps a proposer and records what each request was handed: (token ids, hidden rows)."""

    def __init__(self, inner: EagleProposer) -> None:
        self.inner = inner
        self.num_lookahead_tokens = inner.num_lookahead_tokens
        self.calls: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def propose(self, requests):  # noqa: ANN001, ANN201
        for r in requests:
            self.calls.setdefault(r.req_id, []).append((len(r.token_ids), r.hidden.clone()))
        return self.inner.propose(requests)

    def release(self, req_ids) -> None:  # noqa: ANN001
        self.inner.release(req_ids)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_runner_hands_every_accepted_row_to_the_proposer(tiny_llama: Path, eagle_file: Path, shape: str) -> None:
    """Across a request's steps the proposer sees the target's hidden state at every position exactly as a plain
    run computes it: prompt rows, roots and accepted drafts (fails if only the newest row is handed over, since
    accepted drafts would leave gaps, or if a tree's path rows are taken from the wrong nodes)."""
    from pagellm.spec.train import training_llm

    prompts = _prompts(6, n=4)
    reference = training_llm(str(tiny_llama), "float32", kv_cache_memory=SMALL_KV)
    recorder = reference.engine.core.executor.worker.runner.proposer
    truth = {}
    for o in reference.generate(prompts, GREEDY, use_tqdm=False):
        length = len(o.prompt_token_ids) + len(o.outputs[0].token_ids)
        truth[tuple(o.prompt_token_ids)] = recorder.states(o.request_id, length - 1)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV,
              speculative_config={"method": "eagle", "model": str(eagle_file), **SHAPES[shape], **ANY_BATCH})
    runner = llm.engine.core.executor.worker.runner
    spy = runner.proposer = _Spy(runner.proposer)
    multi_row_steps = 0
    for o in llm.generate(prompts, GREEDY, use_tqdm=False):
        states = truth[tuple(o.prompt_token_ids)]
        seen = torch.zeros(len(states), dtype=torch.bool)
        for step, (length, rows) in enumerate(spy.calls[o.request_id]):
            first = length - 1 - len(rows)
            end = min(length - 1, len(states))  # the last step may accept drafts past max_tokens (cut later)
            torch.testing.assert_close(rows[:end - first], states[first:end], atol=1e-4, rtol=1e-4)
            seen[first:end] = True
            multi_row_steps += step > 0 and len(rows) > 1
        assert bool(seen.all())
    assert multi_row_steps > 0, "no step accepted a draft: the test would not see the accepted rows"


def _reference_draft(proposer: EagleProposer, target: torch.nn.Module, tokens: list[int], hidden: torch.Tensor,
                     topk: int, budget: int) -> tuple[list[int], list[int]]:
    """EAGLE-2 by brute force: every node's output recomputed with ``EagleHead.forward`` (the plain twin) over
    the window's true pairs plus the node's path. topk 1 is the greedy chain."""
    head, lm = proposer.head, target.lm_head.plain_weight()
    vocab = head.draft_vocab if head.draft_vocab is not None else torch.arange(lm.shape[0])
    n = len(hidden)
    base = [(len(tokens) - n + i, tokens[len(tokens) - n + i], hidden[i]) for i in range(n)]

    def output(path: list) -> tuple[torch.Tensor, torch.Tensor]:
        rows = base + path
        embeds = target.model.embed_tokens(torch.tensor([r[1] for r in rows]))
        y = head(embeds, torch.stack([r[2] for r in rows]), torch.tensor([r[0] for r in rows]), [len(rows)])
        predicted = target.model.norm.forward_torch(y[-1:])[0][0]
        return predicted, torch.log_softmax(F.linear(predicted, lm[vocab]).float(), dim=-1)

    nodes: list[tuple[int, int, float, list]] = []   # token, parent, score, path rows (its own included)
    frontier: list[tuple[int, list]] = [(-1, [])]
    for depth in range(1, proposer.k + 1):
        new = []
        for parent, path in frontier:
            predicted, logp = output(path)
            values, index = logp.topk(topk)
            for value, i in zip(values.tolist(), index.tolist()):
                base_score = nodes[parent][2] if parent >= 0 else 0.0
                token = int(vocab[i])
                nodes.append((token, parent, base_score + value, path + [(len(tokens) - 1 + depth, token,
                                                                          predicted)]))
                new.append(len(nodes) - 1)
        new.sort(key=lambda m: (-nodes[m][2], m))
        frontier = [(m, nodes[m][3]) for m in new[:topk]]
    order = best_subtree([nd[1] for nd in nodes], [nd[2] for nd in nodes], budget)
    renumber = {old: new for new, old in enumerate(order)}
    return [nodes[i][0] for i in order], [renumber[nodes[i][1]] if nodes[i][1] >= 0 else -1 for i in order]


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_cached_drafting_matches_recomputing_the_layer(tiny_llama: Path, eagle_file: Path, shape: str) -> None:
    """The proposer attends over cached window k/v plus each node's ancestors; the twin recomputes the layer over
    window + path for every node. Same tokens, same tree. Also across two steps (the window carried over)."""
    spec = {"eagle_topk": 3, "num_draft_tokens": 7} if shape == "dynamic" else {}
    proposer, target = _proposer(tiny_llama, eagle_file, **spec)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (12,), generator=gen).tolist()
    hidden = torch.randn(11, target.cfg.hidden_size, generator=gen)
    topk, budget = (3, 7) if shape == "dynamic" else (1, 3)
    for cut in (8, 12):  # a prefill of 8 tokens, then 4 more positions accepted at once
        rows = hidden[:cut - 1] if cut == 8 else hidden[7:11]
        draft = proposer.propose([ProposalRequest("r", tokens[:cut], GREEDY, 0, 20, rows)])[0]
        want_tokens, want_parents = _reference_draft(proposer, target, tokens[:cut], hidden[:cut - 1], topk, budget)
        assert draft.tokens == want_tokens
        assert (draft.parents or list(range(-1, len(draft.tokens) - 1))) == want_parents


def test_dynamic_tree_shape(tiny_llama: Path, eagle_file: Path) -> None:
    """The dynamic tree keeps num_draft_tokens nodes in a valid breadth-first topology (parents first, siblings
    distinct), at most num_speculative_tokens deep; a request with logprobs gets the chain."""
    proposer, target = _proposer(tiny_llama, eagle_file, num_speculative_tokens=4, eagle_topk=3,
                                 num_draft_tokens=9)
    assert proposer.num_lookahead_tokens == 9
    h = torch.randn(4, target.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    draft = proposer.propose([ProposalRequest("r", [5, 6, 7, 8, 9], GREEDY, 0, 9, h)])[0]
    assert len(draft.tokens) == 9 and len(draft.parents) == 9
    assert all(p < i for i, p in enumerate(draft.parents))
    assert max(depths(draft.parents)) <= 4
    assert depths(draft.parents) == sorted(depths(draft.parents))
    for parent in set(draft.parents):
        children = [draft.tokens[i] for i, p in enumerate(draft.parents) if p == parent]
        assert len(children) == len(set(children)) <= 3
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    chain = proposer.propose([ProposalRequest("s", [5, 6, 7, 8, 9], with_logprobs, 0, 9, h)])[0]
    assert chain.parents is None and len(chain.tokens) == 4


def test_draft_vocabulary_restricts_drafts(tiny_llama: Path, eagle_file: Path) -> None:
    """Drafts use only the head's draft vocabulary; a sampled chain's distribution is zero outside it, sums to
    one and gave its token positive mass; draft_vocab_size cuts it (0: the full vocabulary)."""
    proposer, target = _proposer(tiny_llama, eagle_file)
    vocab = set(proposer.head.draft_vocab.tolist())
    assert 0 < len(vocab) < target.cfg.vocab_size
    h = torch.randn(3, target.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=8)
    draft = proposer.propose([ProposalRequest("r", [5, 6, 7, 8], sampled, 0, 3, h)])[0]
    assert set(draft.tokens) <= vocab and draft.probs is not None
    outside = torch.ones(draft.probs.shape[-1], dtype=torch.bool)
    outside[proposer.head.draft_vocab] = False
    assert float(draft.probs[:, outside].abs().sum()) == 0.0
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(3))
    assert all(float(draft.probs[i, t]) > 0 for i, t in enumerate(draft.tokens))
    small, _ = _proposer(tiny_llama, eagle_file, draft_vocab_size=10)
    assert set(small.propose([ProposalRequest("r", [5, 6, 7, 8], GREEDY, 0, 3, h)])[0].tokens) <= \
        set(proposer.head.draft_vocab[:10].tolist())
    full, _ = _proposer(tiny_llama, eagle_file, draft_vocab_size=0)
    assert full.vocab_rows is None
    with pytest.raises(ValueError, match="exceeds the head's draft vocabulary"):
        _proposer(tiny_llama, eagle_file, draft_vocab_size=len(vocab) + 1)


def test_bfloat16_drafting_reads_the_packed_target(tiny_llama: Path, eagle_file: Path) -> None:
    """In bfloat16 the target's weights are packed at load (where the native GEMM runs): the draft LM head holds
    exactly the target's rows of the draft vocabulary, packed like the head's own layers, and drafting runs."""
    from pagellm.ops import gemm

    llm = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory=SMALL_KV,
              speculative_config={"method": "eagle", "model": str(eagle_file), **SHAPES["dynamic"]})
    runner = llm.engine.core.executor.worker.runner
    proposer, target = runner.proposer, runner.model
    assert (gemm.packed_shape(target.lm_head.weight) is not None) == gemm.available()
    rows = target.lm_head.plain_weight()[proposer.vocab_rows]
    assert torch.equal(gemm.plain(proposer.lm_weight), rows)
    assert (gemm.packed_shape(proposer.lm_weight) is not None) == gemm.available()
    assert (gemm.packed_shape(proposer.head.fc.weight) is not None) == gemm.available()
    assert all(len(out) == GREEDY.max_tokens for out in _run(llm, _prompts(6, n=2), GREEDY))
    assert _drafted(llm)[0] > 0


def test_eagle_window_follows_accepted_tokens(tiny_llama: Path, eagle_file: Path) -> None:
    """The proposer's per-request window keeps only pairs whose token is still the request's token there."""
    proposer, target = _proposer(tiny_llama, eagle_file, num_speculative_tokens=2)
    h = torch.zeros(1, target.cfg.hidden_size)
    ask = lambda toks, rows=h: ProposalRequest("r", toks, GREEDY, 0, 2, rows)  # noqa: E731
    assert len(proposer.propose([ask([1, 2, 3])])[0].tokens) == 2
    proposer.propose([ask([1, 2, 3, 4, 5])])  # one row: a gap (position 3 unseen) is kept
    assert proposer.history["r"] == [(2, 3), (4, 5)]
    proposer.propose([ask([1, 2, 3, 4, 5, 6, 7], h.expand(2, -1))])  # two rows: positions 5 and 6
    assert proposer.history["r"] == [(2, 3), (4, 5), (5, 6), (6, 7)]
    proposer.propose([ask([1, 2, 9, 4])])   # position 2 changed (preempted and resampled): it and later go
    assert proposer.history["r"] == [(3, 4)]
    proposer.propose([ask([1, 2, 9, 4, 5], torch.zeros(4, target.cfg.hidden_size))])  # a re-prefill: all rows
    assert proposer.history["r"] == [(1, 2), (2, 9), (3, 4), (4, 5)]
    proposer.release(["r"])
    assert proposer.history == {}


def test_eagle_tree_children_are_the_heads_top_candidates(tiny_llama: Path, eagle_file: Path) -> None:
    """Static tree nodes come breadth-first in static_tree's numbering; each node's children are the head's best
    candidates after that node's own path, so the first-ranked path equals the greedy chain."""
    from pagellm.spec.tree import static_tree

    proposer, target = _proposer(tiny_llama, eagle_file)
    tree_proposer, _ = _proposer(tiny_llama, eagle_file, tree=[2, 2, 1])
    h = torch.randn(3, target.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ask = ProposalRequest("r", [5, 6, 7, 8], GREEDY, 0, 20, h)
    chain = proposer.propose([ask])[0]
    tree = tree_proposer.propose([ask])[0]
    assert tree.parents == static_tree([2, 2, 1]) and len(tree.tokens) == 10
    assert [tree.tokens[0], tree.tokens[2], tree.tokens[6]] == chain.tokens  # rank-0 path: nodes 0, 2, 6
    assert tree.tokens[0] != tree.tokens[1]


def test_best_subtree_keeps_ancestors_in_breadth_first_order() -> None:
    # root → 0 (-0.1), 1 (-0.5); 0 → 2 (-0.3), 3 (-2.0); 1 → 4 (-0.6); 2 → 5 (-0.35)
    parents = [-1, -1, 0, 0, 1, 2]
    scores = [-0.1, -0.5, -0.3, -2.0, -0.6, -0.35]
    assert best_subtree(parents, scores, 4) == [0, 1, 2, 5]
    assert best_subtree(parents, scores, 2) == [0, 2]
    assert best_subtree(parents, scores, 10) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="no higher than its parent"):
        best_subtree([-1, 0], [-1.0, -0.5], 1)


def test_prompt_lookup_branch_joins_the_tree() -> None:
    """The n-gram branch follows matching nodes and appends the rest, each after its parent."""
    from pagellm.spec.eagle import _merge_branch

    tokens, parents = [7, 8, 9], [-1, -1, 0]          # root → 7 → 9, root → 8
    _merge_branch(tokens, parents, [7, 9, 4, 5])      # shares 7 → 9, then adds 4 → 5
    assert (tokens, parents) == ([7, 8, 9, 4, 5], [-1, -1, 0, 2, 3])
    _merge_branch(tokens, parents, [6])
    assert (tokens, parents) == ([7, 8, 9, 4, 5, 6], [-1, -1, 0, 2, 3, -1])
    assert SpeculativeConfig(method="eagle", num_speculative_tokens=3, eagle_topk=2, num_draft_tokens=5,
                             prompt_lookup_tokens=4).num_lookahead_tokens == 9
    with pytest.raises(ValueError, match="with a tree"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=3, prompt_lookup_tokens=4)
