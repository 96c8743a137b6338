"""Speculative decoding: mean acceptance length and time per output token (TPOT), no speculation vs each method.

Workloads: code (HumanEval prompts, raw completion) and chat (Chit Chat Challenge openings through the chat
template), greedy, at batch 1 and 8, plus output throughput at batch 32. TPOT of a batch is
``(time for N tokens - time for 1 token) / (N - 1)``, both measured in this run with the prefix cache reset, so
prefill is excluded; where the batch is smaller than ``--prompts`` (batch 1), every prompt runs in its own batch
and the TPOTs are averaged. Every figure is compared with the no-speculation baseline measured in the same run.
Methods: ngram, draft_model (self-speculation with the target's first ``--draft-layers`` layers), and, when
``--medusa FILE`` is given (``make draft-heads``), Medusa as a chain and as a tree, and when ``--eagle FILE``
is given (``pagellm train-draft --method eagle``; ``--eagle default`` is the shipped head), EAGLE as a chain,
a static tree, an EAGLE-2 dynamic tree, and that tree with a prompt-lookup branch merged in
(``--eagle-full-vocab`` adds the dynamic tree drafting over the full vocabulary instead of the head's draft
vocabulary).

Prompts are held out from ``train-draft``'s data: the last ``--prompts`` HumanEval problems (training uses the
first 64 of 164) and Chit Chat Challenge conversations from number 6000 on (training uses the first few
thousand at most). Usage:

    .venv/bin/python benchmarks/spec_decode.py [--medusa artifacts/smollm2-135m-medusa.safetensors]
        [--eagle default] [--dtype bfloat16] [--max-tokens 64] [--prompts 4] [--batches 1 8]
        [--throughput-batch 32] [--methods none "eagle dynamic"] [--disable-by-batch-size none]

Speculation switches itself off above ``disable_by_batch_size`` requests (default 4): ``--disable-by-batch-size
none`` measures what drafting costs at every batch size.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from pagellm import LLM, SamplingParams
from pagellm.spec.train import chat_prompts, code_prompts


def methods(args: argparse.Namespace) -> dict[str, dict | None]:
    out: dict[str, dict | None] = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
        f"self-spec {args.draft_layers}L": {"method": "draft_model", "num_speculative_tokens": 3,
                                           "draft_layers": args.draft_layers},
    }
    if args.medusa:
        out["medusa chain"] = {"method": "medusa", "num_speculative_tokens": 3, "model": args.medusa}
        out["medusa tree"] = {"method": "medusa", "num_speculative_tokens": 3, "model": args.medusa,
                              "tree": [3, 2, 1]}
    if args.eagle:
        head = None if args.eagle == "default" else args.eagle
        out["eagle chain"] = {"method": "eagle", "num_speculative_tokens": 4, "model": head}
        out["eagle tree"] = {"method": "eagle", "num_speculative_tokens": 4, "model": head, "tree": [3, 2, 1, 1]}
        out["eagle dynamic"] = {"method": "eagle", "model": head, **DYNAMIC}
        out["eagle dyn+lookup"] = {"method": "eagle", "model": head, **DYNAMIC, "prompt_lookup_tokens": 5}
        if args.eagle_full_vocab:
            out["eagle dyn fullV"] = {"method": "eagle", "model": head, **DYNAMIC, "draft_vocab_size": 0}
    return out


# EAGLE-2's dynamic tree as benchmarked (and documented in docs/speculative.md)
DYNAMIC = {"num_speculative_tokens": 6, "eagle_topk": 2, "num_draft_tokens": 8}
HELD_OUT_CHAT = 6000     # first Chit Chat Challenge conversation the benchmark uses (of 7168)
TRAINED_CODE = 64        # HumanEval problems train-draft trains on (the first ones)


def timed(llm: LLM, prompts: list, max_tokens: int, chat: bool) -> tuple[float, int, list]:
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False) if chat else llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs), llm.last_stats


def batches_of(prompts: list, batch: int) -> list[list]:
    """Every distinct prompt once, in batches of ``batch`` (a batch larger than the prompts repeats them)."""
    if batch >= len(prompts):
        return [(prompts * batch)[:batch]]
    return [prompts[i:i + batch] for i in range(0, len(prompts) - batch + 1, batch)]


def batch_figures(llm: LLM, batches: list[list], max_tokens: int, chat: bool) -> dict:
    """TPOT averaged over ``batches`` (run one after another), acceptance and throughput over all of them."""
    tpots, tokens, elapsed, stats = [], 0, 0.0, []
    for prompts in batches:
        t1, _, _ = timed(llm, prompts, 1, chat)
        tn, n, batch_stats = timed(llm, prompts, max_tokens, chat)
        tpots.append(1000 * (tn - t1) / (max_tokens - 1))
        tokens, elapsed, stats = tokens + n, elapsed + tn, stats + batch_stats
    return {"tpot_ms": sum(tpots) / len(tpots), "mean_acceptance_length": acceptance(stats),
            "output_tok_s": tokens / elapsed}


def acceptance(stats: list) -> float:
    drafts = sum(s.spec_decoding.num_drafts for s in stats if s.spec_decoding)
    accepted = sum(s.spec_decoding.num_accepted_tokens for s in stats if s.spec_decoding)
    return 1.0 + accepted / drafts if drafts else 1.0


def bench_method(name: str, spec: dict | None, workloads: dict, args: argparse.Namespace) -> list[dict]:
    if spec is not None and args.disable_by_batch_size != "default":
        limit = None if args.disable_by_batch_size == "none" else int(args.disable_by_batch_size)
        spec = {**spec, "disable_by_batch_size": limit}
    llm = LLM(dtype=args.dtype, speculative_config=spec)
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    rows = []
    for kind, (prompts, chat) in workloads.items():
        for batch in args.batches:
            rows.append({"method": name, "workload": kind, "batch": batch,
                         **batch_figures(llm, batches_of(prompts, batch), args.max_tokens, chat)})
            print(json.dumps(rows[-1]), flush=True)
    if args.throughput_batch:
        prompts, chat = workloads["code"]
        elapsed, tokens, stats = timed(llm, (prompts * args.throughput_batch)[:args.throughput_batch],
                                       args.max_tokens, chat)
        rows.append({"method": name, "workload": "code", "batch": args.throughput_batch,
                     "output_tok_s": tokens / elapsed, "mean_acceptance_length": acceptance(stats)})
    del llm
    gc.collect()
    return rows


def report(rows: list[dict]) -> None:
    base = {(r["workload"], r["batch"]): r for r in rows if r["method"] == "none"}
    print(f"\n{'method':<16}{'workload':<9}{'batch':>6}{'accept len':>11}{'TPOT ms':>10}{'TPOT ratio':>11}"
          f"{'tok/s':>9}{'tok/s ratio':>12}")
    for r in rows:
        b = base[(r["workload"], r["batch"])]
        tpot = f"{r['tpot_ms']:10.1f}{r['tpot_ms'] / b['tpot_ms']:11.2f}" if "tpot_ms" in r else f"{'':>21}"
        print(f"{r['method']:<16}{r['workload']:<9}{r['batch']:>6}{r['mean_acceptance_length']:>11.2f}{tpot}"
              f"{r['output_tok_s']:>9.1f}{r['output_tok_s'] / b['output_tok_s']:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--medusa", default=None, help="Medusa heads file (pagellm train-draft)")
    parser.add_argument("--eagle", default=None, help="EAGLE head file (pagellm train-draft --method eagle), or "
                        "'default' for the head shipped for the built-in model")
    parser.add_argument("--eagle-full-vocab", action="store_true", help="also: the dynamic tree over the full vocab")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts per workload")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--throughput-batch", type=int, default=32, help="0 to skip")
    parser.add_argument("--methods", nargs="*", default=None, help="subset of method names to run")
    parser.add_argument("--disable-by-batch-size", default="default",
                        help="speculative_config.disable_by_batch_size for every method: a number, 'none' (draft at "
                             "any batch size) or 'default' (the engine's)")
    args = parser.parse_args()
    if not 1 <= args.prompts <= 164 - TRAINED_CODE:
        parser.error(f"--prompts must be between 1 and {164 - TRAINED_CODE} (held-out HumanEval problems)")
    workloads = {"code": (code_prompts(args.prompts, 164 - args.prompts), False),
                 "chat": (chat_prompts(args.prompts, HELD_OUT_CHAT), True)}
    rows: list[dict] = []
    for name, spec in methods(args).items():
        if args.methods is None or name in args.methods or name == "none":
            rows.extend(bench_method(name, spec, workloads, args))
    report(rows)


if __name__ == "__main__":
    main()
