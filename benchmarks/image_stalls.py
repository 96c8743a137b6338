"""How long a many-image prompt stalls the requests decoding beside it: images encoded as the prompt's chunks reach
them (``worker/input_batch.encode_due``) against all of them at the prompt's first step (the baseline: the engine's
behaviour before, put back for this run by replacing ``encode_due``).

SmolVLM-256M's shape (``images_vs_vllm.model_dir``: a SigLIP-B/16 encoder at 512 pixels, the built-in SmolLM2-135M
as its decoder, random weights) in bfloat16, each image one 512-pixel tile of 64 tokens (``do_image_splitting``
off). ``--streams`` text requests decode; once each has its first tokens, one prompt with ``--images`` images
arrives. The steps are driven one by one (``LLMEngine.step``) and timed: the script prints, for each variant, the
longest wait between two tokens of a text stream, the time from the image prompt's arrival to its first token, and
the whole run's time, then the ratios.

    .venv/bin/python benchmarks/image_stalls.py --images 24 --max-num-batched-tokens 512
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from images_vs_vllm import model_dir  # noqa: E402


def eager(state, model, end) -> None:  # noqa: ANN001 (encode_due's signature)
    """The baseline: every image of the request encoded at the first chunk that reaches any of them."""
    from pagellm.worker import input_batch

    input_batch.original_encode_due(state, model, 1 << 62)


def run(model: Path, lazy: bool, args: argparse.Namespace) -> dict[str, float]:
    import numpy as np
    from PIL import Image

    from pagellm import LLM, SamplingParams
    from pagellm.worker import input_batch

    if not hasattr(input_batch, "original_encode_due"):
        input_batch.original_encode_due = input_batch.encode_due
    input_batch.encode_due = input_batch.original_encode_due if lazy else eager
    llm = LLM(str(model), dtype="bfloat16", load_format="dummy", max_model_len=8192, kv_cache_memory=1 << 30,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              mm_processor_kwargs={"do_image_splitting": False})
    engine = llm.llm_engine
    pictures = [Image.fromarray((np.random.RandomState(seed).rand(512, 512, 3) * 255).astype("uint8"))
                for seed in range(args.images)]
    prompt = {"prompt": "Compare:" + "<image>" * args.images + " Which?", "multi_modal_data": {"image": pictures}}
    text = SamplingParams(temperature=0.0, max_tokens=args.text_tokens, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"text-{i}", f"Tell me story number {i}.", text)
    last: dict[str, float] = {}
    gaps: list[float] = []
    arrival = first_image_token = 0.0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id.startswith("text") and out.outputs[0].token_ids:
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                last[out.request_id] = now
            elif out.request_id == "images" and out.outputs[0].token_ids and not first_image_token:
                first_image_token = now
        if not arrival and len(last) == args.streams:
            engine.add_request("images", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            arrival = time.perf_counter()
    llm.shutdown()
    return {"max_gap": max(gaps), "image_ttft": first_image_token - arrival, "total": time.perf_counter() - start}


def main() -> None:
    cmd = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cmd.add_argument("--images", type=int, default=24)
    cmd.add_argument("--streams", type=int, default=2)
    cmd.add_argument("--text-tokens", type=int, default=160)
    cmd.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = cmd.parse_args()
    with tempfile.TemporaryDirectory(prefix="image-stalls-") as tmp:
        model = model_dir(Path(tmp))
        results = {name: run(model, lazy, args) for name, lazy in (("all at once", False), ("as reached", True))}
    for name, figures in results.items():
        print(f"{name:>12}: longest text gap {figures['max_gap']:.2f} s, image prompt's first token after "
              f"{figures['image_ttft']:.2f} s, whole run {figures['total']:.1f} s")
    before, after = results["all at once"], results["as reached"]
    print(f"longest gap {before['max_gap'] / after['max_gap']:.2f}x shorter; image TTFT ratio "
          f"{after['image_ttft'] / before['image_ttft']:.2f}; whole run ratio {after['total'] / before['total']:.2f}")


if __name__ == "__main__":
    main()
