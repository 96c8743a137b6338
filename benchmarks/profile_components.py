"""Where the time goes: the throughput workload with wall-clock timers around each engine component.

Wraps (in this process only) the scheduler, input building, the model's GEMM layers, attention, the LM head and
the sampler, runs N prompts × input/output lengths, and prints seconds and share per component. The timers add a
little overhead of their own; use benchmarks/throughput.py for the headline figure.

    .venv/bin/python benchmarks/profile_components.py [--dtype bfloat16] [--num-prompts 256]
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from typing import Any, Callable


TIMES: dict[str, float] = collections.defaultdict(float)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - start
    return wrapper


def instrument(llm: Any) -> None:
    import pagellm.model.layers.linear as linear
    import pagellm.worker.model_runner as model_runner
    from pagellm.model import llama

    core = llm.engine.core
    runner = core.executor.worker.runner
    core.scheduler.schedule = timed("scheduler.schedule", core.scheduler.schedule)
    core.scheduler.update_from_output = timed("scheduler.update", core.scheduler.update_from_output)
    model_runner.build_step_inputs = timed("runner.build_inputs", model_runner.build_step_inputs)
    runner.backend.build = timed("attention.metadata", runner.backend.build)
    runner.backend.forward = timed("attention (write KV + attend)", runner.backend.forward)
    linear.linear = timed("linear layers (GEMM)", linear.linear)
    runner.model.compute_logits = timed("lm_head (GEMM)", runner.model.compute_logits)
    runner._sample = timed("sampling", runner._sample)
    runner.execute_model = timed("runner.execute_model (total)", runner.execute_model)
    llama.LlamaModel.forward = timed("model.forward (total)", llama.LlamaModel.forward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = parser.parse_args()
    from pagellm import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    from pagellm.bench import datasets

    opts = datasets.DatasetOptions(args.num_prompts, args.input_len, args.output_len, range_ratio=0.0)
    prompts = [r.prompt for r in datasets.random_requests(opts)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    instrument(llm)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True),
                 use_tqdm=False)
    total = time.perf_counter() - start
    print(f"total {total:.1f}s, {args.num_prompts * args.output_len / total:.1f} output tok/s")
    for name, seconds in sorted(TIMES.items(), key=lambda item: -item[1]):
        print(f"  {name:32s} {seconds:7.2f}s  {100 * seconds / total:5.1f}%")


if __name__ == "__main__":
    main()
