"""LLaVA (``model/llava.py``): tiny random LLaVAs built here with transformers, a CLIP tower over the tiny Llama and a
SigLIP tower over the tiny Qwen2, each image a 32-pixel crop of 16 image tokens, and a LLaVA-NeXT (CLIP, the tiny
Llama) splitting each image over a grid of 32-pixel tiles plus the whole image.

The towers' rows must be transformers' ``get_image_features`` (one feature layer or several); greedy tokens must be
transformers' ``generate`` on the same processor's inputs in float32, whole or in prefill chunks that cut images
apart; the released checkpoints' names and sparse configs load the same model; what cannot be served is refused."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from vlm_utils import build_llava, data_url, image

from pagellm import LLM, SamplingParams
from pagellm.engine.wire import EngineCoreRequest
from pagellm.model.arch import ArchConfig
from pagellm.model.llava import LlavaVision
from pagellm.multimodal import pack
from pagellm.prompt_embeds import save
from pagellm.tokenizer import Tokenizer

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)  # stopping at EOS, as generate does
PROMPTS = [("Look: <image> what?", [(0, 40, 56)]), ("Two <image> and <image> here", [(1, 47, 51), (2, 54, 46)])]


@pytest.fixture(scope="module")
def clip(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava(tiny_llama, tmp_path_factory.mktemp("llava-clip"))


@pytest.fixture(scope="module")
def siglip_default(tiny_qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava(tiny_qwen2, tmp_path_factory.mktemp("llava-siglip-default"), "siglip-default")


@pytest.fixture(scope="module")
def anyres(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava(tiny_llama, tmp_path_factory.mktemp("llava-next"), anyres=True)


@pytest.fixture(scope="module")
def siglip(tiny_qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava(tiny_qwen2, tmp_path_factory.mktemp("llava-siglip"), "siglip", [-1, -3])


def _reference(model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompts() -> list[tuple[str, list[Image.Image]]]:
    return [(text, [image(*spec) for spec in specs]) for text, specs in PROMPTS]


def _transformers_tokens(model_dir: Path, reference, text: str, images: list[Image.Image]) -> list[int]:
    inputs = transformers.AutoProcessor.from_pretrained(model_dir)(text=[text], images=[images], return_tensors="pt")
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("tower", ["clip", "siglip", "siglip_default", "anyres"])
def test_image_rows_are_transformers_image_features(tower: str, request: pytest.FixtureRequest) -> None:
    """CLIP's tower read two layers from the end, its class token dropped; SigLIP's read at two layers (the last and
    the third from the end) and concatenated, every patch kept (or, under the "default" strategy, all but the first,
    as transformers drops it); LLaVA-NeXT's wide, tall and square images over grids
    of tiles, unpadded to their aspect ratios, a newline row after each row of patches."""
    model_dir = request.getfixturevalue(tower)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22)
    pictures = [image(3, 30, 62), image(4, 61, 23)]
    pictures += [image(5, 40, 40), image(6, 90, 31)] if tower == "anyres" else []
    inputs = transformers.AutoProcessor.from_pretrained(model_dir)(
        text=[" ".join(["<image>"] * len(pictures))], images=[pictures], return_tensors="pt")
    sizes = (inputs["image_sizes"],) if tower == "anyres" else ()
    with torch.no_grad():
        theirs = _reference(model_dir).model.get_image_features(inputs["pixel_values"], *sizes).pooler_output
    model = llm.engine.core.executor.worker.runner.model
    ours = model.vision(inputs["pixel_values"], *sizes)
    assert ours.shape == (int((inputs["input_ids"] == model.cfg.image_token_id).sum()), 64)
    assert ours.shape[0] == {"siglip_default": 2 * 15, "anyres": sum(len(rows) for rows in theirs)}.get(tower, 2 * 16)
    torch.testing.assert_close(ours, torch.cat(list(theirs)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tower,chunk", [("clip", 4096), ("clip", 8), ("siglip", 4096), ("anyres", 4096),
                                         ("anyres", 8)])
def test_greedy_tokens_equal_transformers_whole_and_chunked(tower: str, chunk: int,
                                                            request: pytest.FixtureRequest) -> None:
    """At 8 tokens a step each image's 16 rows are prefilled in pieces."""
    model_dir = request.getfixturevalue(tower)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 24, max_num_batched_tokens=chunk)
    prompts, reference = _prompts(), _reference(model_dir)
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts],
                           GREEDY, use_tqdm=False)
    for (text, images), output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == _transformers_tokens(model_dir, reference, text, images)
        image_token = json.loads((model_dir / "config.json").read_text())["image_token_index"]
        assert output.prompt_token_ids.count(image_token) >= 16 * len(images)


def test_each_image_is_encoded_when_a_chunk_first_reaches_it(clip: Path) -> None:
    """At 8 tokens a step, the two images of a prompt are encoded one at a time, each in the step whose chunk first
    reaches its tokens; a step that holds the whole prompt encodes both in one call."""
    text, images = _prompts()[1]
    calls: dict[int, list] = {}
    for budget in (8, 4096):
        llm = LLM(str(clip), dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=budget)
        runner = llm.engine.core.executor.worker.runner
        encode, calls[budget] = runner.model.image_rows, []

        def spy(inputs, skip=0, last=None, encode=encode, seen=calls[budget], runner=runner):
            (state,) = runner.states.values()
            seen.append((skip, last, state.num_computed_tokens))  # the chunk's first position
            assert state.image_inputs is not None
            return encode(inputs, skip, last)

        runner.model.image_rows = spy
        output = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
        image_token = runner.model.cfg.image_token_id
        firsts = [i for i, t in enumerate(output.prompt_token_ids) if t == image_token][::16]  # 16 tokens an image
    assert [(skip, last) for skip, last, _ in calls[8]] == [(0, 1), (1, 2)]
    assert all(start <= first < start + 8 for (_, _, start), first in zip(calls[8], firsts))
    assert calls[4096] == [(0, 2, 0)]


LAYOUTS = {  # transformers 5 saves language_model.model., language_model.lm_head., vision_tower. (no vision_model.)
    "released": (("vision_tower.", "vision_tower.vision_model."),),  # llava-hf's, from transformers 4
    "modules": (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
                ("image_newline", "model.image_newline")),
}


@pytest.mark.parametrize("tower", ["clip", "anyres"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_checkpoint_layouts_and_sparse_configs_load_the_same_model(layout: str, tower: str, tmp_path: Path,
                                                                   request: pytest.FixtureRequest) -> None:
    """The released llava-hf checkpoints' names and transformers 5's module names, and a vision config silent on its
    activation and norm epsilon (CLIP's defaults, quick GELU and 1e-5, are transformers')."""
    clip = request.getfixturevalue(tower)
    for path in clip.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".index.json"):
            (tmp_path / path.name).write_bytes(path.read_bytes())
    tensors = {}
    for name, tensor in load_file(clip / "model.safetensors").items():
        for old, new in LAYOUTS[layout]:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        tensors[name] = tensor
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((clip / "config.json").read_text())
    config["vision_config"] = {k: v for k, v in config["vision_config"].items() if k not in ("hidden_act",
                                                                                            "layer_norm_eps")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in _prompts()]
    ours, other = (LLM(str(d), dtype="float32", kv_cache_memory=1 << 22) for d in (clip, tmp_path))
    assert [o.outputs[0].token_ids for o in other.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in ours.generate(prompts, GREEDY, use_tqdm=False)]


def test_the_released_llava_1_5_config_reads_as_its_model() -> None:
    """llava-hf/llava-1.5-7b-hf's config.json, whose text_config gives only its vocabulary and context: the decoder is
    Llama-2-7B's shape (transformers' Llama defaults), the tower CLIP ViT-L/14 at 336 with quick GELU, read at its
    23rd of 24 layers (the 24th is not built)."""
    released = {
        "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000, "model_type": "llava",
        "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False,
        "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                        "model_type": "llama", "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}
    cfg = ArchConfig.from_hf(released)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size,
            cfg.rms_norm_eps, cfg.image_token_id) == (4096, 11008, 32, 32, 32, 32064, 1e-5, 32000)
    with torch.device("meta"):
        vision = LlavaVision(cfg.vision, cfg.hidden_size, torch.bfloat16)
    layers = vision.tower.vision_model.encoder.layers
    assert len(layers) == 23 and layers[0].mlp.kind == "quick" and layers[0].layer_norm1.eps == 1e-5
    assert vision.tower.vision_model.embeddings.position_embedding.num_embeddings == 577  # 24² patches and the class


def test_chat_with_image_parts_equals_transformers_on_the_rendered_prompt(clip: Path) -> None:
    llm = LLM(str(clip), dtype="float32", kv_cache_memory=1 << 22)
    picture = image(5, 44, 60)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": data_url(picture)}}]}]
    output = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = Tokenizer.from_dir(clip).render_chat(messages, image_placeholder="<image>")
    inputs = transformers.AutoProcessor.from_pretrained(clip)(text=[text], images=[[picture]], return_tensors="pt",
                                                              add_special_tokens=False)
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = _reference(clip).generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    assert output.outputs[0].token_ids == expected[0, inputs["input_ids"].shape[1]:].tolist()


def test_what_cannot_be_served_is_refused_by_name(clip: Path, tmp_path: Path) -> None:
    llm = LLM(str(clip), dtype="float32", kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="the prompt has 2 <image> placeholders for 1 images"):
        llm.generate({"prompt": "<image> <image>", "multi_modal_data": {"image": image(0, 40, 56)}}, GREEDY,
                     use_tqdm=False)
    tokens = llm.input_processor.process_images("<image>", [image(0, 40, 56)])
    forged = msgspec.structs.replace(tokens.inputs, items=[(digest, n + 1) for digest, n in tokens.inputs.items])
    with pytest.raises(ValueError, match=r"the images' token counts \[17\] are not the prompt's 16 image tokens"):
        llm.engine.core.add_request(EngineCoreRequest("forged", list(tokens), GREEDY, [], 0.0, cache_salt="salt",
                                                      mm_inputs=forged))
    config = json.loads((clip / "config.json").read_text())
    for key, value, message in (("vision_config", {**config["vision_config"], "model_type": "pixtral"},
                                 "LLaVA's vision tower 'pixtral' is not supported"),
                                ("vision_feature_select_strategy", "pooled",
                                 "vision_feature_select_strategy 'pooled' is not supported"),
                                ("vision_feature_layer", -9, r"vision_feature_layer \[-9\] is outside")):
        with pytest.raises(ValueError, match=message):
            LlavaVision({**config, key: value}, 64, torch.float32)


@pytest.mark.parametrize("algo", [None, "sha256"])
def test_prompts_share_the_text_before_their_images_and_nothing_from_them_on(clip: Path, algo: str | None) -> None:
    """pagellm's own hashes and vLLM's (``--prefix-caching-hash-algo``, whose blocks carry vLLM's ("mm", ...) key):
    another image reuses the blocks wholly before the first image token and computes the rest (its tokens are the
    fresh engine's); the same image reuses its image's blocks too."""
    llm = LLM(str(clip), dtype="float32", kv_cache_memory=1 << 22, prefix_caching_hash_algo=algo)
    text = "A long instruction that every request shares, before its picture: <image> what is it?"
    first, other, again = (llm.generate({"prompt": text, "multi_modal_data": {"image": image(*spec)}}, GREEDY,
                                        use_tqdm=False)[0] for spec in [(0, 40, 56), (9, 40, 56), (9, 40, 56)])
    before = first.prompt_token_ids.index(json.loads((clip / "config.json").read_text())["image_token_index"])
    assert first.num_cached_tokens == 0 and before >= 32
    assert other.num_cached_tokens == before // 16 * 16
    assert again.num_cached_tokens > other.num_cached_tokens  # the image's blocks too
    fresh = LLM(str(clip), dtype="float32", kv_cache_memory=1 << 22, enable_prefix_caching=False)
    for output in (other, again):
        assert output.outputs[0].token_ids == fresh.generate(
            {"prompt": text, "multi_modal_data": {"image": image(9, 40, 56)}}, GREEDY, use_tqdm=False)[0] \
            .outputs[0].token_ids
    assert first.outputs[0].token_ids != other.outputs[0].token_ids


@pytest.mark.parametrize("algo", [None, "sha256"])
def test_a_conversation_shares_its_earlier_images_blocks_and_not_a_later_differing_one(clip: Path,
                                                                                     algo: str | None) -> None:
    """A later turn with one more image reuses the blocks up to where its new image begins (its first image's
    included, which is not encoded again); the same turn with another first image reuses only the text before it;
    each image is keyed by its own pixels (the processor's per-image token counts place them), and every reply is
    the fresh engine's."""
    llm = LLM(str(clip), dtype="float32", kv_cache_memory=1 << 22, prefix_caching_hash_algo=algo)
    fresh = LLM(str(clip), dtype="float32", kv_cache_memory=1 << 22, enable_prefix_caching=False)
    vision, encoded = llm.engine.core.executor.worker.runner.model.vision, []
    forward = vision.forward
    vision.forward = lambda pixels: encoded.append(len(pixels)) or forward(pixels)
    first = "USER: a shared instruction to every turn, then <image> what is it? ASSISTANT: a cat. USER: and"
    later = first + " this one: <image> now?"
    a, b, c = image(0, 40, 56), image(9, 40, 56), image(4, 47, 51)
    turns = [(first, [a]), (later, [a, b]), (later, [c, b])]
    outputs = [llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
               for text, images in turns]
    image_token = json.loads((clip / "config.json").read_text())["image_token_index"]
    ids = outputs[1].prompt_token_ids
    starts = [i for i, t in enumerate(ids) if t == image_token and ids[i - 1] != image_token]
    assert len(starts) == 2 and starts[1] - starts[0] > 16 + 32
    assert outputs[1].num_cached_tokens == min(starts[1] // 16 * 16, (len(outputs[0].prompt_token_ids) - 1) // 16 * 16)
    assert outputs[1].num_cached_tokens > starts[0] + 16  # the first image's blocks too
    assert outputs[2].num_cached_tokens == starts[0] // 16 * 16
    assert encoded == [1, 1, 2]  # the later turn's first image was in the prefix cache: not encoded again
    for (text, images), output in zip(turns, outputs):
        assert output.outputs[0].token_ids == fresh.generate(
            {"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_an_image_the_prefix_cache_holds_in_part_is_encoded_again(clip: Path) -> None:
    """The cached blocks end inside the image: its rows are needed for the rest of its tokens, so it is encoded."""
    llm = LLM(str(clip), dtype="float32", kv_cache_memory=1 << 22)
    fresh = LLM(str(clip), dtype="float32", kv_cache_memory=1 << 22, enable_prefix_caching=False)
    vision, encoded = llm.engine.core.executor.worker.runner.model.vision, []
    forward = vision.forward
    vision.forward = lambda pixels: encoded.append(len(pixels)) or forward(pixels)
    head = next(text for text in (f"USER: look{'!' * n} <image>" for n in range(16))
                if len(llm.get_tokenizer().encode(text)) % 16 > 1)  # the image's last block is not full
    picture = image(0, 40, 56)
    first = llm.generate({"prompt": head, "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)[0]
    then = {"prompt": head + " and what else is there?", "multi_modal_data": {"image": picture}}
    second = llm.generate(then, GREEDY, use_tqdm=False)[0]
    start = first.prompt_token_ids.index(json.loads((clip / "config.json").read_text())["image_token_index"])
    assert start < second.num_cached_tokens < start + 16 and encoded == [1, 1]
    assert second.outputs[0].token_ids == fresh.generate(then, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("tower", ["clip", "anyres"])
def test_image_embeddings_stand_for_their_images(tower: str, request: pytest.FixtureRequest) -> None:
    """vLLM's precomputed image embeddings (a [rows, hidden] tensor an image, or [images, rows, hidden]): the
    tokens are the images' own, the encoder does not run, and what does not fit is refused by name."""
    model_dir = request.getfixturevalue(tower)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22, enable_mm_embeds=True)
    text, pictures = _prompts()[1]
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    runner = llm.engine.core.executor.worker.runner
    rows = [runner.model.image_rows(llm.input_processor.process_images("<image>", [p]).inputs) for p in pictures]
    with pytest.raises(ValueError, match=r"image embeddings need --enable-mm-embeds \(LLM\(enable_mm_embeds=True\)"):
        LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22).generate(
            {"prompt": text, "multi_modal_data": {"image": rows}}, GREEDY, use_tqdm=False)
    expected = llm.generate({"prompt": text, "multi_modal_data": {"image": pictures}}, GREEDY, use_tqdm=False)[0]
    vision, encoded = runner.model.vision, []
    forward = vision.forward
    vision.forward = lambda *args: encoded.append(1) or forward(*args)
    forms = [rows] + ([torch.stack(rows)] if tower == "clip" else [])  # one size for all: a 3-D tensor
    for embeds in forms:
        output = llm.generate({"prompt": text, "multi_modal_data": {"image": embeds}}, GREEDY, use_tqdm=False)[0]
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
        assert output.prompt_token_ids == expected.prompt_token_ids
    assert not encoded and len(processor.tokenizer(text)["input_ids"]) < len(expected.prompt_token_ids)
    later = "Two <image> and then, after a long pause and some words, <image> here"  # the first image cached whole
    again = [llm.generate({"prompt": later, "multi_modal_data": {"image": rows}}, GREEDY, use_tqdm=False)[0]
             for _ in range(2)]
    ids, image_token = again[1].prompt_token_ids, runner.model.cfg.image_token_id
    first_image_end = max(i for i in range(40) if ids[i] == image_token)
    assert again[1].num_cached_tokens > first_image_end
    assert again[1].outputs[0].token_ids == again[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="a prompt takes images or image embeddings"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": [rows[0], pictures[1]]}}, GREEDY)
    for bad in (torch.zeros(4, 63), torch.full((4, 64), float("nan"))):
        with pytest.raises(ValueError, match=r"finite float tensors of \[rows, 64\]"):
            llm.generate({"prompt": "<image>", "multi_modal_data": {"image": bad}}, GREEDY)
    with pytest.raises(ValueError, match="the prompt has 1 <image> placeholders for 2 images' embeddings"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": rows}}, GREEDY)
    forged = llm.input_processor.process_images("<image>", [torch.zeros(4, 64)])
    forged = msgspec.structs.replace(forged.inputs, tensors={"image_embeds": pack(torch.zeros(4, 32))})
    with pytest.raises(ValueError, match=r"image embeddings must be \[rows, 64\]"):
        llm.engine.core.add_request(EngineCoreRequest("forged", list(llm.input_processor.process_images(
            "<image>", [torch.zeros(4, 64)])), GREEDY, [], 0.0, cache_salt="salt", mm_inputs=forged))


def test_chat_image_embeds_parts_stand_for_their_images(clip: Path) -> None:
    """vLLM's ``image_embeds`` content parts (base64 of a torch.save or a .npy), with --enable-mm-embeds: the reply
    is the one to the images themselves; a payload that is no tensor is refused by name."""
    llm = LLM(str(clip), dtype="float32", kv_cache_memory=1 << 22, enable_mm_embeds=True)
    picture = image(5, 44, 60)
    rows = llm.engine.core.executor.worker.runner.model.image_rows(
        llm.input_processor.process_images("<image>", [picture]).inputs)

    def ask(part: dict) -> list[int]:
        messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
        return llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    expected = ask({"type": "image_url", "image_url": {"url": data_url(picture)}})
    npy = io.BytesIO()
    np.save(npy, rows.numpy())
    for payload in (save(rows), npy.getvalue()):
        assert ask({"type": "image_embeds", "image_embeds": base64.b64encode(payload).decode()}) == expected
    with pytest.raises(ValueError, match="image_embeds must be base64 of a torch.save"):
        ask({"type": "image_embeds", "image_embeds": base64.b64encode(b"not a tensor").decode()})
