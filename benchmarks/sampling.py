"""What sampling features cost: decode throughput of one batch under three sampling setups, one process.

Setups, each a batch of ``--batch`` requests (random prompts, ``--output-len`` tokens, EOS ignored):
  (a) greedy;
  (b) temperature 0.8 + top-p 0.9 + top-k 50 + repetition/presence/frequency penalties + a logit bias;
  (c) as (a) with half the batch constrained by a JSON schema (a long integer array, so the grammar is active for
      every step; those requests stop at the length limit like the others).
Rounds run a, b, c interleaved so machine noise hits all three alike; each figure is the best round. Prints output
tokens/s per setup and the ratios b/a and c/a (targets: b >= 0.90, c >= 0.75). Usage:

    .venv/bin/python benchmarks/sampling.py [--batch 64] [--output-len 64] [--rounds 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 200,
          "maxItems": 200}


def setups(batch: int, output_len: int) -> dict[str, list[SamplingParams]]:
    common = dict(max_tokens=output_len, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, **common)
    full = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1, presence_penalty=0.3,
                          frequency_penalty=0.3, logit_bias={100: 1.0, 200: -1.0}, seed=0, **common)
    constrained = SamplingParams(temperature=0.0, max_tokens=output_len,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    return {"a_greedy": [greedy] * batch, "b_sampling_penalties": [full] * batch,
            "c_half_json": [constrained if i % 2 == 0 else greedy for i in range(batch)]}


def run_once(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the built-in model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch)
    vocab = llm.engine.runtime.vocab_size
    prompts = torch.randint(100, vocab, (args.batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    configs = setups(args.batch, args.output_len)
    for params in configs.values():  # warm-up: kernels, grammar compile (cached afterwards)
        llm.generate(prompts[:4], params[:4], use_tqdm=False)
    best: dict[str, float] = {}
    for round_index in range(args.rounds):
        for name, params in configs.items():
            elapsed, tokens = run_once(llm, prompts, params)
            rate = tokens / elapsed
            best[name] = max(best.get(name, 0.0), rate)
            print(f"round {round_index}: {name:22s} {tokens} tokens in {elapsed:6.2f}s = {rate:8.1f} tok/s",
                  flush=True)
    base = best["a_greedy"]
    summary = {name: round(rate, 1) for name, rate in best.items()}
    summary["ratio_b_over_a"] = round(best["b_sampling_penalties"] / base, 3)
    summary["ratio_c_over_a"] = round(best["c_half_json"] / base, 3)
    print(json.dumps({"batch": args.batch, "output_len": args.output_len, "dtype": args.dtype, **summary}))


if __name__ == "__main__":
    main()
