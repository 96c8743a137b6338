"""Throughput at batch 32 with speculation configured but switched off by ``disable_by_batch_size`` (default 4):
no speculation, n-gram and EAGLE's dynamic tree with the prompt-lookup branch, each engine built once and the
three measured in turn for ``--rounds`` rounds, so machine drift falls on all of them alike (a single run per
method, as in ``spec_decode.py``'s batch-32 row, puts 10% noise on whichever runs at a bad moment). Usage:

    .venv/bin/python benchmarks/spec_under_load.py [--batch 32] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

from pagellm import LLM, SamplingParams
from pagellm.spec.train import code_prompts

SPECS = {"none": None,
         "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
         "eagle dyn+lookup": {"method": "eagle", "num_speculative_tokens": 6, "eagle_topk": 2,
                              "num_draft_tokens": 8, "prompt_lookup_tokens": 5}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prompts = (code_prompts(4, 160) * args.batch)[:args.batch]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llms = {name: LLM(dtype="bfloat16", speculative_config=spec) for name, spec in SPECS.items()}
    for llm in llms.values():
        llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    base = sum(rates["none"]) / args.rounds
    print(f"{'method':<18}{'tok/s (mean)':>13}{'ratio':>7}   rounds")
    for name, values in rates.items():
        mean = sum(values) / len(values)
        print(f"{name:<18}{mean:>13.1f}{mean / base:>7.2f}   {' '.join(f'{v:.0f}' for v in values)}")


if __name__ == "__main__":
    main()
