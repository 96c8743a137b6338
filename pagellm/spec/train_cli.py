"""``pagellm train-draft``: the command line of ``spec/train.py`` (its flags, per-method defaults, and the command
recorded in a trained file). Torch-free, so building the ``pagellm`` parser imports no torch; ``main`` loads the
trainer when the command runs."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagellm.spec.train import TrainConfig

_EAGLE_FLAGS = (("window", int), ("unroll", int), ("noise", float), ("ce-weight", float),
                ("draft-vocab-size", int), ("prompt-context", int))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-draft", help="train Medusa heads or an EAGLE head for a model (self-distillation, CPU)")
    p.add_argument("--method", choices=["medusa", "eagle"], default="medusa",
                   help="medusa: --num-heads residual heads; eagle: one decoder layer (--batch counts windows)")
    p.add_argument("--model", default=None, help="target model (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, required=True, help="output .safetensors file (the PNG goes beside it)")
    p.add_argument("--dtype", default="bfloat16", help="the target's dtype while generating (the serving one)")
    for name, default in (("num-heads", 4), ("chat-prompts", None), ("code-prompts", 64), ("max-tokens", None),
                          ("code-max-tokens", None), ("code-samples", None), ("steps", None), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--batch", type=int, default=None,
                   help="medusa: positions per step (default 64); eagle: sequence windows per step (default 16)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (medusa 3e-3, eagle 2e-3)")
    for name, kind in _EAGLE_FLAGS:
        p.add_argument(f"--{name}", type=kind, default=None, help="eagle recipe (spec/train_eagle.EagleRecipe)")
    p.set_defaults(func=main)


def command_line(cfg: TrainConfig) -> str:
    """The full command (defaults spelled out) that reproduces ``cfg``, recorded in the file's metadata; built
    from the parsed values because ``main`` may be called with an argv other than ``sys.argv``."""
    argv = ["train-draft", "--method", cfg.method, "--out", str(cfg.out)] + (["--model", cfg.model] if cfg.model
                                                                          else [])
    if cfg.method == "medusa":
        argv += ["--num-heads", str(cfg.num_heads)]
    for flag, value in (("dtype", cfg.dtype), ("chat-prompts", cfg.chat_prompts),
                        ("code-prompts", cfg.code_prompts), ("max-tokens", cfg.max_tokens),
                        ("code-max-tokens", cfg.code_max_tokens), ("code-samples", cfg.code_samples),
                        ("steps", cfg.steps), ("batch", cfg.batch), ("lr", cfg.lr), ("seed", cfg.seed)):
        if value is not None:
            argv += [f"--{flag}", str(value)]
    for key, value in cfg.eagle.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return "pagellm " + shlex.join(argv)


# Defaults per method: chat prompts, max tokens, code max tokens, code samples, steps, batch, lr. EAGLE's fit
# the 30-minute budget on the 2-core machine: ~7.5 minutes generating 210k tokens, ~18 minutes training.
_DEFAULTS = {"eagle": (1536, 192, 512, 4, 2600, 16, 2e-3), "medusa": (96, 96, None, 0, 300, 64, 3e-3)}


def main(args: argparse.Namespace) -> int:
    from pagellm.spec.train import TrainConfig, run

    eagle = args.method == "eagle"
    given = (args.chat_prompts, args.max_tokens, args.code_max_tokens, args.code_samples, args.steps, args.batch,
             args.lr)
    chats, tokens, code_tokens, samples, steps, batch, lr = (value if value is not None else default for
                                                            value, default in zip(given, _DEFAULTS[args.method]))
    recipe = {name.replace("-", "_"): getattr(args, name.replace("-", "_")) for name, _ in _EAGLE_FLAGS}
    cfg = TrainConfig(args.model, args.out, args.num_heads, chats, args.code_prompts, tokens, steps, batch, lr,
                      args.seed, args.method, args.dtype, code_tokens, samples,
                      {k: v for k, v in recipe.items() if v is not None} if eagle else {})
    run(cfg, command_line(cfg))
    return 0
