"""A vision-language model's inputs (``EngineConfig.multimodal_config``): how many images a prompt takes, the
processor's settings, image embeddings in place of images, and where an image URL may point (``images.fetch``).
No torch here: the frontend reads it before anything starts."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


def _help(text: str, **kwargs: Any) -> Any:
    nargs = kwargs.pop("nargs", None)
    return field(metadata={"help": text, **({"nargs": nargs} if nargs else {})}, **kwargs)  # engine_args' flags


def json_object(value: dict[str, Any] | str | None, name: str) -> dict[str, Any] | None:
    """A dict from a dict or its JSON text (None stays None)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON ({exc}); e.g. '{{\"temperature\": 0.5}}'") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, e.g. '{{\"temperature\": 0.5}}', got {value!r}")
    return value


@dataclass(frozen=True)
class MultiModalConfig:
    limit_mm_per_prompt: dict[str, Any] | str | None = _help(
        "The most images one prompt may carry, as a JSON object (vLLM's flag), e.g. '{\"image\": 2}'; a prompt "
        "with more is refused (keys image, video, audio: this engine reads images only). Default: any number.",
        default=None)
    mm_processor_kwargs: dict[str, Any] | str | None = _help(
        "Keyword arguments for the model's Hugging Face processor, as a JSON object (vLLM's flag), e.g. "
        "'{\"do_image_splitting\": false}' (SmolVLM: one tile an image); a request's own override them.",
        default=None)
    enable_mm_embeds: bool = _help(
        "Take precomputed image embeddings in place of images (vLLM's flag), for a LLaVA model: tensors under "
        "multi_modal_data, or chat's image_embeds parts (a base64 torch.save or .npy of [rows, hidden_size]). "
        "Default: off.", default=False)
    allowed_local_media_path: str | None = _help(
        "A folder whose images chat image parts may name as file:// URLs (vLLM's flag); the server then reads "
        "them for any client, so set it only where every client is trusted. Files outside it (symbolic links "
        "followed) are refused. Default: none (file:// URLs refused).", default=None)
    allowed_media_domains: tuple[str, ...] | None = _help(
        "The only hosts http(s) image URLs may name (vLLM's flag), e.g. upload.wikimedia.org example.com; a URL "
        "of another host, or a redirect to one, is a 400. Default: any host.", default=None, nargs="+")

    def __post_init__(self) -> None:
        object.__setattr__(self, "mm_processor_kwargs", json_object(self.mm_processor_kwargs, "mm_processor_kwargs"))
        limits = json_object(self.limit_mm_per_prompt, "limit_mm_per_prompt")
        if limits is not None and (not set(limits) <= {"image", "video", "audio"} or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in limits.values())):
            raise ValueError(f"limit_mm_per_prompt takes counts >= 0 of image, video or audio, e.g. "
                             f"'{{\"image\": 2}}'; got {limits!r}")
        object.__setattr__(self, "limit_mm_per_prompt", limits)
        folder = self.allowed_local_media_path
        if folder is not None:
            if not os.path.isdir(folder):
                raise ValueError(f"allowed_local_media_path={folder!r} is not a folder; name the folder whose "
                                 "images file:// URLs may read")
            object.__setattr__(self, "allowed_local_media_path", os.path.realpath(folder))
        if self.allowed_media_domains is not None:
            domains = (self.allowed_media_domains,) if isinstance(self.allowed_media_domains, str) \
                else tuple(self.allowed_media_domains)
            bad = [d for d in domains if not d or urlsplit(f"//{d}").hostname != d.lower()]
            if bad or not domains:
                raise ValueError(f"allowed_media_domains takes host names (example.com, no scheme, port or path); "
                                 f"got {bad or list(domains)}")
            object.__setattr__(self, "allowed_media_domains", tuple(d.lower() for d in domains))

    @property
    def max_images(self) -> int | None:
        """The most images a prompt may carry (None: any number)."""
        return (self.limit_mm_per_prompt or {}).get("image")
