"""vLLM's v1 scheduler on the synthetic trace of sched_trace.py, timed per step (run with the .peers/vllm python).

Builds vLLM's own ``Scheduler`` in-process (no model, no workers: a KV pool of ``sched_trace.num_blocks`` blocks
for one full-attention layer), keeps ``num_running`` requests in it, and times ``schedule()`` +
``update_from_output()`` with a fake runner output (one token for each request whose prompt is done, none for a
prefill chunk), and apart from them the step's arrivals (building each ``Request``, which hashes its blocks, and
``add_request``). Prints one JSON line per size: {"num_running", "steps", "mean_us", "p50_us", "p95_us",
"arrivals_us_per_step", ...}.

    .peers/vllm/bin/python benchmarks/peers/vllm_scheduler_bench.py MODEL_DIR --num-running 64 256 1024
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sched_trace as trace  # noqa: E402


def build_scheduler(model_dir: str, num_running: int):
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = EngineArgs(model=model_dir, max_num_seqs=num_running, max_num_batched_tokens=trace.TOKEN_BUDGET,
                        enable_prefix_caching=True, block_size=trace.BLOCK_SIZE, max_model_len=2048,
                        dtype="bfloat16").create_engine_config()
    spec = FullAttentionSpec(block_size=trace.BLOCK_SIZE, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    kv_config = KVCacheConfig(num_blocks=trace.num_blocks(num_running), kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    config.cache_config.num_gpu_blocks = kv_config.num_blocks  # what the engine sets after profiling memory
    return Scheduler(config, kv_config, StructuredOutputManager(config), block_size=trace.BLOCK_SIZE,
                     log_stats=False)


def make_request(i: int, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if not getattr(make_request, "hasher", None):
        init_none_hash(sha256)
        make_request.hasher = get_request_block_hasher(trace.BLOCK_SIZE, sha256)
    params = SamplingParams(max_tokens=trace.output_len(i), ignore_eos=True)
    return Request(f"r{i}", prompt, params, None, arrival_time=time.time(),
                   block_hasher=make_request.hasher)


def fake_output(scheduler, out):
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        sampled.append([trace.SAMPLED_TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled)


def run(model_dir: str, num_running: int, warmup: int, steps: int) -> dict:
    scheduler = build_scheduler(model_dir, num_running)
    next_id, times, adds, running, tokens = 0, [], [], [], []
    for step in range(warmup + steps):
        add_time = 0.0
        while len(scheduler.requests) < num_running:
            prompt = trace.prompt(next_id)
            t = time.perf_counter()
            scheduler.add_request(make_request(next_id, prompt))  # building the Request hashes its blocks
            add_time += time.perf_counter() - t
            next_id += 1
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        runner_out = fake_output(scheduler, out)
        t2 = time.perf_counter()
        scheduler.update_from_output(out, runner_out)
        t3 = time.perf_counter()
        if step >= warmup:
            times.append((t1 - t0) + (t3 - t2))
            adds.append(add_time)
            running.append(len(out.num_scheduled_tokens))
            tokens.append(out.total_num_scheduled_tokens)
    us = sorted(t * 1e6 for t in times)
    return {"system": "vLLM", "num_running": num_running, "steps": steps, "mean_us": statistics.mean(us),
            "p50_us": us[len(us) // 2], "p95_us": us[int(len(us) * 0.95)],
            "arrivals_us_per_step": statistics.mean(adds) * 1e6, "mean_scheduled_reqs": statistics.mean(running),
            "mean_scheduled_tokens": statistics.mean(tokens),
            "requests_started": next_id}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("--num-running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    for n in args.num_running:
        print(json.dumps(run(args.model_dir, n, args.warmup, args.steps)), flush=True)


if __name__ == "__main__":
    main()
