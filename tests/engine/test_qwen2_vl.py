"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (``model/qwen2_vl.py``, ``model/qwen3_vl.py``): tiny random models built here
with transformers (``vlm_utils.build_qwen2_vl``: a Qwen2-VL tower of LayerNorms and a fc1/fc2 MLP, Qwen2.5-VL's of
RMSNorms, a gated MLP and windows of 2 x 2 merge blocks, over a tiny Qwen2 decoder; Qwen3-VL's with learned
positions resampled to each image and DeepStack rows from two blocks, over a tiny Qwen3 decoder; M-RoPE sections 2,
3, 3, interleaved in Qwen3-VL), images resized by the checkpoint's image processor to 4-16 merged blocks, one image
token each.

The tower's rows (and Qwen3-VL's DeepStack rows) must be transformers' ``get_image_features``; the prompt's three
positions a token transformers' ``get_rope_index``; greedy tokens, and the logprobs of every one of them (each step's
positions past the prompt shifted by its delta), transformers' ``generate`` in float32, whole or in chunks that end
inside images, after a prefix-cache hit on the first image, and on two tensor-parallel ranks; the released
checkpoints' configs and both name layouts load the same model."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from vlm_utils import build_qwen2_vl, data_url, image

from pagellm import LLM, SamplingParams
from pagellm.model.arch import ArchConfig
from pagellm.qwen_vl_processor import QwenVLProcessor

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"Look {IMAGE} and {IMAGE} now"
CLASSES = {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
           "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
           "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
           "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration}
DECODERS = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}


@pytest.fixture(scope="module", params=sorted(CLASSES))
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(kind: str, tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    decoder = tiny_model_factory(DECODERS[kind])
    return build_qwen2_vl(decoder, tmp_path_factory.mktemp(kind), kind)


@pytest.fixture(scope="module")
def reference(kind: str, model_dir: Path) -> transformers.PreTrainedModel:
    return CLASSES[kind].from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 24)


def _pictures() -> list:
    """A wide image (2 x 3 merge blocks: two windows in Qwen2.5-VL) and a tall one (4 x 3 blocks: four windows)."""
    return [image(0, 40, 56), image(1, 110, 80)]


def _inputs(model_dir: Path, text: str, pictures: list, image_token: int) -> dict:
    inputs = QwenVLProcessor(model_dir)(text=[text], images=[pictures])
    return {**inputs, "mm_token_type_ids": (inputs["input_ids"] == image_token).int(),
            "attention_mask": torch.ones_like(inputs["input_ids"])}


def _expected(reference, inputs: dict) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and each step's log-softmax."""
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), [s[0].log_softmax(-1) for s in out.logits]


def _assert_matches(out, tokens: list[int], logprobs: list[torch.Tensor]) -> None:
    assert out.outputs[0].token_ids == tokens
    for step, expected in zip(out.outputs[0].logprobs, logprobs):
        assert max(abs(lp.logprob - expected[token].item()) for token, lp in step.items()) < 1e-4


def test_image_rows_are_transformers_image_features(model_dir: Path, reference, llm: LLM) -> None:
    inputs = llm.input_processor.process_images(PROMPT, _pictures()).inputs
    grids = inputs.tensor("image_grid_thw")
    assert grids.tolist() == [[1, 4, 6], [1, 8, 6]]  # 6 and 12 image tokens
    rows = llm.engine.core.executor.worker.runner.model.image_rows(inputs)
    with torch.no_grad():
        expected = reference.get_image_features(pixel_values=inputs.tensor("pixel_values"), image_grid_thw=grids)
    deepstack = getattr(expected, "deepstack_features", None) or []  # Qwen3-VL's, beside each token's row
    torch.testing.assert_close(rows, torch.cat([torch.cat(expected.pooler_output), *map(torch.cat, deepstack)], -1),
                               atol=1e-4, rtol=1e-4)
    assert rows.shape[1] == 64 * (1 + len(deepstack))
    second = llm.engine.core.executor.worker.runner.model.image_rows(inputs, 1, 2)  # one image alone
    torch.testing.assert_close(second, rows[6:], atol=1e-4, rtol=1e-4)


def test_positions_are_transformers_rope_index(model_dir: Path, reference, llm: LLM) -> None:
    """Text, a 2 x 3 image, text, a 4 x 3 image, text: transformers' three rows of positions and delta."""
    image_token = llm.input_processor.image_token_id
    inputs = _inputs(model_dir, PROMPT, _pictures(), image_token)
    processed = llm.input_processor.process_images(PROMPT, _pictures())
    model = llm.engine.core.executor.worker.runner.model
    table, delta = model.mrope_positions(list(processed), processed.inputs)
    positions, deltas = reference.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                       image_grid_thw=inputs["image_grid_thw"])
    np.testing.assert_array_equal(table, positions[:, 0].numpy())
    assert delta == int(deltas[0, 0]) < 0 and len(set(table[:, 20].tolist())) > 1  # the positions differ by axis


@pytest.mark.parametrize("budget", [None, 11])
def test_greedy_tokens_and_logprobs_equal_transformers(model_dir: Path, reference, llm: LLM,
                                                       budget: int | None) -> None:
    """Chunks of 11 tokens end inside both images; every step's logprobs are transformers' (positions past the
    prompt shifted by its delta)."""
    image_token = llm.input_processor.image_token_id
    tokens, logprobs = _expected(reference, _inputs(model_dir, PROMPT, _pictures(), image_token))
    engine = llm if budget is None else LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22,
                                            max_num_batched_tokens=budget, long_prefill_token_threshold=budget)
    out = engine.generate({"prompt": PROMPT, "multi_modal_data": {"image": _pictures()}}, GREEDY, use_tqdm=False)[0]
    _assert_matches(out, tokens, logprobs)


def test_a_prefix_hit_on_the_first_image_and_text_alone(model_dir: Path, reference, llm: LLM) -> None:
    """A second prompt with the first image and another second image hits the blocks of its first image: the later
    text's positions still count the cached image's grid. A prompt of text alone is transformers' too."""
    image_token = llm.input_processor.image_token_id
    first = [_pictures()[0], image(2, 60, 120)]
    text = f"Look at these pictures {IMAGE} and then {IMAGE} now"
    llm.generate({"prompt": text, "multi_modal_data": {"image": _pictures()}}, GREEDY, use_tqdm=False)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32  # the first image (tokens 24..29) inside the second block
    _assert_matches(out, *_expected(reference, _inputs(model_dir, text, first, image_token)))
    plain = "Just some words here"
    ids = QwenVLProcessor(model_dir).tokenizer(plain, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = reference.generate(input_ids=ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1]:]
    assert llm.generate(plain, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected.tolist()


def test_chat_image_parts_and_placeholder_errors(llm: LLM) -> None:
    """A chat's image part is the template's vision tokens, as a prompt writes them; a prompt whose placeholders
    and images disagree is refused by name."""
    picture = image(4, 50, 50)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": data_url(picture)}}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = llm.tokenizer.render_chat(messages, image_placeholder="<|image_pad|>")
    assert IMAGE in text
    direct = llm.generate({"prompt": text, "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids and chat.prompt_token_ids == direct.prompt_token_ids
    with pytest.raises(ValueError, match=r"2 <\|image_pad\|> placeholders for 1 images"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)


def _other_layout(name: str) -> str:
    """transformers 5 saves Qwen2-VL's names as released (``visual.``, ``model.``) and Qwen3-VL's as released
    (``model.visual.``, ``model.language_model.``): each the other's."""
    for old, new in (("model.visual.", "visual."), ("model.language_model.", "model."), ("visual.", "model.visual."),
                     ("model.", "model.language_model.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def test_released_layout_and_flat_config_load_the_same_model(kind: str, model_dir: Path, llm: LLM,
                                                            tmp_path: Path) -> None:
    """Qwen/Qwen2-VL-2B-Instruct's and Qwen2.5-VL's config: one flat dict (the decoder's keys at the top,
    ``rope_scaling`` {type: mrope}, a vision config without a model type), and transformers 4's module names
    (``model.visual.``, ``model.language_model.``); Qwen3-VL's nested config (its vision config without a model
    type), its tensors under Qwen2-VL's names, Qwen3-VL-MoE's stacked experts as the released files lay them out."""
    tensors = {_other_layout(name): tensor.transpose(1, 2).contiguous() if ".experts." in name else tensor
               for name, tensor in load_file(model_dir / "model.safetensors").items()}  # released experts: [E, in, out]
    save_file(tensors, tmp_path / "model.safetensors")
    for path in model_dir.iterdir():
        if path.suffix in (".json", ".jinja") and path.name != "config.json":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    vision = {k: v for k, v in config.pop("vision_config").items() if k != "model_type"}
    if kind.startswith("qwen3"):
        released = {**config, "vision_config": vision}
    else:
        text = {k: v for k, v in config.pop("text_config").items() if k not in ("rope_parameters", "model_type")}
        released = {**config, **text, "model_type": kind, "vision_config": vision, "rope_theta": 1e6,
                    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    (tmp_path / "config.json").write_text(json.dumps(released))
    assert ArchConfig.from_hf(released).mrope_section == (2, 3, 3)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": _pictures()}}
    other = LLM(str(tmp_path), dtype="float32", kv_cache_memory=1 << 22)
    assert other.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_two_tensor_parallel_ranks_give_one_ranks_tokens(model_dir: Path, llm: LLM) -> None:
    """Each rank runs the replicated tower and the same M-RoPE positions for its heads."""
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": _pictures()}}
    ranks = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 24, tensor_parallel_size=2)
    try:
        assert ranks.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
            llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        ranks.shutdown()


def test_precomputed_image_embeddings_with_their_grids(model_dir: Path, llm: LLM) -> None:
    """vLLM's ``{"image_embeds": rows, "image_grid_thw": grids}`` under ``enable_mm_embeds``: the tower's own rows
    (and Qwen3-VL's DeepStack rows) give the images' tokens; rows of another width, or grids that make other counts,
    are refused by name, and without the flag the embeddings are refused."""
    processed = llm.input_processor.process_images(PROMPT, _pictures()).inputs
    rows = llm.engine.core.executor.worker.runner.model.image_rows(processed).float()
    grids = processed.tensor("image_grid_thw")
    embeds = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22, enable_mm_embeds=True)
    given = {"prompt": PROMPT, "multi_modal_data": {"image": {"image_embeds": rows, "image_grid_thw": grids}}}
    out = embeds.generate(given, GREEDY, use_tqdm=False)[0]
    direct = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": _pictures()}}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == direct.prompt_token_ids and out.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match=rf"a finite float tensor of \[tokens, {rows.shape[1]}\]"):
        narrow = {"image_embeds": rows[:, :8], "image_grid_thw": grids}
        embeds.generate({**given, "multi_modal_data": {"image": narrow}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 image grids making 12 image tokens for 18 rows"):
        other = {"image_embeds": rows, "image_grid_thw": grids[[0, 0]]}  # 6 tokens each
        embeds.generate({**given, "multi_modal_data": {"image": other}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="need --enable-mm-embeds"):
        llm.generate(given, GREEDY, use_tqdm=False)


def test_chat_image_embeds_parts_with_their_grids(model_dir: Path, llm: LLM) -> None:
    """Chat's ``image_embeds`` parts as vLLM takes them for Qwen-VL (``{"image_embeds": base64 rows,
    "image_grid_thw": base64 grid}``, one part an image) give the reply the images give."""
    from pagellm.prompt_embeds import save

    processed = llm.input_processor.process_images(PROMPT, _pictures()).inputs
    rows = llm.engine.core.executor.worker.runner.model.image_rows(processed).float()
    grids = processed.tensor("image_grid_thw")
    b64 = lambda tensor: base64.b64encode(save(tensor)).decode()  # noqa: E731
    parts = [{"type": "image_embeds", "image_embeds": {"image_embeds": b64(rows[a:b]), "image_grid_thw": b64(grid)}}
             for a, b, grid in ((0, 6, grids[:1]), (6, 18, grids[1:]))]
    text = {"type": "text", "text": "Compare these."}
    embeds = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22, enable_mm_embeds=True)
    got = embeds.chat([{"role": "user", "content": [text, *parts]}], GREEDY, use_tqdm=False)[0]
    urls = [{"type": "image_url", "image_url": {"url": data_url(picture)}} for picture in _pictures()]
    expected = llm.chat([{"role": "user", "content": [text, *urls]}], GREEDY, use_tqdm=False)[0]
    assert got.prompt_token_ids == expected.prompt_token_ids
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    with pytest.raises(ValueError, match="image_grid_thw must be base64 of a torch.save"):
        bad = {"type": "image_embeds", "image_embeds": {"image_embeds": b64(rows[:6]), "image_grid_thw": b64(rows)}}
        embeds.chat([{"role": "user", "content": [text, bad]}], GREEDY, use_tqdm=False)
