"""Training an EAGLE head (``pagellm train-draft --method eagle``) on the target's own greedy continuations.

Data: rows of (final hidden state at t, token at t + 1) over each continuation and the last ``prompt_context``
prompt positions (``train.flatten``); a step takes ``batch`` random windows of ``window`` consecutive rows, and
every row whose next row is in the window learns (windows ending at output rows with the prompt as context only
learned less per step here: fewer rows learn).

Loss at every row whose next row exists, for the head's prediction ``h'`` of the next row's hidden state ``h``:
``smooth_l1(h', h) + ce_weight * CE(softmax(W h), log_softmax(W h'))`` where ``W`` holds the target's LM-head
rows of the draft vocabulary (soft labels: the target's own distribution there, as EAGLE trains).

- **Input noise** (EAGLE): the true hidden states fed in get uniform noise of ``noise`` times their RMS, so the
  head tolerates its own imperfect predictions when drafting deeper.
- **Unrolled passes** (EAGLE-3's training-time test): pass k > 1 feeds row i the head's own pass-(k - 1)
  prediction from row i - 1 instead of the true state, and row i attends exactly as the k-th draft depth does
  at inference: to the true pairs up to row i - k + 1, then the unrolled rows i - k + 2 .. i (one per pass).
  Pass k's loss weighs ``0.8 ** (k - 1)``.
- AdamW on float32 weights (matrix products under bfloat16 autocast unless ``bf16`` is off), linear warm-up over
  the first 5 % of steps, cosine decay to 10 % of ``lr``, gradients clipped to 0.5.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.spec.eagle import WINDOW
from pagellm.spec.eagle_head import EagleHead
from pagellm.spec.train import FrozenTarget, TrainSequence, draft_vocabulary, flatten, optimizer_step

logger = logging.getLogger(__name__)


@dataclass
class EagleRecipe:
    steps: int = 2600
    batch: int = 16               # windows per step
    lr: float = 2e-3
    seed: int = 0
    window: int = WINDOW          # rows per window (the proposer keeps as many true pairs)
    unroll: int = 2               # passes per window (1: no training-time test)
    noise: float = 0.05           # uniform input noise, times each row's RMS
    ce_weight: float = 0.5        # soft cross-entropy weight against the feature regression
    draft_vocab_size: int = 8192  # 0: the full vocabulary
    prompt_context: int = 32      # prompt positions before each continuation that train too
    bf16: bool = True             # bfloat16 autocast for the matrix products (~1.5-2x faster on AVX-512 BF16)

    def __post_init__(self) -> None:
        if self.unroll < 1 or self.window < 2 or self.batch < 1 or self.steps < 1:
            raise ValueError("need unroll >= 1, window >= 2, batch >= 1 and steps >= 1")


def spans(tokens: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) row ranges of each sequence between separator rows (token -1)."""
    bounds = [-1, *torch.nonzero(tokens < 0).squeeze(1).tolist(), len(tokens)]
    return [(a + 1, b) for a, b in zip(bounds, bounds[1:]) if b - a > 2]


def unrolled_mask(length: int, passes: int) -> torch.Tensor:
    """[passes, T, passes * T] bool: which keys (pass j, row m) query (pass k, row i) may attend to, as the k-th
    draft depth does: pass 0 rows m <= i - k, and pass j >= 1 row i - (k - j) (itself when j = k)."""
    i = torch.arange(length)[:, None]
    m = torch.arange(length)[None, :]
    mask = torch.zeros(passes, length, passes * length, dtype=torch.bool)
    for k in range(passes):
        mask[k, :, :length] = m <= i - k
        for j in range(1, k + 1):
            mask[k, :, j * length:(j + 1) * length] = m == i - (k - j)
    return mask


def train_eagle(sequences: list[TrainSequence], target: FrozenTarget,
                recipe: EagleRecipe) -> tuple[EagleHead, list[float]]:
    """Train a head on the sequences; returns it (with its draft vocabulary) and the loss per step."""
    torch.manual_seed(recipe.seed)
    gen = torch.Generator().manual_seed(recipe.seed)
    hidden, tokens = flatten(sequences, recipe.prompt_context)
    ranges = spans(tokens)
    if not ranges:
        raise ValueError("no training sequences with at least two continuation tokens; raise --max-tokens")
    vocab = draft_vocabulary(sequences, recipe.draft_vocab_size) if recipe.draft_vocab_size else None
    lm = target.lm_head[vocab] if vocab is not None else target.lm_head
    head = EagleHead(target.cfg, torch.float32, vocab, recipe.window).train()
    optim = torch.optim.AdamW(head.parameters(), lr=recipe.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: _lr_factor(s, recipe.steps))
    masks = unrolled_mask(recipe.window, recipe.unroll)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(recipe.steps):
        idx, learn = _windows(ranges, recipe, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.bf16):
            reg, ce, acc = _window_loss(head, target, lm, hidden, tokens, idx, learn, masks, recipe, gen)
        losses.append(optimizer_step(optim, reg + recipe.ce_weight * ce, ce, reg, step, recipe.steps, 0.5))
        schedule.step()
        if step % 50 == 0 or step == recipe.steps - 1:
            logger.info("step %d: top-1 agreement per pass %s (%.0fs)", step + 1,
                        " ".join(f"{a:.2f}" for a in acc), time.perf_counter() - start)
    return head.eval(), losses


def _lr_factor(step: int, steps: int) -> float:
    warm = max(steps // 20, 1)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(steps - warm, 1)
    return 0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())


def _windows(ranges: list[tuple[int, int]], recipe: EagleRecipe,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, T] row indices of ``batch`` random windows (padded with row 0) and which rows learn (those whose
    next row is in the window). Sequences are picked in proportion to their length, so every row is about as
    likely to train (picking sequences uniformly would favour the many short chat answers over long code)."""
    lengths = torch.tensor([float(end - first) for first, end in ranges])
    picks = torch.multinomial(lengths, recipe.batch, replacement=True, generator=gen).tolist()
    idx = torch.zeros(recipe.batch, recipe.window, dtype=torch.int64)
    learn = torch.zeros(recipe.batch, recipe.window, dtype=torch.bool)
    for s, i in enumerate(picks):
        first, end = ranges[i]
        first += int(torch.randint(0, max(end - first - recipe.window, 0) + 1, (1,), generator=gen))
        n = min(recipe.window, end - first)
        idx[s, :n] = torch.arange(first, first + n)
        learn[s, :n - 1] = True
    return idx, learn


def _window_loss(head: EagleHead, target: FrozenTarget, lm: torch.Tensor, hidden: torch.Tensor,
                 tokens: torch.Tensor, idx: torch.Tensor, learn: torch.Tensor, masks: torch.Tensor,
                 recipe: EagleRecipe, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """The unrolled passes over one batch of windows: (feature loss, soft CE, top-1 agreement per pass)."""
    S, T = idx.shape
    nxt = (idx + 1).clamp(max=len(tokens) - 1)
    goal = hidden[nxt]                                                             # [S, T, H]
    with torch.no_grad():
        soft = F.softmax(goal @ lm.T, dim=-1)
    embeds = F.embedding(tokens[idx].clamp_min(0), target.embed)
    fed = hidden[idx]
    fed = fed + recipe.noise * fed.pow(2).mean(-1, keepdim=True).sqrt() * (torch.rand(fed.shape, generator=gen)
                                                                           * 2 - 1)
    positions = torch.arange(T).repeat(S)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    reg = ce = torch.zeros(())
    accuracy = []
    for k in range(recipe.unroll):
        residual, q, kk, vv = head.project(embeds.reshape(S * T, -1), fed.reshape(S * T, -1), positions)
        keys.append(kk.reshape(S, T, *kk.shape[1:]))
        values.append(vv.reshape(S, T, *vv.shape[1:]))
        attended = _attend(q.reshape(S, T, *q.shape[1:]), keys, values, masks[k, :, :(k + 1) * T], head)
        predicted = target.norm.forward_torch(head.finish(residual, attended.reshape(S * T, *q.shape[1:])))[0]
        predicted = predicted.reshape(S, T, -1)
        rows = learn.clone()
        rows[:, :k] = False                     # pass k's row i needs the pairs i - k .. i inside the window
        weight = 0.8 ** k
        logits = predicted[rows] @ lm.T
        reg = reg + weight * F.smooth_l1_loss(predicted[rows], goal[rows])
        ce = ce + weight * -(soft[rows] * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        accuracy.append((logits.argmax(-1) == soft[rows].argmax(-1)).float().mean().item())
        fed = torch.cat([predicted[:, :1], predicted[:, :-1]], dim=1)  # row i gets row i - 1's prediction
    return reg, ce, accuracy


def _attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor,
            head: EagleHead) -> torch.Tensor:
    """q [S, T, heads, D] over every pass's keys so far ([S, T, kv_heads, D] each) under ``mask`` [T, k T]."""
    groups = head.num_heads // head.num_kv_heads
    k = torch.cat(keys, dim=1).repeat_interleave(groups, dim=2).transpose(1, 2)
    v = torch.cat(values, dim=1).repeat_interleave(groups, dim=2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=head.head_dim ** -0.5)
    return out.transpose(1, 2)
