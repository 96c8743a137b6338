"""The ``random-mm`` dataset (``bench/mm_datasets.py``), under vLLM's flag names: each request one user message of
random words and its JPEG images of random pixels, their count and sizes drawn as the flags say, reproducibly."""

from __future__ import annotations

import argparse
import base64
import io

import pytest
from PIL import Image

from pagellm.bench import datasets
from pagellm.bench.serve import add_dataset_args, dataset_options


def _requests(*flags: str) -> list[datasets.BenchRequest]:
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    args = parser.parse_args(["--dataset-name", "random-mm", *flags])
    return datasets.load(args.dataset, dataset_options(args))


def _images(request: datasets.BenchRequest) -> list[Image.Image]:
    (message,) = request.messages
    urls = [part["image_url"]["url"] for part in message["content"] if part["type"] == "image_url"]
    assert all(url.startswith("data:image/jpeg;base64,") for url in urls)
    return [Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) for url in urls]


def test_counts_and_sizes_follow_vllms_flags_and_the_seed() -> None:
    flags = ["--num-prompts", "40", "--random-input-len", "12", "--random-output-len", "5",
             "--random-mm-base-items-per-request", "3", "--random-mm-num-mm-items-range-ratio", "0.5",
             "--random-mm-bucket-config", "{(24, 40, 1): 0.5, (30, 20, 1): 0.5, (720, 1280, 16): 0.0}"]
    requests = _requests(*flags)
    counts = [len(_images(r)) for r in requests]
    assert set(counts) == {1, 2, 3, 4, 5}  # floor(3 · 0.5) to ceil(3 · 1.5)
    sizes = {picture.size for r in requests for picture in _images(r)}
    assert sizes == {(40, 24), (20, 30)}  # PIL's (width, height)
    first = requests[0].messages[0]["content"]
    assert first[0]["type"] == "text" and len(first[0]["text"].split()) == 12 and requests[0].output_len == 5
    assert requests[0].prompt_len is None and requests[0].is_chat  # the server counts the image tokens
    again = _requests(*flags)
    assert [r.messages for r in again] == [r.messages for r in requests]
    urls = [p["image_url"]["url"] for r in requests for p in r.messages[0]["content"] if p["type"] == "image_url"]
    assert len(set(urls)) == len(urls)  # every image its own
    capped = _requests(*flags, "--random-mm-limit-mm-per-prompt", '{"image": 2}')
    assert {len(_images(r)) for r in capped} == {1, 2}


@pytest.mark.parametrize("flags,says", [
    (["--random-mm-bucket-config", "{(64, 64, 8): 1.0}"], "video buckets"),
    (["--random-mm-bucket-config", "{(64, 64, 1): 0.0}"], "no image bucket"),
    (["--random-mm-base-items-per-request", "3", "--random-mm-limit-mm-per-prompt", '{"image": 2}'],
     "allows 2 images, fewer than the 3"),
    (["--random-mm-num-mm-items-range-ratio", "1.5"], "from 0 to 1"),
    (["--random-mm-bucket-config", "{(64, 64): 1.0}"], r"bucket \(64, 64\): 1.0 must be \(height, width, frames\)"),
    (["--random-mm-bucket-config", "{(64, 64, 1) 1.0}"], "is not a Python literal"),
])
def test_what_cannot_be_drawn_is_refused_by_flag(flags: list[str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        _requests(*flags)
