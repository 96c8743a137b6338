"""``pagellm bench throughput``: offline, in-process throughput of ``LLM.generate`` (or ``LLM.chat``) on a dataset,
and optionally of Hugging Face transformers ``generate()`` in static batches on the same requests (the naive
baseline), in one run.

Every request is submitted at once; the engine's own scheduler decides batching. A short warm-up runs first and
the prefix cache is reset, so the measured requests start cold. Reports requests/s, output tok/s and total tok/s.
``--profile`` (with ``--profiler-dir``) runs pagellm's requests once more, cold again, inside a torch profile, after
the measured run (whose figures it leaves alone).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

from pagellm.bench import datasets
from pagellm.bench.serve import add_dataset_args, dataset_options

BACKENDS = ("pagellm", "transformers")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pagellm.engine_args import add_engine_args

    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: built-in SmolLM2)")
    parser.add_argument("--backend", nargs="+", choices=BACKENDS, default=["pagellm"],
                        help="systems to run, in order (default: pagellm)")
    parser.add_argument("--hf-num-prompts", type=int, default=None,
                        help="transformers is slow: run it on the first N requests (default: all)")
    parser.add_argument("--hf-batch-size", type=int, default=32, help="transformers static batch size")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--result-json", "--output-json", dest="result_json", default=None,
                        help="write the result here")
    parser.add_argument("--profile", action="store_true",
                        help="after the measured run, run pagellm's requests again inside a torch profile "
                             "(needs --profiler-dir)")
    add_dataset_args(parser, seed_flag="--dataset-seed")
    add_engine_args(parser)


def _figures(system: str, requests: list[datasets.BenchRequest], elapsed: float, prompt_tokens: int,
             output_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"system": system, "num_requests": len(requests), "elapsed_s": elapsed,
            "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
            "request_throughput": len(requests) / elapsed, "output_throughput": output_tokens / elapsed,
            "total_token_throughput": (prompt_tokens + output_tokens) / elapsed, **extra}


def run_pagellm(model: str | None, requests: list[datasets.BenchRequest], temperature: float,
                engine_args: dict[str, Any], profile: bool = False) -> dict[str, Any]:
    from pagellm import LLM, SamplingParams

    llm = LLM(model, **engine_args)
    params = [SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=r.ignore_eos)
              for r in requests]
    _submit(llm, requests[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = _submit(llm, requests, params)
    elapsed = time.perf_counter() - start
    extra: dict[str, Any] = {"preemptions": sum(s.num_preemptions for s in llm.last_stats)}
    if profile:
        llm.reset_prefix_cache()
        with llm.profile() as files:
            _submit(llm, requests, params)
        extra["profile_files"] = files
    del llm
    gc.collect()
    return _figures("pagellm", requests, elapsed, sum(len(o.prompt_token_ids) for o in outputs),
                    sum(len(o.outputs[0].token_ids) for o in outputs), **extra)


def _submit(llm: Any, batch: list[datasets.BenchRequest], sampling: Any) -> list[Any]:
    """``batch`` through ``LLM.chat`` (messages) or ``LLM.generate`` (prompts), without a progress bar."""
    if batch[0].is_chat:
        return llm.chat([r.messages for r in batch], sampling, use_tqdm=False)
    return llm.generate([r.prompt for r in batch], sampling, use_tqdm=False)


def _hf_prompt_ids(tokenizer: Any, req: datasets.BenchRequest) -> list[int]:
    if req.is_chat:
        return list(tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    if isinstance(req.prompt, str):
        return tokenizer.encode(req.prompt)
    return list(req.prompt)


def run_transformers(model: str | None, requests: list[datasets.BenchRequest], temperature: float, dtype: str,
                     batch_size: int) -> dict[str, Any]:
    """Static batches of ``batch_size`` left-padded prompts through ``generate()``; each batch runs to its longest
    output (that waste is the point of the baseline)."""
    import torch
    import transformers

    from pagellm import envs
    from pagellm.model.loader import hf_model_dir

    if envs.num_threads():  # the same thread count as the engine gets (PAGELLM_NUM_THREADS)
        torch.set_num_threads(envs.num_threads())
    model_dir = hf_model_dir(model)  # transformers reads every weight as a float tensor
    torch_dtype = torch.float32 if dtype in ("auto", "float32") else getattr(torch, dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompt_tokens = output_tokens = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        ids = [_hf_prompt_ids(tokenizer, r) for r in batch]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        new = max(r.output_len for r in batch)
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
            else {"do_sample": False}
        with torch.inference_mode():
            out = hf.generate(input_ids, attention_mask=mask, max_new_tokens=new,
                              min_new_tokens=new if all(r.ignore_eos for r in batch) else 0, pad_token_id=pad,
                              **sampling)
        prompt_tokens += sum(map(len, ids))
        # Each request's own max_tokens is what it asked for; the rest of the batch's steps are waste.
        output_tokens += sum(min(r.output_len, out.shape[1] - width) for r in batch)
    elapsed = time.perf_counter() - start
    del hf
    gc.collect()
    return _figures("transformers", requests, elapsed, prompt_tokens, output_tokens, batch_size=batch_size,
                    dtype=str(torch_dtype).removeprefix("torch."))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pagellm.engine_args import engine_kwargs

    tokenizer = None
    if args.dataset == "sharegpt":  # the replies' lengths, counted by the model's own tokenizer
        from pagellm.model.loader import resolve_model_dir

        tokenizer = str(resolve_model_dir(args.model))
    if args.vocab_size is None:  # random ids from the model's own vocabulary
        args.vocab_size = datasets.model_vocab_size(args.model)
    requests = datasets.load(args.dataset, dataset_options(args, tokenizer))
    if len({r.is_chat for r in requests}) > 1:
        raise ValueError("the requests mix prompts and chat messages: the offline benchmark runs one kind "
                         "(LLM.generate or LLM.chat)")
    if args.profile and not args.profiler_dir:
        raise ValueError("--profile needs --profiler-dir DIR: where the traces go")
    engine_args = engine_kwargs(args)
    results = []
    for backend in args.backend:
        if backend == "pagellm":
            results.append(run_pagellm(args.model, requests, args.temperature, engine_args, args.profile))
        else:
            subset = requests[:args.hf_num_prompts] if args.hf_num_prompts else requests
            results.append(run_transformers(args.model, subset, args.temperature,
                                            engine_args.get("dtype", "auto"), args.hf_batch_size))
    return results


def main(args: argparse.Namespace) -> int:
    results = run(args)
    for r in results:
        print(f"{r['system']:>12}: {r['num_requests']} requests in {r['elapsed_s']:.2f} s, "
              f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} output tok/s, "
              f"{r['total_token_throughput']:.1f} total tok/s")
        for path in r.get("profile_files", []):
            print(f"{'':>12}  profiled: {path}")
    by_system = {r["system"]: r["output_throughput"] for r in results}
    if len(by_system) == 2:
        print(f"ratio pagellm / transformers (output tok/s): "
              f"{by_system['pagellm'] / by_system['transformers']:.2f}x")
    if args.result_json:
        with open(args.result_json, "w") as fh:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "bench_main"}, "results": results},
                      fh, indent=1)
    return 0
