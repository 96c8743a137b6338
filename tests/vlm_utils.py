"""A tiny random Idefics3 (SmolVLM's architecture) with its processor, for the image tests: 32-pixel tiles of 4
image tokens each (a 16-pixel patch grid shuffled by 2), the tiny Llama's tokenizer with Idefics3's image tokens."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + \
    [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]


def build_vlm(tiny_llama: Path, out: Path) -> Path:
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


def image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def png(picture: Image.Image) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(picture: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(picture)).decode()


# A tiny LLaVA's towers: CLIP (a class token, quick GELU; the "default" strategy drops the class token) or SigLIP
# (neither), 32-pixel crops of 8-pixel patches: 16 image tokens an image (15 for SigLIP under "default")
TOWERS = {
    "clip": ({"model_type": "clip_vision_model", "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}, "default", 1),
    "siglip": ({"model_type": "siglip_vision_model"}, "full", 0),
    "siglip-default": ({"model_type": "siglip_vision_model"}, "default", 0),  # drops its first patch (transformers)
}


PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32]]  # a tiny LLaVA-NeXT's grids of 32-pixel tiles


def build_llava(decoder: Path, out: Path, tower: str = "clip", feature_layer: int | list[int] = -2,
                anyres: bool = False) -> Path:
    """A tiny LLaVA (``anyres``: LLaVA-NeXT, its images split over ``PINPOINTS``) over ``decoder``."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tokenizer = transformers.AutoTokenizer.from_pretrained(decoder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision, strategy, extra = TOWERS[tower]
    crop = {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}
    images = LlavaNextImageProcessorPil(**crop, image_grid_pinpoints=PINPOINTS) if anyres else \
        CLIPImageProcessorPil(**crop) if tower == "clip" else SiglipImageProcessorPil(size={"height": 32, "width": 32})
    kind = (transformers.LlavaNextProcessor, transformers.LlavaNextConfig,
            transformers.LlavaNextForConditionalGeneration) if anyres else \
        (transformers.LlavaProcessor, transformers.LlavaConfig, transformers.LlavaForConditionalGeneration)
    processor = kind[0](image_processor=images, tokenizer=tokenizer, patch_size=8,
                        vision_feature_select_strategy=strategy, num_additional_image_tokens=extra)
    text = {k: v for k, v in json.loads((decoder / "config.json").read_text()).items()
            if k not in ("architectures", "dtype", "torch_dtype")}
    config = kind[1](
        text_config=text, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_config={**vision, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                       "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
        vision_feature_select_strategy=strategy, vision_feature_layer=feature_layer, tie_word_embeddings=False,
        **({"image_grid_pinpoints": PINPOINTS} if anyres else {}))
    torch.manual_seed(0)
    kind[2](config).eval().save_pretrained(out)
    processor.save_pretrained(out)
    return out


def build_gemma3(decoder: Path, out: Path, tokens_per_image: int = 16) -> Path:
    """A tiny Gemma 3 vision-language model over a tiny Gemma 3 ``decoder``: a SigLIP tower on 64-pixel images of
    8-pixel patches, pooled to ``tokens_per_image`` rows; its processor writes ``<start_of_image>``'s image in
    place of the placeholder. The projector's weights are drawn large enough to matter."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = transformers.AutoTokenizer.from_pretrained(decoder, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    processor = transformers.Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 64, "width": 64}),
                                             tokenizer=tokenizer, image_seq_length=tokens_per_image)
    text = {k: v for k, v in json.loads((decoder / "config.json").read_text()).items()
            if k not in ("architectures", "dtype", "torch_dtype")}
    config = transformers.Gemma3Config(
        text_config=text, mm_tokens_per_image=tokens_per_image, boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id, image_token_index=tokenizer.image_token_id, tie_word_embeddings=False,
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 64, "patch_size": 8})
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "multi_modal_projector" in name or "post_layernorm" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_VL_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                    "{{ m['content'] }}{% else %}{% for part in m['content'] %}{% if part['type'] == 'text' %}"
                    "{{ part['text'] }}{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}"
                    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                    "{% endif %}")


QWEN_VL_TOWERS = {
    "qwen2_vl": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2},
    "qwen2_5_vl": {"depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
                   "window_size": 56, "fullatt_block_indexes": [1, 3]},
    "qwen3_vl": {"depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
                 "patch_size": 14, "num_position_embeddings": 64, "deepstack_visual_indexes": [1, 2]},
}
QWEN_VL_TOWERS["qwen3_vl_moe"] = QWEN_VL_TOWERS["qwen3_vl"]


def build_qwen2_vl(decoder: Path, out: Path, kind: str = "qwen2_vl") -> Path:
    """A tiny Qwen2-VL (``kind``: or Qwen2.5-VL, its tower's windows two merge blocks a side, its second and fourth
    blocks attending to whole images; or Qwen3-VL, its learned positions an 8 x 8 grid resampled to each image's,
    DeepStack rows from its second and third blocks, over a tiny Qwen3 ``decoder``, or Qwen3-MoE's for
    Qwen3-VL-MoE) over a tiny Qwen2 ``decoder``
    (M-RoPE sections 2, 3, 3 of its 8 frequencies): 14-pixel patches merged 2 x 2, images resized to 4-16 merged
    blocks (16 image tokens at most), the decoder's tokenizer with Qwen2-VL's vision tokens and a chat template
    that writes them."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = transformers.AutoTokenizer.from_pretrained(decoder)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), QWEN_VL_TOKENS)}
    text = {k: v for k, v in json.loads((decoder / "config.json").read_text()).items()
            if k not in ("architectures", "dtype", "torch_dtype", "model_type", "norm_topk_prob")}  # (Qwen3-VL-MoE's
    text["rope_parameters"] = {**text.get("rope_parameters", {}), "rope_type": "default",  # experts renormalize)
                               "mrope_section": [2, 3, 3]}
    name = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL",
            "qwen3_vl_moe": "Qwen3VLMoe"}[kind]
    config = getattr(transformers, f"{name}Config")(text_config=text, vision_config=QWEN_VL_TOWERS[kind],
                                                   tie_word_embeddings=False, **ids)
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):  # random init leaves them at zero; make them matter
                param.normal_(0, 0.5)
            elif "pos_embed" in param_name or "deepstack" in param_name or param_name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5)  # large enough to matter; a decisive router
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16, patch_size=14).save_pretrained(out)
    return out
