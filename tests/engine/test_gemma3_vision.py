"""Gemma 3's images (``model/gemma3_mm.py``): a tiny random Gemma 3 vision-language model built here with
transformers (``vlm_utils.build_gemma3``: a SigLIP tower, Gemma 3's pooling projector, a tiny Gemma 3 decoder with a
sliding layer), its processor expanding ``<start_of_image>`` into 16 image tokens between its markers.

The encoder's rows must be transformers' ``get_image_features``; each image's tokens attend to one another both
ways, as transformers' mask has them: the first sampled token's logprobs are transformers' (and not what a causal
mask gives), greedy tokens are transformers' ``generate`` in float32, whole or in prefill chunks too small for the
prompt (no chunk ends inside an image), and after a prefix-cache hit that ends inside an image; an image longer than
a step is refused by name; the released checkpoints' names and sparse configs load the same model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from vlm_utils import build_gemma3, data_url, image

from pagellm import LLM, SamplingParams
from pagellm.model.arch import ArchConfig
from pagellm.model.gemma3_mm import Gemma3Vision

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT = "Look <start_of_image> and <start_of_image> now"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tiny_model_factory("gemma3"), tmp_path_factory.mktemp("gemma3-vision"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 24)


def _inputs(model_dir: Path, text: str, pictures: list) -> dict:
    return transformers.AutoProcessor.from_pretrained(model_dir)(text=[text], images=[pictures], return_tensors="pt")


def _pictures() -> list:
    return [image(0, 40, 56), image(1, 70, 50)]


def test_image_rows_are_transformers_image_features(model_dir: Path, reference, llm: LLM) -> None:
    inputs = llm.input_processor.process_images(PROMPT, _pictures()).inputs
    rows = llm.engine.core.executor.worker.runner.model.image_rows(inputs)
    with torch.no_grad():
        expected = reference.get_image_features(_inputs(model_dir, PROMPT, _pictures())["pixel_values"])
    torch.testing.assert_close(rows, expected.pooler_output.flatten(0, 1), atol=1e-5, rtol=1e-5)


def test_images_attend_both_ways_as_transformers_masks_them(model_dir: Path, reference, llm: LLM) -> None:
    inputs = _inputs(model_dir, PROMPT, _pictures())
    with torch.no_grad():
        both = reference(**inputs).logits[0, -1].log_softmax(-1)
        causal = reference(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits[0, -1].log_softmax(-1)
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": _pictures()}},
                       SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    got = {token: lp.logprob for token, lp in out.outputs[0].logprobs[0].items()}
    assert max(abs(value - both[token].item()) for token, value in got.items()) < 1e-4
    assert max(abs(value - causal[token].item()) for token, value in got.items()) > 1e-3


@pytest.mark.parametrize("budget", [None, 20, 40])
def test_greedy_tokens_equal_transformers_whole_and_chunked(model_dir: Path, reference, budget: int | None) -> None:
    """Budgets of 20 and 40 tokens cut the 59-token prompt's chunks back to before an image (16 tokens)."""
    inputs = _inputs(model_dir, PROMPT, _pictures())
    prompt_len = inputs["input_ids"].shape[1]
    expected = reference.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0, prompt_len:]
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 24,
              **({"max_num_batched_tokens": budget} if budget else {}))
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": _pictures()}}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected.tolist()


def test_a_prefix_hit_that_ends_inside_an_image(model_dir: Path, reference, llm: LLM) -> None:
    """The image sits at positions 8..23: a second prompt whose text differs right after it hits the first block
    only (16 tokens, half the image), and computes the rest of the image with all of it in view."""
    picture = [image(3, 50, 50)]
    llm.generate({"prompt": "Look <start_of_image> first", "multi_modal_data": {"image": picture}}, GREEDY,
                 use_tqdm=False)
    text = "Look <start_of_image> other words"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)[0]
    inputs = _inputs(model_dir, text, picture)
    ids = inputs["input_ids"][0].tolist()
    assert ids.index(llm.input_processor.image_token_id) == 8 and out.num_cached_tokens == 16
    expected = reference.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):]
    assert out.outputs[0].token_ids == expected.tolist()


def test_chat_image_parts_and_an_image_longer_than_a_step(model_dir: Path, llm: LLM) -> None:
    """A chat's image part becomes ``<start_of_image>``, as a prompt writes it; a step of 12 tokens cannot hold a
    16-token image that must be computed whole: refused by name."""
    picture = image(4, 40, 40)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": data_url(picture)}}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = llm.tokenizer.render_chat(messages, image_placeholder="<start_of_image>")
    direct = llm.generate({"prompt": text, "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids and chat.prompt_token_ids == direct.prompt_token_ids
    small = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=12)
    with pytest.raises(ValueError, match=r"an image of 16 tokens must be computed in one step here .* more than a "
                                         r"step's 12; raise --max-num-batched-tokens"):
        small.generate({"prompt": "Look <start_of_image>", "multi_modal_data": {"image": picture}}, GREEDY,
                       use_tqdm=False)


# transformers 5 saves these names (a tower without ``vision_model.``): as released, and as its modules are named
LAYOUTS = {"released": (("vision_tower.", "vision_tower.vision_model."),),
           "modules": (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
                       ("multi_modal_projector.", "model.multi_modal_projector."),
                       ("language_model.lm_head.", "lm_head."))}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_checkpoint_layouts_and_the_released_config_load_the_same_model(layout: str, model_dir: Path, llm: LLM,
                                                                         tmp_path: Path) -> None:
    """google/gemma-3-*-it's names (``language_model.model.``, ``vision_tower.vision_model.``,
    ``multi_modal_projector.``) or transformers 5's module names, and a text config in transformers 4's keys (no
    layer types: a sliding-window pattern; rope_theta and rope_local_base_freq), completed as transformers does."""
    tensors = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        old, new = next(((old, new) for old, new in LAYOUTS[layout] if name.startswith(old)), ("", ""))
        tensors[new + name[len(old):]] = tensor
    save_file(tensors, tmp_path / "model.safetensors")
    for path in model_dir.iterdir():
        if path.suffix in (".json", ".jinja") and path.name != "config.json":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    text = {k: v for k, v in config["text_config"].items()
            if k not in ("layer_types", "_sliding_window_pattern", "rope_parameters")}
    config["text_config"] = {**text, "sliding_window_pattern": 2, "rope_theta": 100000.0,
                             "rope_local_base_freq": 1000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": _pictures()}}
    released = LLM(str(tmp_path), dtype="float32", kv_cache_memory=1 << 22)
    assert released.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_the_released_gemma_3_4b_config_reads_as_its_model() -> None:
    """gemma-3-4b-it's config.json, whose text_config gives only its widths, depth, window and rope scaling: the
    decoder is what transformers completes (8 heads of 256, 4 KV heads, a global layer every sixth with linear rope
    scaling 8 over base 1e6, local layers on base 1e4), the tower SigLIP So400m at 896 (27 layers and its final norm),
    pooled from 64 x 64 patches to 16 x 16 tokens."""
    released = {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
        "image_token_index": 262144, "mm_tokens_per_image": 256, "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14, "vision_use_head": False}}
    cfg = ArchConfig.from_hf(released)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.image_token_id,
            cfg.sliding_window, cfg.full_attention_layers) == \
        (34, 8, 4, 256, 262208, 262144, 1024, (5, 11, 17, 23, 29))
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"], cfg.local_rope_theta,
            cfg.attn_scale, cfg.bidirectional_images) == (1e6, "linear", 8.0, 1e4, 256 ** -0.5, True)
    with torch.device("meta"):
        vision = Gemma3Vision(cfg.vision, cfg.hidden_size, torch.bfloat16)
    assert len(vision.tower.vision_model.encoder.layers) == 27 and vision.projector.kernel == 4
    assert vision.tower.loads("post_layernorm.weight") and not vision.tower.loads("head.probe")


def test_two_tensor_parallel_ranks_give_one_ranks_tokens(model_dir: Path, llm: LLM) -> None:
    """Each rank runs the replicated encoder and gives its attention heads the same images' ends."""
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": _pictures()}}
    ranks = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 24, tensor_parallel_size=2,
                max_num_batched_tokens=40)
    try:
        assert ranks.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
            llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        ranks.shutdown()  # rank 0's process group lives in this process: it goes with the engine


def test_pan_and_scan_crops_in_chunks(model_dir: Path, reference) -> None:
    """``do_pan_and_scan`` (a request's ``mm_processor_kwargs``): a wide image becomes the whole image and its crops,
    16 tokens each between their own markers (the processor does not count them per image: all are encoded at the
    first chunk that reaches one); in chunks of at most 40 tokens the tokens are transformers'."""
    picture, kwargs = [image(5, 100, 300)], {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}
    text = "Look <start_of_image> now"
    inputs = transformers.AutoProcessor.from_pretrained(model_dir)(text=[text], images=[picture], return_tensors="pt",
                                                                   **kwargs)
    assert inputs["pixel_values"].shape[0] > 1
    prompt_len = inputs["input_ids"].shape[1]
    expected = reference.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0, prompt_len:]
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 24, max_num_batched_tokens=40)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": picture}, "mm_processor_kwargs": kwargs},
                       GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == expected.tolist()


# Gemma 3's template's shape: each message's content parts in a loop, an image part written as <start_of_image>
PARTS_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% if m['content'] is string %}"
                  "{{ m['content'] }}{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}"
                  "<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
                  "{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
                  "{% endif %}")


def test_a_template_that_writes_its_own_image_markers(model_dir: Path, tmp_path: Path) -> None:
    """A chat template that loops over content parts and writes ``<start_of_image>`` for an image part (as Gemma
    3's does) gets OpenAI's image parts as its image parts: one image each, the reply the prompt's."""
    for path in model_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=1 << 22)
    pictures = _pictures()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare "},
                                             *({"type": "image_url", "image_url": {"url": data_url(p)}}
                                               for p in pictures), {"type": "text", "text": " now"}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = "<start_of_turn>user\nCompare <start_of_image><start_of_image> now<end_of_turn>\n<start_of_turn>model\n"
    direct = llm.generate({"prompt": text, "multi_modal_data": {"image": pictures}}, GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
