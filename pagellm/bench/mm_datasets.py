"""``random-mm``: vLLM's random multimodal workload for ``pagellm bench serve``, under vLLM's flag names.

Each request is one user chat message: ``input_len`` (± ``range_ratio``) random words, then its images as OpenAI
``image_url`` parts, each a JPEG data URL of random pixels (every image its own, so no prefix-cache hit spares an
image; the worst case for JPEG, as vLLM's). Its image count is drawn uniformly from ``[floor(n(1 - r)),
ceil(n(1 + r))]`` (``--random-mm-base-items-per-request`` n, ``--random-mm-num-mm-items-range-ratio`` r), at most
``--random-mm-limit-mm-per-prompt``'s image count; each image's size from ``--random-mm-bucket-config``
(``{(height, width, frames): probability}``, normalised; buckets of one frame are images, and a video bucket with a
probability above 0 is refused: no video here). The prompt's length is the server's count (its usage), image tokens
included, since only the model's processor knows how many tokens an image takes.
"""

from __future__ import annotations

import argparse
import ast
import base64
import io
import json
import math
import random
from typing import Any

from pagellm.bench.datasets import BenchRequest, DatasetOptions, length

DEFAULT_BUCKETS = {(256, 256, 1): 0.5, (720, 1280, 1): 0.5, (720, 1280, 16): 0.0}  # vLLM's
DEFAULT_LIMIT = {"image": 255, "video": 1}
WORDS = ("the of and to in is that it for was on are as with his they at be this from have or by one had not but "
         "what all were when we there can an your which their said if do will each about how up out them then she "
         "many some so these would other into has more her two like him see time could no make than first been its "
         "who now people my made over did down only way find use may water long little very after words called just "
         "where most know get through back much go good new write our me man too any day same right look think also "
         "around another came come work three word must because does part even place well such here take why help "
         "put different away again off went old number great tell men say small every found still between name "
         "should home big give air line set own under read last never us left end along while might next sound below "
         "saw something thought both few those always looked show large often together asked house world going want "
         "school important until form food keep children feet land side without boy once animals life enough took "
         "sometimes four head above kind began almost live page got earth need far hand high year mother light parts "
         "country father let night following picture being study second eyes soon times story boys since white days "
         "ever paper hard near sentence better best across during today others however sure means knew its try told "
         "young miles sun ways thing whole hear example heard several change answer room sea against top turned learn "
         "point city play toward five using himself usually money seen car morning body upon family later turn move "
         "face door cut done group true half red fish plants living black eat short united states run book gave order "
         "open ground cold really table remember tree course front american space inside ago king town").split()


def add_args(group: argparse._ArgumentGroup) -> None:
    """vLLM's ``--random-mm-*`` flags."""
    group.add_argument("--random-mm-base-items-per-request", dest="mm_items", type=int, default=1,
                       help="images per request (random-mm), around which each request's count is drawn")
    group.add_argument("--random-mm-num-mm-items-range-ratio", dest="mm_items_ratio", type=float, default=0.0,
                       help="each request's image count varies uniformly by ± this fraction (0 to 1)")
    group.add_argument("--random-mm-limit-mm-per-prompt", dest="mm_limit", type=json.loads, default=DEFAULT_LIMIT,
                       help="at most this many images per request, as JSON: '{\"image\": 3}'")
    group.add_argument("--random-mm-bucket-config", dest="mm_buckets", default=repr(DEFAULT_BUCKETS),
                       help="image sizes and their probabilities: '{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}'")


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags' values for ``DatasetOptions.extra`` (the bucket config read: ValueError says what is wrong; the
    flag itself stays text, as the result's JSON keeps it)."""
    extra = {name: getattr(args, name) for name in ("mm_items", "mm_items_ratio", "mm_limit") if hasattr(args, name)}
    if getattr(args, "dataset", None) == "random-mm" and hasattr(args, "mm_buckets"):
        extra["mm_buckets"] = buckets(args.mm_buckets)
    return extra


def buckets(text: str | dict) -> dict[tuple[int, int, int], float]:
    """``--random-mm-bucket-config``: a Python literal mapping ``(height, width, frames)`` to a probability."""
    try:
        parsed = ast.literal_eval(text) if isinstance(text, str) else text
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"--random-mm-bucket-config is not a Python literal: {exc}") from None
    if not isinstance(parsed, dict) or not parsed:
        raise ValueError("--random-mm-bucket-config must map (height, width, frames) to a probability, e.g. "
                         "'{(256, 256, 1): 1.0}'")
    out = {}
    for key, probability in parsed.items():
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(x, int) and x > 0 for x in key)) \
                or not isinstance(probability, (int, float)) or probability < 0:
            raise ValueError(f"--random-mm-bucket-config: bucket {key!r}: {probability!r} must be (height, width, "
                             "frames) of positive integers to a probability >= 0")
        out[key] = float(probability)
    return out


def random_mm_requests(opts: DatasetOptions) -> list[BenchRequest]:
    import numpy as np

    sizes, weights = _image_buckets(opts.extra.get("mm_buckets", DEFAULT_BUCKETS))
    low, high = _count_range(opts.extra)
    rng, pixels = random.Random(opts.seed), np.random.default_rng(opts.seed)
    out = []
    for _ in range(opts.num_prompts):
        text = " ".join(rng.choice(WORDS) for _ in range(length(rng, opts.input_len, opts.range_ratio)))
        parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
        for _ in range(rng.randint(low, high)):
            height, width = rng.choices(sizes, weights)[0]
            parts.append({"type": "image_url", "image_url": {"url": _jpeg(pixels, height, width)}})
        out.append(BenchRequest(None, length(rng, opts.output_len, opts.range_ratio),
                                messages=[{"role": "user", "content": parts}]))
    return out


def _image_buckets(config: dict[tuple[int, int, int], float]) -> tuple[list[tuple[int, int]], list[float]]:
    if any(frames > 1 and p > 0 for (_, _, frames), p in config.items()):
        raise ValueError("--random-mm-bucket-config: video buckets (frames > 1) are not supported; give them "
                         "probability 0")
    images = {(h, w): p for (h, w, frames), p in config.items() if frames == 1 and p > 0}
    if not images:
        raise ValueError("--random-mm-bucket-config gives no image bucket a probability above 0")
    return list(images), list(images.values())


def _count_range(extra: dict[str, Any]) -> tuple[int, int]:
    """The least and most images a request takes (vLLM's rule)."""
    base, ratio = int(extra.get("mm_items", 1)), float(extra.get("mm_items_ratio", 0.0))
    limit = extra.get("mm_limit", DEFAULT_LIMIT)
    if not isinstance(limit, dict) or not isinstance(limit.get("image", 0), int):
        raise ValueError('--random-mm-limit-mm-per-prompt must be a JSON object such as {"image": 3}')
    if base < 0 or not 0.0 <= ratio <= 1.0:
        raise ValueError("--random-mm-base-items-per-request must be >= 0 and --random-mm-num-mm-items-range-ratio "
                         "from 0 to 1")
    low, high = math.floor(base * (1 - ratio)), min(math.ceil(base * (1 + ratio)), int(limit.get("image", 0)))
    if low > high:
        raise ValueError(f"--random-mm-limit-mm-per-prompt allows {high} images, fewer than the {low} each request "
                         "takes at least")
    return low, high


def _jpeg(pixels: Any, height: int, width: int) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels.integers(0, 256, (height, width, 3), dtype="uint8")).save(buffer, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
