"""Qwen2-VL's and Qwen2.5-VL's processor, for images: transformers' ``Qwen2VLProcessor`` cannot be built without
torchvision (its video side), which has no CPU build for this torch on PyPI. So this one takes the checkpoint's
image processor (transformers' PIL ``Qwen2VLImageProcessorPil``, its ``preprocessor_config.json``: pixel bounds,
patch and merge sizes) and tokenizer, and expands each ``<|image_pad|>`` of the text into one token per merged
2 x 2 block of the image's patches, as ``Qwen2VLProcessor`` does; it answers ``_get_num_multimodal_tokens`` as that
class does. No torch here beyond what the image processor returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class QwenVLProcessor:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"

    def __call__(self, text: list[str], images: list[list[Any]], return_tensors: str = "pt",
                 add_special_tokens: bool = True, **kwargs: Any) -> dict[str, Any]:
        """The prompts' token ids (``input_ids`` [prompts, length]: prompts of one length, or a single prompt),
        ``pixel_values`` [patches, 3 · 2 · 14 · 14] and ``image_grid_thw`` [images, 3] of ``images`` (each prompt's
        list); ``kwargs``: the image processor's (``min_pixels``, ``max_pixels``, ...)."""
        flat = [picture for pictures in images for picture in pictures]
        out = self.image_processor(images=flat, return_tensors=return_tensors, **kwargs)
        counts = iter([int(n) // self._merge(kwargs) ** 2 for n in out["image_grid_thw"].prod(-1).tolist()])
        expanded = []
        for prompt, pictures in zip(text, images):
            pieces = prompt.split(self.image_token)
            if len(pieces) - 1 != len(pictures):
                raise ValueError(f"the prompt has {len(pieces) - 1} {self.image_token} placeholders for "
                                 f"{len(pictures)} images")
            expanded.append(pieces[0] + "".join(self.image_token * next(counts) + piece for piece in pieces[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens, return_tensors=return_tensors)
        return {"input_ids": ids["input_ids"], "pixel_values": out["pixel_values"],
                "image_grid_thw": out["image_grid_thw"]}

    def _get_num_multimodal_tokens(self, image_sizes: list[tuple[int, int]], **kwargs: Any) -> Any:
        """Each image's tokens (``num_image_tokens``) for images of ``image_sizes`` (height, width)."""
        from transformers.processing_utils import MultiModalData

        merged = self.image_processor._merge_and_standardize_kwargs(**kwargs)
        patches = [self.image_processor.get_number_of_image_patches(h, w, merged) for h, w in image_sizes]
        return MultiModalData(num_image_tokens=[n // self._merge(kwargs) ** 2 for n in patches])

    def _merge(self, kwargs: dict[str, Any]) -> int:
        return int(kwargs.get("merge_size") or self.image_processor.merge_size)
