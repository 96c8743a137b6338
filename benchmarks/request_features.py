"""What prompt embeddings and custom logits processors cost offline, against token prompts in the same run.

One engine (``enable_prompt_embeds``, a custom logits processor loaded) runs three workloads of the same prompts,
round by round in rotating order so that every side sees the same spells of the machine:

- ``tokens``: random token-id prompts (the baseline);
- ``embeds``: the same prompts given as their own embedding rows (``{"prompt_embeds": rows}``), so the tokens
  generated must be the same (checked: greedy, and the rows are exactly what the embedding lookup gives);
- ``custom``: the token prompts with every request opted into a custom logits processor that bans one token (a
  Python call per request per step, as custom processors cost).

Prints each round's output tok/s per side, each side's median and its ratio to ``tokens``.

    .venv/bin/python benchmarks/request_features.py [--model DIR_OR_GGUF] [--num-prompts 256] [--input-len 128]
        [--output-len 128] [--rounds 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.sample.custom import AdapterLogitsProcessor  # noqa: E402


class BanOneToken(AdapterLogitsProcessor):
    """Requests with ``extra_args={"ban": t}`` never produce token t."""

    def new_req_logits_processor(self, params: SamplingParams):
        token = (params.extra_args or {}).get("ban")
        if token is None:
            return None

        def ban(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            logits[token] = float("-inf")
            return logits

        return ban


def _run(llm: LLM, prompts: list, params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    return sum(map(len, tokens)) / elapsed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the built-in model)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, enable_prompt_embeds=True,
              logits_processors=[f"{__name__}:BanOneToken"])
    vocab = llm.engine.runtime.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (args.input_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    embed = llm.engine.core.executor.worker.runner.model.model.embed_tokens
    with torch.no_grad():
        rows = [{"prompt_embeds": embed(torch.tensor(p)).clone()} for p in ids]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    banned = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, extra_args={"ban": 0})
    sides = {"tokens": (ids, greedy), "embeds": (rows, greedy), "custom": (ids, banned)}
    _run(llm, ids[:16], greedy)  # warm-up: kernels, first touch of the KV cache
    figures: dict[str, list[float]] = {name: [] for name in sides}
    outputs: dict[str, list[list[int]]] = {}
    for round_index in range(args.rounds):
        order = list(sides)[round_index % 3:] + list(sides)[:round_index % 3]
        for name in order:
            llm.reset_prefix_cache()  # every side computes its prompts
            rate, outputs[name] = _run(llm, *sides[name])
            figures[name].append(rate)
            print(f"round {round_index + 1} {name:7s} {rate:8.1f} output tok/s", flush=True)
    same = sum(a == b for a, b in zip(outputs["tokens"], outputs["embeds"]))
    print(f"embeds gave the token prompts' tokens for {same} of {len(ids)} prompts")
    base = statistics.median(figures["tokens"])
    for name, values in figures.items():
        median = statistics.median(values)
        print(f"{name:7s} median {median:8.1f} output tok/s  ({median / base:.3f}x tokens)")


if __name__ == "__main__":
    main()
