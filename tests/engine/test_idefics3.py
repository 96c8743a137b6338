"""Images in prompts (``multimodal.py``, ``model/idefics3.py``): a tiny random Idefics3 (SmolVLM's architecture: a
SigLIP encoder, a pixel-shuffle connector, a Llama decoder) built here with transformers, its processor splitting
each image into 32-pixel tiles of 4 image tokens each plus a whole-image tile.

The encoder's rows must be transformers' ``get_image_features``, padded tiles included; greedy tokens must be
transformers' ``generate`` on the same processor's inputs in float32, whole or in prefill chunks that cut images
apart; the same image hits the prefix cache and another never does; what cannot be served is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image
from vlm_utils import build_vlm, data_url, image, png

from pagellm import LLM, SamplingParams
from pagellm.engine.wire import EngineCoreRequest
from pagellm.tokenizer import Tokenizer

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
_image = image


@pytest.fixture(scope="module")
def vlm(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vlm(tiny_llama, tmp_path_factory.mktemp("idefics3"))


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
    with pytest.raises(ValueError, match="image embeddings are taken by LLaVA models; send this model the images"):
        LLM(str(vlm), dtype="float32", kv_cache_memory=1 << 22, enable_mm_embeds=True).generate(
            {"prompt": "<image>", "multi_modal_data": {"image": torch.zeros(4, 64)}}, GREEDY, use_tqdm=False)
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


def test_chat_with_image_parts_equals_transformers_on_the_rendered_prompt(vlm: Path, reference, llm: LLM) -> None:
    """``LLM.chat``'s image parts (a data URL here) become the template's placeholders and the processor's images;
    the rendered prompt's own special tokens are all it gets (none added), as a text chat's."""
    picture = _image(5, 44, 60)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": data_url(picture)}}]}]
    output = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = Tokenizer.from_dir(vlm).render_chat(messages, image_placeholder="<image>")
    assert text.count("<image>") == 1 and "What is this?" in text
    inputs = transformers.AutoProcessor.from_pretrained(vlm)(text=[text], images=[[picture]], return_tensors="pt",
                                                             add_special_tokens=False)
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = reference.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    assert output.outputs[0].token_ids == expected[0, inputs["input_ids"].shape[1]:].tolist()


def test_two_tensor_parallel_ranks_give_one_ranks_tokens(vlm: Path, llm: LLM) -> None:
    """Each rank runs the whole encoder (it is replicated) and places its rows in its shard of the decoder."""
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in _prompts()]
    ranks = LLM(str(vlm), dtype="float32", kv_cache_memory=1 << 24, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in ranks.generate(prompts, GREEDY, use_tqdm=False)] == \
            [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        ranks.shutdown()  # rank 0's process group lives in this process: it goes with the engine


def test_limit_mm_per_prompt_caps_a_prompts_images(vlm: Path, llm: LLM, tmp_path: Path) -> None:
    """vLLM's --limit-mm-per-prompt: a prompt with more images than the limit is refused, one within it runs.
    Offline chat reads file:// images under allowed_local_media_path: the reply is the data URL's."""
    (tmp_path / "cat.png").write_bytes(png(_image(1, 47, 51)))
    capped = LLM(str(vlm), dtype="float32", kv_cache_memory=1 << 22, limit_mm_per_prompt='{"image": 1}',
                 allowed_local_media_path=str(tmp_path))
    chats = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
             for url in (f"file://{tmp_path}/cat.png", data_url(_image(1, 47, 51)))]
    assert capped.chat(chats[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.chat(chats[1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    (text, two), (one_text, one) = _prompts()[1], _prompts()[0]
    with pytest.raises(ValueError, match=r"the prompt has 2 images; this engine takes at most 1 per prompt"):
        capped.generate({"prompt": text, "multi_modal_data": {"image": two}}, GREEDY, use_tqdm=False)
    assert capped.generate({"prompt": one_text, "multi_modal_data": {"image": one}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="limit_mm_per_prompt takes counts >= 0 of image, video or audio"):
        LLM(str(vlm), limit_mm_per_prompt={"images": 1})


def test_each_image_is_counted_and_keyed_by_its_own_pixels(llm: LLM) -> None:
    """The processor's per-image token counts (its tiles' tokens each) and a digest of each image's pixels, which
    key each image's blocks in the prefix cache (``tests/engine/test_llava.py`` shows the sharing)."""
    (text, (first, second)), again = _prompts()[1], _image(1, 47, 51)
    tokens = llm.input_processor.process_images(text, [first, second])
    image_token = llm.engine.core.runtime.image_token_id
    assert [count for _, count in tokens.inputs.items] == [20, 20] == [list(tokens).count(image_token) // 2] * 2
    digests = [digest for digest, _ in tokens.inputs.items]
    assert digests[0] != digests[1]
    assert llm.input_processor.process_images(text, [again, second]).inputs.items[0][0] == digests[0]


def test_a_later_turn_encodes_only_its_new_images_tiles(vlm: Path, reference) -> None:
    """The first image's tiles are in the prefix cache's blocks: only the new image's five tiles are encoded, and
    the reply is still transformers'."""
    llm = LLM(str(vlm), dtype="float32", kv_cache_memory=1 << 24)
    vision, encoded = llm.engine.core.executor.worker.runner.model.vision, []
    forward = vision.forward
    vision.forward = lambda pixels, mask: encoded.append(int((pixels != 0).flatten(1).any(1).sum())) or \
        forward(pixels, mask)
    first = "Look: <image> what is it? It is a picture of something, seen from afar. And"
    later, a, b = first + " this one: <image> now?", _image(0, 40, 56), _image(2, 54, 46)
    llm.generate({"prompt": first, "multi_modal_data": {"image": a}}, GREEDY, use_tqdm=False)
    output = llm.generate({"prompt": later, "multi_modal_data": {"image": [a, b]}}, GREEDY, use_tqdm=False)[0]
    assert encoded == [5, 5] and output.num_cached_tokens > 30
    assert output.outputs[0].token_ids == _transformers_tokens(vlm, reference, later, [a, b])


def test_mm_processor_kwargs_reach_the_processor_and_key_the_images(vlm: Path, reference) -> None:
    """vLLM's ``mm_processor_kwargs``, the engine's default (``--mm-processor-kwargs``) and a prompt's own over it:
    ``do_image_splitting: false`` makes each image one tile; the tokens are transformers' on the same processor
    call, and an image processed otherwise is keyed apart in the prefix cache."""
    whole = {"do_image_splitting": False}
    llm = LLM(str(vlm), dtype="float32", kv_cache_memory=1 << 24, mm_processor_kwargs=whole)
    text, (picture,) = _prompts()[0]
    one_tile = llm.generate({"prompt": text, "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)[0]
    split = llm.generate({"prompt": text, "multi_modal_data": {"image": picture},
                          "mm_processor_kwargs": {"do_image_splitting": True}}, GREEDY, use_tqdm=False)[0]
    image_token = llm.engine.core.runtime.image_token_id
    assert one_tile.prompt_token_ids.count(image_token) == 4 < split.prompt_token_ids.count(image_token) == 20
    processor = transformers.AutoProcessor.from_pretrained(vlm)
    inputs = processor(text=[text], images=[[picture]], return_tensors="pt", **whole)
    with torch.no_grad():
        expected = reference.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    assert one_tile.outputs[0].token_ids == expected[0, inputs["input_ids"].shape[1]:].tolist()
    assert split.outputs[0].token_ids == _transformers_tokens(vlm, reference, text, [picture])
    keyed = [llm.input_processor.process_images(text, [picture], kwargs=kwargs).inputs.items[0][0]
             for kwargs in (None, {"do_image_splitting": True})]
    assert keyed[0] != keyed[1]
    with pytest.raises(ValueError, match="mm_processor_kwargs must be an object"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": picture}, "mm_processor_kwargs": [1]}, GREEDY)
