"""What sampling features cost: decode throughput of one batch under three sampling setups, one process.

Setups, each a batch of ``--batch`` requests (random prompts, ``--output-len`` tokens, EOS ignored):
  (a) greedy;
  (b) temperature 0.8 + top-p 0.9 + top-k 50 + repetition/presence/frequency penalties + a logit bias;
  (c) as (a) with half the batch constrained by a JSON schema (a long integer array, so the grammar is active for
      every step; those requests stop at the length limit like the others).
Rounds run a, b, c interleaved so machine noise hits all three alike; each figure is the best round. Prints output
tokens/s per setup and the ratios b/a and c/a (targets: b >= 0.90, c >= 0.75).

``--micro`` instead times only what sampling adds per decode step, on the model runner's own code: logits
processing + sampling of a [batch, vocab] logit matrix (in the model's dtype, bfloat16 by default, as the runner
hands it over) for a, b and c (c includes filling the grammar
bitmasks of half the rows), interleaved over many repetitions (median). That part is what the setups differ in,
and it is far less sensitive to a busy machine than a whole generation.

``--kernel`` times the sampler alone on temperature-only rows (T = 1.0 and 0.7, the workload of the throughput and
serving benchmarks) and greedy rows (T = 0) at batches 1, 32 and 256: the native calls (``sample/native.py``)
against their torch twins (softmax, cumsum, searchsorted; ``max(dim).indices``), interleaved, median of
``--repeats``.

``--greedy-ab`` runs greedy generation of one batch (``--batch`` prompts of ``--prompt-len`` random tokens,
``--output-len`` tokens) in one ``LLM``, alternating the native argmax and its torch twin (``max(dim).indices``)
each round, and prints each side's output tokens/s, the ratio of their medians and whether the tokens are the same.
Usage:

    .venv/bin/python benchmarks/sampling.py [--batch 64] [--output-len 64] [--rounds 3] [--dtype bfloat16]
    .venv/bin/python benchmarks/sampling.py --micro [--batch 64] [--repeats 30] [--dtype bfloat16]
    .venv/bin/python benchmarks/sampling.py --kernel [--repeats 30] [--dtype bfloat16]
    .venv/bin/python benchmarks/sampling.py --greedy-ab [--batch 32] [--prompt-len 128] [--output-len 128] [--rounds 6]
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


def micro(batch: int, repeats: int, dtype: torch.dtype) -> dict[str, float]:
    """Median ms per step of processing + sampling alone, per setup (see the module docstring)."""
    import statistics

    from pagellm.model.loader import resolve_model_dir
    from pagellm.sample.logits_processors import LogitsProcessing, RowContext
    from pagellm.sample.sampler import Sampler, SamplingTensors

    model_dir = resolve_model_dir(None)
    vocab = 49152
    processing = LogitsProcessing(vocab, model_dir)
    sampler = Sampler(torch.Generator().manual_seed(0))
    history = torch.randint(100, vocab, (batch, 96), generator=torch.Generator().manual_seed(1)).tolist()
    timings: dict[str, list[float]] = {name: [] for name in ("a_greedy", "b_sampling_penalties", "c_half_json")}
    configs = setups(batch, 64)
    # 32 prompt + 64 output tokens of history per request (a grammar starts at its beginning)
    states = {name: [processing.create(p, h[:32], [] if p.structured_outputs else h[32:])
                     for p, h in zip(params, history)] for name, params in configs.items()}
    noise = torch.Generator().manual_seed(2)
    for _ in range(repeats):
        for name, params in configs.items():
            logits = (torch.randn(batch, vocab, generator=noise) * 3).to(dtype)
            start = time.perf_counter()
            grammars = [(i, s.grammar) for i, s in enumerate(states[name]) if s is not None and s.grammar]
            masks = processing.start_masks(batch, grammars)
            contexts = [RowContext(s, ()) for s in states[name]]
            processed = processing.apply(logits, contexts, masks) if any(c.active for c in contexts) else logits
            sampler(processed, SamplingTensors.from_params(params, [64] * batch)).tolist()
            timings[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in timings.items()}


def kernel(repeats: int, dtype: torch.dtype) -> list[dict]:
    """Median ms per sampler call, fused vs torch twin, for temperature-only batches (see the module docstring)."""
    import statistics
    from unittest import mock

    from pagellm.sample import sampler as sampler_module
    from pagellm.sample.sampler import Sampler, SamplingTensors

    rows = []
    noise = torch.Generator().manual_seed(3)
    for batch in (1, 32, 256):
        for temperature in (1.0, 0.7, 0.0):
            tensors = SamplingTensors.from_params([SamplingParams(temperature=temperature)] * batch, [0] * batch)
            logits = (torch.randn(batch, 49152, generator=noise) * 3).to(dtype)
            times: dict[str, list[float]] = {"fused": [], "torch": []}
            for _ in range(repeats):
                for name in times:
                    native = sampler_module.native  # the torch side: both native calls decline
                    calls = {"sample_rows": native.sample_rows, "first_argmax_rows": native.first_argmax_rows}
                    if name == "torch":
                        calls = dict.fromkeys(calls, lambda *args: None)
                    with mock.patch.multiple(native, **calls):
                        start = time.perf_counter()
                        Sampler(torch.Generator().manual_seed(0))(logits, tensors)
                        times[name].append((time.perf_counter() - start) * 1e3)
            fused, twin = statistics.median(times["fused"]), statistics.median(times["torch"])
            rows.append({"batch": batch, "temperature": temperature, "fused_ms": round(fused, 3),
                         "torch_ms": round(twin, 3), "speedup": round(twin / fused, 1)})
    return rows


def greedy_ab(llm: LLM, prompts: list[list[int]], output_len: int, rounds: int) -> dict:
    """Greedy generation with the native argmax against its torch twin, alternated (see the module docstring)."""
    import statistics
    from unittest import mock

    from pagellm.sample import native

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    run_once(llm, prompts, [params] * len(prompts))  # warm-up
    rates: dict[str, list[float]] = {"native": [], "torch": []}
    tokens: dict[str, list] = {}
    for round_index in range(rounds):
        for name in (("native", "torch") if round_index % 2 == 0 else ("torch", "native")):
            patch = {"first_argmax_rows": (lambda *args: None) if name == "torch" else native.first_argmax_rows}
            with mock.patch.multiple(native, **patch):
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
            tokens[name] = [o.outputs[0].token_ids for o in outputs]
            rates[name].append(sum(map(len, tokens[name])) / elapsed)
            print(f"round {round_index}: {name:6s} {rates[name][-1]:8.1f} output tok/s", flush=True)
    ours, twin = statistics.median(rates["native"]), statistics.median(rates["torch"])
    return {"batch": len(prompts), "native_tok_s": round(ours, 1), "torch_tok_s": round(twin, 1),
            "ratio": round(ours / twin, 3), "same_tokens": tokens["native"] == tokens["torch"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the built-in model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro", action="store_true", help="time processing + sampling per step only")
    parser.add_argument("--kernel", action="store_true", help="time the fused sampling call against its twin")
    parser.add_argument("--greedy-ab", action="store_true", help="greedy generation, native argmax against its twin")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if args.kernel:
        for row in kernel(args.repeats, getattr(torch, args.dtype)):
            print(json.dumps(row))
        return
    if args.micro:
        figures = micro(args.batch, args.repeats, getattr(torch, args.dtype))
        print(json.dumps({"batch": args.batch, "dtype": args.dtype, "ms_per_step": {k: round(v, 2) for k, v in figures.items()}}))
        return

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch)
    vocab = llm.engine.runtime.vocab_size
    prompts = torch.randint(100, vocab, (args.batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    if args.greedy_ab:
        print(json.dumps(greedy_ab(llm, prompts, args.output_len, args.rounds)))
        return
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
