"""What a LoRA adapter costs: offline output tokens/s of the same prompts without adapters (the native stack), all
with one adapter, and half with each of two (mixed batches), in one run, on one engine.

Adapters are random PEFT adapters of the model (rank ``--rank`` on all seven projections) made with ``peft`` (a test
dependency). Prints each side's tokens/s and its ratio to the plain run.

    .venv/bin/python benchmarks/lora.py [--model PATH] [--num-prompts 64] [--input-len 128] [--output-len 64]
        [--rank 16] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lora_utils import build_lora_adapter  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    from pagellm import LLM, SamplingParams
    from pagellm.lora import LoRARequest
    from pagellm.model.loader import hf_model_dir

    model_dir = hf_model_dir(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"a{i}", i + 1, str(build_lora_adapter(model_dir, Path(tmp) / f"a{i}", i, PROJECTIONS,
                                                                      args.rank))) for i in range(2)]
        llm = LLM(args.model, dtype=args.dtype, enable_lora=True)
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, 10_000, (args.num_prompts, args.input_len), generator=gen).tolist()
        params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=0)
        sides = {"no adapter": None, "one adapter": loras[0],
                 "two adapters, mixed": [loras[i % 2] for i in range(args.num_prompts)]}
        llm.generate(prompts[:4], params, use_tqdm=False, lora_request=loras[0])  # warm-up, adapter loaded
        rates = {}
        for name, routing in sides.items():
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=routing)
            rates[name] = args.num_prompts * args.output_len / (time.perf_counter() - start)
    base = rates["no adapter"]
    print(f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, {args.dtype}, rank {args.rank}")
    for name, rate in rates.items():
        print(f"{name:22s} {rate:8.1f} output tok/s  {rate / base:5.2f}x")


if __name__ == "__main__":
    main()
