"""Embedding throughput: ``LLM.embed`` (last-token pooling through the engine) against transformers' ``AutoModel``
forward in static batches, on the same random prompts, in one run. Prints prompts/s and prompt tokens/s of each and
their ratio, and the largest difference between the two systems' normalised embeddings.

    .venv/bin/python benchmarks/embed.py [--model PATH] [--num-prompts 256] [--input-len 128] [--dtype bfloat16]
        [--hf-batch 32]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face directory or GGUF (default: the built-in model)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--hf-batch", type=int, default=32, help="transformers' static batch size")
    args = parser.parse_args()

    from transformers import AutoModel

    from pagellm import LLM
    from pagellm.model.loader import hf_model_dir

    llm = LLM(args.model, dtype=args.dtype)
    gen = torch.Generator().manual_seed(0)
    # random ids below 10,000: ordinary tokens in every vocabulary of the served families
    prompts = torch.randint(100, 10_000, (args.num_prompts, args.input_len), generator=gen).tolist()
    llm.embed(prompts[:8], use_tqdm=False)  # warm-up (kernels, first touches)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    ours = llm.embed(prompts, use_tqdm=False)
    ours_s = time.perf_counter() - start

    model = AutoModel.from_pretrained(hf_model_dir(args.model), dtype=getattr(torch, args.dtype)).eval()
    refs = []
    with torch.inference_mode():
        model(torch.tensor(prompts[:8]))  # warm-up
        start = time.perf_counter()
        for i in range(0, len(prompts), args.hf_batch):
            hidden = model(torch.tensor(prompts[i:i + args.hf_batch])).last_hidden_state[:, -1].float()
            refs.append(hidden / hidden.norm(dim=-1, keepdim=True))
        hf_s = time.perf_counter() - start
    diff = (torch.tensor([o.embedding for o in ours]) - torch.cat(refs)).abs().max().item()
    tokens = args.num_prompts * args.input_len
    print(f"{args.num_prompts} prompts x {args.input_len} tokens, {args.dtype}")
    print(f"pagellm      {args.num_prompts / ours_s:8.1f} prompts/s {tokens / ours_s:9.0f} tokens/s ({ours_s:.2f} s)")
    print(f"transformers {args.num_prompts / hf_s:8.1f} prompts/s {tokens / hf_s:9.0f} tokens/s ({hf_s:.2f} s, "
          f"batches of {args.hf_batch})")
    print(f"ratio {hf_s / ours_s:.2f}x; largest difference between the normalised embeddings {diff:.2e}")


if __name__ == "__main__":
    main()
