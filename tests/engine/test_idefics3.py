"""Images in prompts (``multimodal.py``, ``model/idefics3.py``): a tiny random Idefics3 (SmolVLM's architecture: a
SigLIP encoder, a pixel-shuffle connector, a Llama decoder) built here with transformers, its processor splitting
each image into 32-pixel tiles of 4 image tokens each plus a whole-image tile.

The encoder's rows must be transformers' ``get_image_features``, padded tiles included; greedy tokens must be
transformers' ``generate`` on the same processor's inputs in float32, whole or in prefill chunks that cut images
apart; the same image hits the prefix cache and another never does; what cannot be served is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

from pagellm import LLM, SamplingParams
from pagellm.engine.wire import EngineCoreRequest

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + \
    [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]


def _image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def vlm(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("idefics3")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = transformers.Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4)
    text = {k: v for k, v in json.loads((tiny_llama / "config.json").read_text()).items()
            if k not in ("architectures", "dtype", "torch_dtype")}
    config = transformers.Idefics3Config(
        text_config=text, scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8}, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Idefics3ForConditionalGeneration(config).eval().save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(vlm: Path) -> transformers.PreTrainedModel:
    return transformers.Idefics3ForConditionalGeneration.from_pretrained(vlm, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(vlm: Path) -> LLM:
    return LLM(str(vlm), dtype="float32", kv_cache_memory=1 << 24)


PROMPTS = [("Look: <image> what?", [(0, 40, 56)]), ("Two <image> and <image> here", [(1, 47, 51), (2, 54, 46)]),
           ("Look: <image> what?", [(1, 47, 51)])]


def _prompts() -> list[tuple[str, list[Image.Image]]]:
    return [(text, [_image(*spec) for spec in specs]) for text, specs in PROMPTS]


def _transformers_tokens(vlm: Path, reference, text: str, images: list[Image.Image]) -> list[int]:
    inputs = transformers.AutoProcessor.from_pretrained(vlm)(text=[text], images=[images], return_tensors="pt")
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_image_rows_are_transformers_image_features_padded_tiles_included(vlm: Path, reference, llm: LLM) -> None:
    """Tiles padded past their image (a partial ``pixel_attention_mask``, as transformers pads a batch's images to
    one size: the padding is masked out of the attention and the positions) and an all-zero padding tile (dropped)
    give transformers' rows."""
    processor = transformers.AutoProcessor.from_pretrained(vlm)
    model = llm.engine.core.executor.worker.runner.model
    inputs = processor(text=["<image> <image>"], images=[[_image(3, 30, 62), _image(4, 61, 23)]], return_tensors="pt")
    pixels, mask = inputs["pixel_values"].clone(), inputs["pixel_attention_mask"].clone()
    mask[0, 1, :, 20:] = 0  # the second tile's image ends after 20 columns, the third's after 13 rows
    mask[0, 2, 13:, :] = 0
    pixels[~mask[:, :, None].expand_as(pixels).bool()] = 0
    pixels, mask = torch.cat([pixels, torch.zeros_like(pixels[:, :1])], 1), torch.cat([mask, mask[:, :1]], 1)
    with torch.no_grad():
        theirs = torch.cat(list(reference.model.get_image_features(pixels, mask).pooler_output))
    ours = model.encode_images(pixels[0], mask[0])
    assert ours.shape == (4 * (pixels.shape[1] - 1), 64)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [4096, 16])
def test_greedy_tokens_equal_transformers_whole_and_chunked(vlm: Path, reference, chunk: int) -> None:
    """At 16 tokens a step the prompts' images are prefilled in pieces (each image has 20 image tokens)."""
    llm = LLM(str(vlm), dtype="float32", kv_cache_memory=1 << 24, max_num_batched_tokens=chunk)
    prompts = _prompts()
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts],
                           GREEDY, use_tqdm=False)
    for (text, images), output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == _transformers_tokens(vlm, reference, text, images)
        assert output.prompt == text


def test_the_same_image_hits_the_prefix_cache_and_another_never_does(llm: LLM) -> None:
    text, (image,) = _prompts()[0]
    first, again = (llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
                    for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": _image(9, 40, 56)}}, GREEDY,
                         use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids != first.outputs[0].token_ids


def test_what_cannot_be_served_is_refused_by_name(llm: LLM, vlm: Path, tiny_llama: Path) -> None:
    image = _image(0, 40, 56)
    with pytest.raises(ValueError, match="the prompt has 2 <image> placeholders for 1 images"):
        llm.generate({"prompt": "<image> <image>", "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data takes {'image'"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"video": image}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens cannot cut a prompt with images"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": image}},
                     SamplingParams(max_tokens=2, truncate_prompt_tokens=8), use_tqdm=False)
    image_token = json.loads((vlm / "config.json").read_text())["image_token_id"]
    with pytest.raises(ValueError, match="a prompt's image tokens and its images come together"):
        llm.engine.core.add_request(EngineCoreRequest("typed", [5, image_token, 6], GREEDY, [], 0.0))
    text_only = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="this model takes no images; serve a vision-language model"):
        text_only.generate({"prompt": "<image>", "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
