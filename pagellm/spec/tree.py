"""Draft trees: their shape, how they are flattened into a step's batch, and moving the accepted path's KV.

A tree hangs below the *root*, the request's newest token (sampled last step, not yet in the KV cache). Nodes are
numbered 0..N-1 in breadth-first order, so every parent precedes its children and any prefix of the numbering is
itself a tree (the scheduler may schedule only the first few drafts). ``parents[i]`` is node i's parent (-1 for
the root). A static shape is given by its branching per depth: ``[3, 2]`` gives the root 3 children and each of
those 2 (9 nodes); the children of a node are its proposer's top-k candidates, best first.

In the step's batch the root and its nodes are consecutive tokens of the request's row, each with its own KV slot
(the lookahead slots the scheduler reserved), but node ``i`` takes the RoPE position ``root + depth(i)`` and
attends only to the context, the root and its own ancestors (``ancestor_mask``). After verification the KV of the
accepted path is copied to the slots right after the root (``compact_kv``), so the accepted tokens sit where a
chain would have put them, and the other nodes' slots are simply overwritten by later tokens: the scheduler rolls
``num_computed_tokens`` back past them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def static_tree(branching: Sequence[int]) -> list[int]:
    """Parents (breadth-first) of the full tree with ``branching[d]`` children per node at depth ``d``."""
    if not branching or any(b < 1 for b in branching):
        raise ValueError(f"tree branching must be a non-empty list of positive integers, got {list(branching)}")
    parents: list[int] = []
    frontier = [-1]
    for width in branching:
        nxt = []
        for parent in frontier:
            for _ in range(width):
                nxt.append(len(parents))
                parents.append(parent)
        frontier = nxt
    return parents


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (the root's children have depth 1)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def child_rank(parents: Sequence[int]) -> list[int]:
    """Each node's index among its siblings (0 = the proposer's best candidate)."""
    seen: dict[int, int] = {}
    ranks = []
    for parent in parents:
        ranks.append(seen.get(parent, 0))
        seen[parent] = ranks[-1] + 1
    return ranks


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[N + 1, N + 1] bool over (root, nodes...): entry (i, j) is True when token j is token i or its ancestor."""
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    mask[0, 0] = True
    for node, parent in enumerate(parents):
        row = node + 1
        if parent >= 0:
            mask[row] = mask[parent + 1]
        mask[row, row] = True
    return mask


def row_mask(num_query: int, parents: Sequence[int]) -> torch.Tensor:
    """[num_query, num_query] mask among one row's query tokens whose last ``len(parents) + 1`` tokens are a root
    and its tree: causal before the tree, ancestor-only inside it (every tree token sees all earlier tokens)."""
    mask = torch.ones(num_query, num_query, dtype=torch.bool).tril_()
    tree = len(parents) + 1
    mask[num_query - tree:, num_query - tree:] = ancestor_mask(parents)
    return mask


def place_trees(positions: torch.Tensor, query_start_loc: np.ndarray,
                trees: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    """Give each tree row's nodes the RoPE position ``root + depth`` (in place) and return its attention mask."""
    masks = {}
    for row, parents in trees.items():
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        root = end - len(parents) - 1
        positions[root + 1:end] = positions[root] + torch.tensor(depths(parents), dtype=positions.dtype)
        masks[row] = row_mask(end - start, parents)
    return masks


def compact_kv(kv_caches: Sequence[torch.Tensor], src_slots: Sequence[int], dst_slots: Sequence[int]) -> None:
    """Copy each layer's K/V from the accepted nodes' slots to the slots right after the root.

    Along a path node numbers only grow and node j of a path is at least j, so a source is never a slot an earlier
    copy of the same call wrote; the gather below reads every source before anything is written anyway."""
    if not src_slots:
        return
    src = torch.tensor(src_slots, dtype=torch.int64)
    dst = torch.tensor(dst_slots, dtype=torch.int64)
    for cache in kv_caches:
        flat = cache.view(2, -1, *cache.shape[3:])
        flat[:, dst] = flat[:, src]


def best_subtree(parents: Sequence[int], scores: Sequence[float], budget: int) -> list[int]:
    """EAGLE-2's rerank: the ``budget`` best-scoring nodes of a drafted tree (ties: the earlier node), in
    breadth-first order (by depth, then by their order in ``parents``), so renumbering them in that order gives
    a valid tree whose every prefix is a tree.

    ``parents`` must list parents before children and no node may score above its parent (path log
    probabilities do): then a kept node's ancestors all rank before it and are kept too."""
    ranked = sorted(range(len(parents)), key=lambda i: (-scores[i], i))[:max(budget, 0)]
    kept = set(ranked)
    if any(parents[i] >= 0 and parents[i] not in kept for i in kept):
        raise ValueError("best_subtree needs every node to score no higher than its parent")
    level = depths(parents)
    return sorted(kept, key=lambda i: (level[i], i))
