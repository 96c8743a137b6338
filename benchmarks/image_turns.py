"""A conversation's later turn with images: what the prefix cache spares (per-image block keys, no re-encoding).

SmolVLM-256M's shape (``images_vs_vllm.model_dir``: a SigLIP-B/16 encoder at 512 pixels, the built-in SmolLM2-135M
as its decoder, random weights) in bfloat16. Each conversation's first turn is a user message with one image
(``--image-size`` square: at 512 one tile of 64 image tokens, larger ones tiles plus the whole image) and the
reply; its second turn repeats them and adds a user message with a second image. The script times the second turns
(``--output-len`` tokens each, one conversation at a time) on one engine with prefix caching (the first image's
blocks reused and not encoded again) and one without (the baseline: everything prefilled and encoded again), each
engine's first turns run before, and prints both times and their ratio.

    .venv/bin/python benchmarks/image_turns.py --conversations 4 --image-size 512
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

TURN = "<|im_start|>User:<image>Describe this image.<end_of_utterance>\nAssistant:"
THEN = " It shows something.<end_of_utterance>\n<|im_start|>User:<image>And this one?<end_of_utterance>\nAssistant:"


def second_turns(model: Path, caching: bool, args: argparse.Namespace) -> float:
    """Seconds for the conversations' second turns, their first turns run before."""
    import numpy as np
    from PIL import Image

    from pagellm import LLM, SamplingParams

    llm = LLM(str(model), dtype="bfloat16", load_format="dummy", max_model_len=8192,
              kv_cache_memory=2 << 30, enable_prefix_caching=caching)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    size = args.image_size
    pictures = [Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))
                for seed in range(2 * args.conversations)]
    for i in range(args.conversations):
        llm.generate({"prompt": TURN, "multi_modal_data": {"image": pictures[2 * i]}}, params, use_tqdm=False)
    start = time.perf_counter()
    for i in range(args.conversations):
        llm.generate({"prompt": TURN + THEN, "multi_modal_data": {"image": pictures[2 * i:2 * i + 2]}}, params,
                     use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    cmd = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cmd.add_argument("--conversations", type=int, default=4)
    cmd.add_argument("--image-size", type=int, default=512)
    cmd.add_argument("--output-len", type=int, default=8)
    args = cmd.parse_args()
    with tempfile.TemporaryDirectory(prefix="image-turns-") as tmp:
        model = model_dir(Path(tmp))
        cached, uncached = second_turns(model, True, args), second_turns(model, False, args)
    print(f"second turns of {args.conversations} conversations ({args.image_size}-pixel images): prefix caching "
          f"{cached:.2f} s, without it {uncached:.2f} s: {uncached / cached:.2f}x faster")


if __name__ == "__main__":
    main()
