"""pagellm beside transformers on Qwen2-VL's and Qwen2.5-VL's shapes: prompts with images, offline.

No model hub here, and vLLM cannot take these models on this machine (its Qwen2-VL processor is transformers', which
needs torchvision: none for this torch on PyPI), so the baseline is transformers itself. The model is
Qwen2-VL-2B-Instruct's published shape (``--shape qwen2-vl-2b``: a 32-layer tower of 1280, 28 decoder layers of 1536)
or Qwen2.5-VL-3B-Instruct's (``qwen2.5-vl-3b``: its windowed tower, 36 decoder layers of 2048) or Qwen3-VL-2B's
(``qwen3-vl-2b``: 24 tower layers of 1024 on 16-pixel patches, DeepStack, 28 Qwen3 layers of 2048) with random weights
(``load_format="dummy"`` for pagellm, transformers' initialisation for transformers), the built-in model's tokenizer
(so its 49k vocabulary, not Qwen's 152k) with Qwen2-VL's vision tokens, and the checkpoints' image processor. Each
prompt has one image of random pixels (its own), ``--image-size`` square: 448 pixels make 32 x 32 patches, 256
image tokens (Qwen3-VL's 28 x 28, 196). Every prompt has as many tokens, so transformers takes them as one batch
without padding (``generate``, ``--output-len`` new tokens each); pagellm takes them through ``LLM.generate``.
Each system runs in its own Python with ``--threads`` threads, bfloat16; the script prints each one's output tok/s
and time, their ratio, and the time of one image through each tower alone.

    .venv/bin/python benchmarks/qwen2_vl.py --num-prompts 8 --image-size 448 --output-len 32
    .venv/bin/python benchmarks/qwen2_vl.py --shape qwen2.5-vl-3b --tower-depth 8 --decoder-layers 8
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
RESULT = "RESULT "
PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n" \
    "<|im_start|>assistant\n"
SHAPES = {
    "qwen2-vl-2b": ("Qwen2VLForConditionalGeneration", "qwen2_vl",
                    {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2},
                    {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16, "mlp_ratio": 4}),
    "qwen2.5-vl-3b": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl",
                      {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                       "num_attention_heads": 16, "num_key_value_heads": 2},
                      {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                       "out_hidden_size": 2048, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                       "hidden_act": "silu"}),
    "qwen3-vl-2b": ("Qwen3VLForConditionalGeneration", "qwen3_vl",
                    {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
                     "num_key_value_heads": 8, "head_dim": 128},
                    {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                     "out_hidden_size": 2048, "patch_size": 16, "num_position_embeddings": 2304,
                     "deepstack_visual_indexes": [5, 11, 17], "hidden_act": "gelu_pytorch_tanh"}),
}


def model_dir(root: Path, args: argparse.Namespace) -> Path:
    sys.path.insert(0, str(REPO))
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from pagellm.model.loader import hf_model_dir

    architecture, model_type, text, tower = SHAPES[args.shape]
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_model_dir(None))
    tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    sections = [24, 20, 20] if model_type == "qwen3_vl" else [16, 24, 24]
    text = {**text, "vocab_size": len(tokenizer), "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": sections}}
    if args.decoder_layers:
        text["num_hidden_layers"] = args.decoder_layers
    tower = {**tower, "depth": args.tower_depth or tower["depth"]}
    if "deepstack_visual_indexes" in tower:  # those a shortened tower has
        tower["deepstack_visual_indexes"] = [i for i in tower["deepstack_visual_indexes"] if i < tower["depth"]]
    if model_type == "qwen3_vl":  # its released config nests its decoder's
        text = {k: v for k, v in text.items() if k not in ("rope_scaling", "rope_theta")}
        text = {"text_config": {**text, "model_type": "qwen3_vl_text", "rope_parameters": {
            "rope_type": "default", "rope_theta": 5e6, "mrope_section": sections, "mrope_interleaved": True}}}
    config = {"architectures": [architecture], "model_type": model_type, **text, "vision_config": tower,
              "vision_start_token_id": ids[0], "vision_end_token_id": ids[1], "image_token_id": ids[2],
              "video_token_id": ids[3], "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    out = root / args.shape
    tokenizer.save_pretrained(out)
    patch = int(tower.get("patch_size", 14))  # Qwen3-VL's: 16
    Qwen2VLImageProcessorPil(patch_size=patch, min_pixels=(4 * patch) ** 2,
                             max_pixels=(2 * patch) ** 2 * 1280).save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def _pictures(args: argparse.Namespace) -> list:
    import numpy as np
    from PIL import Image

    return [Image.fromarray((np.random.RandomState(seed).rand(args.image_size, args.image_size, 3) * 255)
                            .astype("uint8")) for seed in range(args.num_prompts + 1)]


def worker(args: argparse.Namespace) -> None:
    """One system's run (in its own Python): JSON on stdout after ``RESULT``."""
    sys.path.insert(0, str(REPO))
    import torch

    pictures = _pictures(args)
    if args.worker == "transformers":
        result = _transformers(args, pictures)
    else:
        from pagellm import LLM, SamplingParams

        llm = LLM(str(args.model), dtype="bfloat16", load_format="dummy", max_model_len=4096,
                  kv_cache_memory=args.kv_gib << 30)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in pictures]
        llm.generate(prompts[-1:], params, use_tqdm=False)  # warm-up: the first call's one-time costs
        start = time.perf_counter()
        outputs = llm.generate(prompts[:-1], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        inputs = llm.input_processor.process_images(PROMPT, pictures[:1]).inputs
        model = llm.engine.core.executor.worker.runner.model
        with torch.inference_mode():
            tower = min(_timed(lambda: model.image_rows(inputs)) for _ in range(2))
        result = {"elapsed": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                  "prompt_tokens": len(outputs[0].prompt_token_ids), "tower": tower}
    print(RESULT + json.dumps(result))


def _transformers(args: argparse.Namespace, pictures: list) -> dict:
    import torch
    import transformers

    from pagellm.qwen_vl_processor import QwenVLProcessor

    torch.set_num_threads(args.threads)
    config = transformers.AutoConfig.from_pretrained(args.model)
    cls = getattr(transformers, config.architectures[0])
    model = cls._from_config(config, dtype=torch.bfloat16).eval()
    processor = QwenVLProcessor(args.model)
    token = config.image_token_id

    def inputs(images: list) -> dict:
        out = processor(text=[PROMPT] * len(images), images=[[image] for image in images], return_tensors="pt")
        return {**out, "mm_token_type_ids": (out["input_ids"] == token).int(),
                "attention_mask": torch.ones_like(out["input_ids"])}

    batch = {"max_new_tokens": args.output_len, "min_new_tokens": args.output_len, "do_sample": False}
    with torch.inference_mode():
        model.generate(**inputs(pictures[-1:]), **batch)  # warm-up
        many = inputs(pictures[:-1])
        start = time.perf_counter()
        out = model.generate(**many, **batch)
        elapsed = time.perf_counter() - start
        one = inputs(pictures[:1])
        tower = min(_timed(lambda: model.get_image_features(pixel_values=one["pixel_values"],
                                                            image_grid_thw=one["image_grid_thw"])) for _ in range(2))
    new = out.shape[1] - many["input_ids"].shape[1]
    return {"elapsed": elapsed, "output_tokens": new * out.shape[0], "prompt_tokens": many["input_ids"].shape[1],
            "tower": tower}


def _timed(call) -> float:  # noqa: ANN001
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def run(system: str, model: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PAGELLM_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
    argv = [sys.executable, __file__, "--worker", system, "--model", str(model), "--num-prompts",
            str(args.num_prompts), "--output-len", str(args.output_len), "--image-size", str(args.image_size),
            "--kv-gib", str(args.kv_gib), "--threads", str(args.threads)]
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} exited {proc.returncode}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    line = next(line for line in reversed(proc.stdout.splitlines()) if line.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def main() -> None:
    cmd = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cmd.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-vl-2b")
    cmd.add_argument("--rounds", type=int, default=1)
    cmd.add_argument("--num-prompts", type=int, default=8)
    cmd.add_argument("--output-len", type=int, default=32)
    cmd.add_argument("--image-size", type=int, default=448)
    cmd.add_argument("--tower-depth", type=int, default=0, help="fewer tower layers than the shape's (0: its own)")
    cmd.add_argument("--decoder-layers", type=int, default=0, help="fewer decoder layers (0: the shape's own)")
    cmd.add_argument("--kv-gib", type=int, default=2)
    cmd.add_argument("--threads", type=int, default=2)
    cmd.add_argument("--timeout", type=float, default=3600)
    cmd.add_argument("--worker", choices=["pagellm", "transformers"], help=argparse.SUPPRESS)
    cmd.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = cmd.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="qwen2-vl-") as tmp:
        model = model_dir(Path(tmp), args)
        for round_ in range(1, args.rounds + 1):
            ours, theirs = run("pagellm", model, args), run("transformers", model, args)
            rate = [r["output_tokens"] / r["elapsed"] for r in (ours, theirs)]
            print(f"round {round_} ({args.shape}, {ours['prompt_tokens']} prompt tokens a prompt): pagellm "
                  f"{rate[0]:.1f} output tok/s ({ours['elapsed']:.1f} s), transformers {rate[1]:.1f} "
                  f"({theirs['elapsed']:.1f} s): {rate[0] / rate[1]:.2f}x; one image through the tower: "
                  f"{ours['tower']:.2f} s against {theirs['tower']:.2f} s ({theirs['tower'] / ours['tower']:.2f}x)",
                  flush=True)


if __name__ == "__main__":
    main()
