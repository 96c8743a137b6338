"""Rejection sampling keeps the target distribution: chi-square tests on a small vocabulary with fixed seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagellm.sample.rejection import (accept_greedy, accept_greedy_tree, rejection_sample_chain,
                                      rejection_sample_tree, uniforms_for)

V = 6
TRIALS = 20000


def _dist(gen: torch.Generator, sharp: float = 1.0) -> torch.Tensor:
    return torch.softmax(torch.randn(V, generator=gen) * sharp, dim=-1)


def _assert_matches(samples: np.ndarray, probs: torch.Tensor) -> None:
    counts = np.bincount(samples, minlength=V)
    expected = probs.double().numpy() * len(samples)
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    result = chisquare(counts[keep], expected[keep] * counts[keep].sum() / expected[keep].sum())
    assert result.pvalue > 1e-3, (counts, expected)


@pytest.mark.parametrize("point_mass", [False, True])
def test_chain_keeps_target_distribution(point_mass: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.stack([_dist(gen), _dist(gen, 2.0), _dist(gen)])    # after the root, after d1, after d2
    q = torch.stack([_dist(gen), _dist(gen)])
    drafts = torch.stack([torch.multinomial(q[i], TRIALS, replacement=True, generator=gen) for i in range(2)], 1)
    # The target's distribution after d1 depends on d1 only through this fixed table: p[1] whatever d1 is.
    target = p.expand(TRIALS, 3, V)
    draft_probs = None if point_mass else q.expand(TRIALS, 2, V)
    uniforms = torch.rand(TRIALS, 3, 2, generator=gen)
    tokens, accepted = rejection_sample_chain(target, drafts, torch.full((TRIALS,), 2), draft_probs, uniforms)
    first = tokens[:, 0].numpy()
    _assert_matches(first, p[0])
    # The first token equals d1 exactly when d1 was accepted; the next token then follows p[1].
    took_first = (accepted >= 1).numpy()
    assert (first[took_first] == drafts[took_first, 0].numpy()).all()
    _assert_matches(tokens[took_first, 1].numpy(), p[1])
    both = (accepted == 2).numpy()
    _assert_matches(tokens[both, 2].numpy(), p[2])


def test_chain_with_fewer_drafts_samples_the_bonus_from_the_right_row() -> None:
    gen = torch.Generator().manual_seed(2)
    p = torch.stack([_dist(gen), _dist(gen), _dist(gen)])
    drafts = torch.zeros(TRIALS, 2, dtype=torch.int64)
    tokens, accepted = rejection_sample_chain(p.expand(TRIALS, 3, V), drafts, torch.zeros(TRIALS, dtype=torch.int64),
                                              None, torch.rand(TRIALS, 3, 2, generator=gen))
    assert (accepted == 0).all() and (tokens[:, 1:] == -1).all()
    _assert_matches(tokens[:, 0].numpy(), p[0])


def _tree_trials(point_mass: bool) -> tuple[list[int], list[list[int]], torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(3)
    # root → three children (nodes 0, 1, 2); node 0 → one child (node 3).
    parents = [-1, -1, -1, 0]
    p = torch.stack([_dist(gen, 2.0), _dist(gen), _dist(gen), _dist(gen), _dist(gen)])
    q_root, q_child = _dist(gen), _dist(gen)
    firsts, seconds, tokens = [], [], []
    for _ in range(TRIALS // 2):
        if point_mass:
            children = torch.randperm(V, generator=gen)[:3].tolist()  # three distinct tokens
            probs = None
        else:
            children = torch.multinomial(q_root, 3, replacement=True, generator=gen).tolist()  # i.i.d. from q
            probs = torch.stack([q_root, q_root, q_root, q_child])
        grandchild = int(torch.multinomial(q_child, 1, generator=gen))
        node_tokens = children + [grandchild]
        path, final = rejection_sample_tree(p, node_tokens, parents, probs, torch.rand(5, 2, generator=gen))
        emitted = [node_tokens[n] for n in path] + [final]
        firsts.append(emitted[0])
        seconds.append((path[0] if path else -1, emitted[1] if len(emitted) > 1 else -1))
        tokens.append(node_tokens)
    return firsts, seconds, p, tokens


@pytest.mark.parametrize("point_mass", [False, True])
def test_tree_keeps_target_distribution(point_mass: bool) -> None:
    firsts, seconds, p, _ = _tree_trials(point_mass)
    _assert_matches(np.array(firsts), p[0])
    # After accepting child node c the next token follows p[c + 1].
    for node in range(3):
        after = np.array([tok for n, tok in seconds if n == node])
        if len(after) > 200:
            _assert_matches(after, p[node + 1])


def _restricted(gen: torch.Generator, support: int) -> torch.Tensor:
    """A draft distribution that is exactly zero outside its first ``support`` tokens (a reduced draft
    vocabulary, as EAGLE heads draft with)."""
    q = torch.zeros(V)
    q[:support] = torch.softmax(torch.randn(support, generator=gen), dim=-1)
    return q


def test_chain_with_restricted_draft_support_keeps_target_distribution() -> None:
    """Drafts drawn from q with zero mass on tokens the target likes: those tokens are never proposed, yet every
    emitted position still follows p (the residual max(p - q, 0) carries their mass)."""
    gen = torch.Generator().manual_seed(4)
    p = torch.stack([_dist(gen), _dist(gen, 2.0), _dist(gen)])
    q = torch.stack([_restricted(gen, 3), _restricted(gen, 2)])
    drafts = torch.stack([torch.multinomial(q[i], TRIALS, replacement=True, generator=gen) for i in range(2)], 1)
    assert int(drafts.max()) < 3
    tokens, accepted = rejection_sample_chain(p.expand(TRIALS, 3, V), drafts, torch.full((TRIALS,), 2),
                                              q.expand(TRIALS, 2, V), torch.rand(TRIALS, 3, 2, generator=gen))
    first = tokens[:, 0].numpy()
    _assert_matches(first, p[0])
    assert (first >= 3).any()  # tokens outside the draft's support are still emitted (by the residual)
    took_first = (accepted >= 1).numpy()
    _assert_matches(tokens[took_first, 1].numpy(), p[1])
    _assert_matches(tokens[(accepted == 2).numpy(), 2].numpy(), p[2])


def test_tree_with_restricted_draft_support_keeps_target_distribution() -> None:
    """Children drawn i.i.d. from a restricted q, verified in order against the running residual."""
    gen = torch.Generator().manual_seed(5)
    parents = [-1, -1]
    p = torch.stack([_dist(gen, 2.0), _dist(gen), _dist(gen)])
    q = _restricted(gen, 3)
    firsts = []
    for _ in range(TRIALS // 2):
        children = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
        path, final = rejection_sample_tree(p, children, parents, torch.stack([q, q]), torch.rand(3, 2, generator=gen))
        firsts.append(children[path[0]] if path else final)
    _assert_matches(np.array(firsts), p[0])


def test_greedy_acceptance() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 1]) == 2
    assert accept_greedy([5, 6], [4, 6, 1]) == 0
    # root children 3 (node 0), 4 (node 1); node 1 → 7 (node 2); node 0 → 7 (node 3)
    assert accept_greedy_tree([3, 4, 7, 7], [-1, -1, 1, 0], [4, 0, 7, 9, 0]) == [1, 2]
    assert accept_greedy_tree([3, 4, 7, 7], [-1, -1, 1, 0], [5, 0, 0, 0, 0]) == []


def test_seeded_uniforms_depend_only_on_seed_and_position() -> None:
    a = uniforms_for(4, 7, 10, torch.Generator().manual_seed(0))
    b = uniforms_for(4, 7, 10, torch.Generator().manual_seed(99))
    assert torch.equal(a, b)
    assert not torch.equal(a, uniforms_for(4, 7, 11, None))


def test_speculative_config_validation_names_the_fix() -> None:
    from pagellm.config import EngineConfig, SpeculativeConfig

    assert SpeculativeConfig.parse('{"method": "medusa", "num_speculative_tokens": 3, "model": "h.safetensors", '
                                   '"tree": [3, 2, 1]}').num_lookahead_tokens == 3 + 6 + 6
    with pytest.raises(ValueError, match="exactly one of 'model'"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="one per depth"):
        SpeculativeConfig(method="medusa", num_speculative_tokens=2, model="h", tree=[2])
    with pytest.raises(ValueError, match="use one of ngram, draft_model, medusa, eagle"):
        SpeculativeConfig(method="lookahead", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="eagle needs 'model'"):  # only the built-in model has a default head
        EngineConfig.from_kwargs(model="/some/model", speculative_config={"method": "eagle",
                                                                          "num_speculative_tokens": 2})
    assert EngineConfig.from_kwargs(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    dynamic = {"method": "eagle", "num_speculative_tokens": 3, "eagle_topk": 3}
    assert SpeculativeConfig(**dynamic, num_draft_tokens=10).num_lookahead_tokens == 10
    with pytest.raises(ValueError, match="eagle_topk needs num_draft_tokens.*between 1 and 21"):
        SpeculativeConfig(**dynamic)
    with pytest.raises(ValueError, match="between 1 and 21"):
        SpeculativeConfig(**dynamic, num_draft_tokens=22)
    with pytest.raises(ValueError, match="either 'tree'.*or 'eagle_topk'"):
        SpeculativeConfig(**dynamic, num_draft_tokens=4, tree=[2, 2, 1])
    with pytest.raises(ValueError, match="for a chain leave it unset"):
        SpeculativeConfig(**{**dynamic, "eagle_topk": 1}, num_draft_tokens=3)
    with pytest.raises(ValueError, match="set eagle_topk too"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2, num_draft_tokens=4)
    with pytest.raises(ValueError, match="only supported with method 'eagle'"):
        SpeculativeConfig(method="medusa", num_speculative_tokens=2, model="h", draft_vocab_size=100)
    with pytest.raises(ValueError, match="draft_vocab_size must be >= 0"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2, draft_vocab_size=-1)
    with pytest.raises(ValueError, match="only supported with methods 'medusa' and 'eagle'"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, tree=[2, 1])
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, '
                                   '"disable_by_batch_size": null}').disable_by_batch_size is None
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match=r"disable_by_batch_size must be a positive number of requests \(or "
                                             r"null to draft at any batch size\)"):
            SpeculativeConfig(method="ngram", num_speculative_tokens=2, disable_by_batch_size=bad)


def test_spec_stats_mean_acceptance_length() -> None:
    from pagellm.metrics.stats import SpecDecodingStats

    stats = SpecDecodingStats()
    stats.observe(3, 2)
    stats.observe(3, 0)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0]
    assert stats.mean_acceptance_length == 2.0
    assert stats.acceptance_rate_per_pos == [0.5, 0.5, 0.0]


def test_vllms_speculative_shorthand_flags_set_one_key_each() -> None:
    """``--spec-method``, ``--spec-model``, ``--spec-tokens`` (vLLM 0.32) and ``-sc`` for ``--speculative-config``."""
    from pagellm.cli import build_parser, engine_kwargs
    from pagellm.config import EngineConfig
    from pagellm.engine_args import EngineArgs

    args = build_parser().parse_args(["serve", "--spec-method", "ngram", "--spec-tokens", "4",
                                      "-sc", '{"prompt_lookup_max": 5}'])
    spec = EngineConfig.from_kwargs(**engine_kwargs(args)).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 4, 5)
    draft = EngineArgs(spec_method="medusa", spec_model="h.safetensors", spec_tokens=2).create_engine_config()
    assert (draft.speculative_config.method, draft.speculative_config.model) == ("medusa", "h.safetensors")
    with pytest.raises(ValueError, match=r"--spec-tokens and speculative_config\['num_speculative_tokens'\] are "
                                         "mutually exclusive"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, spec_tokens=3)
