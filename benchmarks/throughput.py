"""Offline throughput: pagellm vs transformers ``generate()`` on the same model, prompts and machine, one run.

Workload (as vLLM's throughput benchmark): N prompts of random token ids, fixed input and output lengths, EOS
ignored, temperature 1.0. transformers runs static batches (default 32, left-padded). Prints output tokens/s of
each system and their ratio, for each dtype. Usage:

    .venv/bin/python benchmarks/throughput.py [--dtypes bfloat16 float32] [--num-prompts 256] [--hf-num-prompts 64]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Skip the first ids (special tokens in most vocabularies) so prompts are ordinary text tokens.
    return torch.randint(100, vocab, (num, length), generator=gen).tolist()


def bench_pagellm(dtype: str, prompts: list[list[int]], output_len: int, engine_args: dict) -> dict:
    from pagellm import LLM, SamplingParams

    llm = LLM(dtype=dtype, **engine_args)
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True, seed=None)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    preemptions = sum(s.num_preemptions for s in llm.last_stats)
    del llm
    gc.collect()
    return {"system": "pagellm", "dtype": dtype, "seconds": elapsed, "output_tokens": generated,
            "output_tok_s": generated / elapsed, "total_tok_s": (generated + sum(map(len, prompts))) / elapsed,
            "preemptions": preemptions}


def bench_transformers(dtype: str, prompts: list[list[int]], output_len: int, batch_size: int) -> dict:
    import transformers

    from pagellm.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(None)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = torch.tensor(prompts[i:i + batch_size])  # equal lengths: no padding needed
        with torch.inference_mode():
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=output_len, min_new_tokens=output_len,
                                 pad_token_id=0)
        generated += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return {"system": "transformers", "dtype": dtype, "seconds": elapsed, "output_tokens": generated,
            "output_tok_s": generated / elapsed, "batch_size": batch_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--hf-num-prompts", type=int, default=64, help="transformers is slow: a subset of whole "
                        "static batches measures its steady rate (0 skips it)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=4 << 30,
                        help="bytes; 4 GiB holds the whole float32 workload without preemption")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    prompts = make_prompts(args.num_prompts, args.input_len, vocab=49152)
    engine_args = {"max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory}
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    results = []
    for dtype in args.dtypes:
        ours = bench_pagellm(dtype, prompts, args.output_len, engine_args)
        results.append(ours)
        print(json.dumps(ours), flush=True)
        if args.hf_num_prompts:
            ref = bench_transformers(dtype, prompts[:args.hf_num_prompts], args.output_len, args.hf_batch_size)
            results.append(ref)
            print(json.dumps(ref), flush=True)
            print(f"{dtype}: pagellm {ours['output_tok_s']:.1f} out tok/s, transformers {ref['output_tok_s']:.1f}"
                  f" out tok/s, ratio {ours['output_tok_s'] / ref['output_tok_s']:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
