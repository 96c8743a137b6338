"""pagellm beside vLLM on prompts with images: SmolVLM-256M's shape, offline, one image per prompt.

No model hub here: the model is SmolVLM-256M-Instruct's published shape (a SigLIP-B/16 encoder at 512 pixels, 12
layers of 768, a pixel shuffle by 4, the built-in SmolLM2-135M as its decoder) with random weights
(``--load-format dummy`` on both sides), the built-in model's tokenizer with Idefics3's image tokens, and
Idefics3's processor (512-pixel tiles of 64 image tokens). Each prompt is a chat turn with one image of random
pixels (its own: no prefix-cache hits), ``--image-size`` square (at 512, one tile; larger ones split into tiles plus
the whole image). For each round pagellm's ``LLM.generate`` and vLLM's (``.peers/vllm``, ``make peers``) run back to
back in their own processes on the same prompts, dtype and thread count, through the same call (both take
``{"prompt": text, "multi_modal_data": {"image": image}}``); the script prints each one's output tok/s, its time to
process the images and prompts (from start to the last output, ``--output-len`` tokens each), and their ratio.

    .venv/bin/python benchmarks/images_vs_vllm.py --rounds 2 --num-prompts 16 --image-size 512
    .venv/bin/python benchmarks/images_vs_vllm.py --mm-processor-kwargs '{"do_image_splitting": false}'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".peers" / "vllm" / "bin" / "python"
RESULT = "RESULT "  # the worker's line of figures (vLLM logs to stdout too)
PROMPT = "<|im_start|>User:<image>Describe this image.<end_of_utterance>\nAssistant:"
SIGLIP_B16_512 = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "image_size": 512, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}


def model_dir(root: Path) -> Path:
    """SmolVLM-256M's shape over the built-in model's decoder config and tokenizer."""
    sys.path.insert(0, str(REPO))
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from pagellm.model.loader import hf_model_dir

    builtin = hf_model_dir(None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(builtin)
    tokens = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + \
        [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    images = Idefics3ImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512})
    processor = transformers.Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=64)
    text = {k: v for k, v in json.loads((builtin / "config.json").read_text()).items()
            if k not in ("architectures", "torch_dtype", "dtype", "quantization_config")}
    text["vocab_size"] = max(int(text["vocab_size"]), len(tokenizer))
    config = {"architectures": ["Idefics3ForConditionalGeneration"], "model_type": "idefics3", "scale_factor": 4,
              "image_token_id": tokenizer.convert_tokens_to_ids("<image>"), "text_config": text,
              "vision_config": {**SIGLIP_B16_512, "model_type": "idefics3_vision"}, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16"}
    out = root / "smolvlm-256m-shape"
    processor.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def worker(args: argparse.Namespace) -> None:
    """One system's run (in its own Python): the prompts through its ``LLM.generate``, timed; JSON on stdout after ``RESULT``."""
    import numpy as np
    from PIL import Image

    pictures = [Image.fromarray((np.random.RandomState(seed).rand(args.image_size, args.image_size, 3) * 255)
                                .astype("uint8")) for seed in range(args.num_prompts)]
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": picture}} for picture in pictures]
    if args.worker == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(str(args.model), dtype="bfloat16", load_format="dummy", max_model_len=args.max_model_len,
                  limit_mm_per_prompt={"image": 1}, mm_processor_kwargs=json.loads(args.mm_processor_kwargs))
    else:
        sys.path.insert(0, str(REPO))
        from pagellm import LLM, SamplingParams

        llm = LLM(str(args.model), dtype="bfloat16", load_format="dummy", max_model_len=args.max_model_len,
                  kv_cache_memory=args.kv_gib << 30, mm_processor_kwargs=json.loads(args.mm_processor_kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up: the first call's one-time costs
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print(RESULT + json.dumps({"elapsed": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                      "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs)}))


def run(system: str, model: Path, args: argparse.Namespace) -> dict:
    python = VLLM_PYTHON if system == "vllm" else REPO / ".venv" / "bin" / "python"
    env = {**os.environ, "PAGELLM_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    argv = [str(python), __file__, "--worker", system, "--model", str(model), "--num-prompts", str(args.num_prompts),
            "--output-len", str(args.output_len), "--image-size", str(args.image_size), "--max-model-len",
            str(args.max_model_len), "--kv-gib", str(args.kv_gib),
            "--mm-processor-kwargs", args.mm_processor_kwargs]
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} exited {proc.returncode}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith(RESULT))[len(RESULT):])


def main() -> None:
    cmd = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cmd.add_argument("--rounds", type=int, default=2)
    cmd.add_argument("--num-prompts", type=int, default=16)
    cmd.add_argument("--output-len", type=int, default=32)
    cmd.add_argument("--image-size", type=int, default=512)
    cmd.add_argument("--max-model-len", type=int, default=4096)
    cmd.add_argument("--kv-gib", type=int, default=2)
    cmd.add_argument("--threads", type=int, default=2)
    cmd.add_argument("--timeout", type=float, default=1800)
    cmd.add_argument("--mm-processor-kwargs", default="{}",
                     help="the processor's keyword arguments on both sides, as JSON: '{\"do_image_splitting\": false}'")
    cmd.add_argument("--worker", choices=["pagellm", "vllm"], help=argparse.SUPPRESS)
    cmd.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = cmd.parse_args()
    if args.worker:
        worker(args)
        return
    if not VLLM_PYTHON.exists():
        sys.exit(f"vLLM is not installed at {VLLM_PYTHON}: run `make peers`")
    with tempfile.TemporaryDirectory(prefix="images-") as tmp:
        model = model_dir(Path(tmp))
        for round_ in range(1, args.rounds + 1):
            ours, theirs = run("pagellm", model, args), run("vllm", model, args)
            rate = [r["output_tokens"] / r["elapsed"] for r in (ours, theirs)]
            print(f"round {round_}: pagellm {rate[0]:.1f} output tok/s ({ours['elapsed']:.1f} s, "
                  f"{ours['prompt_tokens']} prompt tokens), vLLM {rate[1]:.1f} ({theirs['elapsed']:.1f} s, "
                  f"{theirs['prompt_tokens']}): {rate[0] / rate[1]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
