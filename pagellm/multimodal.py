"""Images in prompts (vLLM's ``multi_modal_data``): what crosses from the frontend to the workers.

A vision-language model's prompt is text with image placeholders, and images. The frontend runs the model's own
Hugging Face processor (``ImageProcessor``: the checkpoint's ``preprocessor_config.json`` and ``processor_config.json``,
through ``transformers.AutoProcessor``), which expands each placeholder into the model's image tokens (SmolVLM's:
tiles' rows and columns, each ``image_seq_len`` ``<image>`` tokens; LLaVA's: one ``<image>`` a patch; Gemma 3's: its
``<start_of_image>`` into ``mm_tokens_per_image`` soft tokens between its image markers; Qwen2-VL's
``<|image_pad|>`` into one token a merged 2 x 2 block of patches, by pagellm's ``qwen_vl_processor``) and turns the
images into pixel tensors. The prompt's token ids are then ordinary ids; its images travel as ``MultiModalInputs``:
the processor's tensors as raw bytes (``PackedTensor``, so the engine core and its messages need no torch), and a
digest of them.

The engine keys each of a request's KV blocks by the images begun before its end, each image by a digest of its
pixels and the processor's arguments (``MultiModalInputs.items``, placed by the processor's per-image token counts;
where those are unknown, by the whole digest from the first image token on): prompts share the blocks of their
common text and common first images, never a block past an image that differs (``kv/manager.py``,
``request.image_spans``). Each worker runs the
model's vision encoder on each image when a prompt chunk first reaches its tokens (again after a preemption), and the
model
places the rows it makes at the prompt's image-token positions in place of their token embeddings, chunk by chunk
(``worker/input_batch.py``), as transformers' ``inputs_merger`` does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from pagellm.model.hf_config import QWEN_VL

if TYPE_CHECKING:
    import torch


class PackedTensor(msgspec.Struct, array_like=True, frozen=True):
    dtype: str          # torch's name without "torch.": float32, bool, int64
    shape: list[int]
    data: bytes


class MultiModalInputs(msgspec.Struct, array_like=True, frozen=True):
    tensors: dict[str, PackedTensor]  # the processor's outputs the vision encoder takes (pixel_values, masks)
    digest: str                       # of the tensors: equal only for equal images, as processed
    # Each image's digest (of its pixels) and its image tokens, in the prompt's order (empty: not known, and the
    # request's blocks from its first image token on are keyed by ``digest`` alone)
    items: list[tuple[str, int]] = msgspec.field(default_factory=list)

    def tensor(self, name: str) -> torch.Tensor | None:
        packed = self.tensors.get(name)
        return None if packed is None else unpack(packed)


def pack(tensor: torch.Tensor) -> PackedTensor:
    import torch

    tensor = tensor.detach().cpu().contiguous()
    return PackedTensor(str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
                        tensor.view(-1).view(torch.uint8).numpy().tobytes())


def unpack(packed: PackedTensor) -> torch.Tensor:
    import torch

    dtype = getattr(torch, packed.dtype)
    return torch.frombuffer(bytearray(packed.data), dtype=torch.uint8).view(dtype).reshape(packed.shape)


def inputs_of(tensors: dict[str, torch.Tensor], items: list[tuple[str, int]] | None = None) -> MultiModalInputs:
    packed = {name: pack(t) for name, t in sorted(tensors.items())}
    digest = hashlib.sha256()
    for name, p in packed.items():
        digest.update(f"{name}:{p.dtype}:{p.shape}:".encode())
        digest.update(p.data)
    return MultiModalInputs(packed, digest.hexdigest(), items or [])


def image_digest(image: Any) -> str:
    """A digest of one PIL image's pixels (its mode, size and bytes)."""
    return hashlib.sha256(f"{image.mode}:{image.size}:".encode() + image.tobytes()).hexdigest()


def _joined(given: list[dict[str, Any]]) -> dict[str, Any]:
    """Qwen-VL image embeddings given image by image (chat's parts) as one ``{image_embeds, image_grid_thw}``."""
    if len(given) == 1:
        return given[0]
    import torch

    try:
        return {key: torch.cat([part[key] for part in given]) for key in ("image_embeds", "image_grid_thw")}
    except (KeyError, TypeError, RuntimeError):
        raise ValueError("Qwen-VL image embeddings are {image_embeds: [tokens, width], image_grid_thw: [images, 3]} "
                         "tensors, each image's of one width") from None


def is_tensor(value: Any, dims: int | None = None) -> bool:
    """Whether ``value`` is a torch tensor (of ``dims`` dimensions), without importing torch: image embeddings."""
    return type(value).__module__.startswith("torch") and (dims is None or value.dim() == dims)


LLAVA = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration")


class ImageProcessor:
    """A vision-language model's Hugging Face processor: text with image placeholders and images in, token ids and
    the encoder's tensors out, checked against the rows the model's encoder makes of them."""

    # The processor's outputs each family's encoder takes, and whether they carry the prompt's batch dimension first
    FAMILIES = {"Idefics3ForConditionalGeneration": (("pixel_values", "pixel_attention_mask"), True),
                "LlavaForConditionalGeneration": (("pixel_values",), False),
                "LlavaNextForConditionalGeneration": (("pixel_values", "image_sizes"), False),
                "Gemma3ForConditionalGeneration": (("pixel_values",), False),
                **{name: (("pixel_values", "image_grid_thw"), False) for name in QWEN_VL}}

    def __init__(self, model_dir: Path, image_token_id: int) -> None:
        from transformers import AutoProcessor

        self.config = json.loads((Path(model_dir) / "config.json").read_text())
        if self.config["architectures"][0] in QWEN_VL:  # (transformers' own needs torchvision)
            from pagellm.qwen_vl_processor import QwenVLProcessor

            self.processor = QwenVLProcessor(model_dir)
        else:
            self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.image_token = str(getattr(self.processor, "image_token", "<image>"))  # the placeholder a prompt writes
        self.image_token_id = image_token_id
        self.tensors, self.batched = self.FAMILIES[self.config["architectures"][0]]
        if not self.batched:  # a LLaVA's: its tower's config completed once (``_rows``)
            from pagellm.model.llava import completed

            self.config = completed(self.config)

    def process(self, text: str, images: Any, add_special_tokens: bool = True,
                kwargs: dict[str, Any] | None = None) -> tuple[list[int], MultiModalInputs]:
        """``text`` and ``images`` through the processor (``kwargs`` its keyword arguments: ``mm_processor_kwargs``)."""
        kwargs = kwargs or {}
        images = list(images) if isinstance(images, (list, tuple)) or is_tensor(images, 3) else [images]
        if images and all(is_tensor(image, 2) for image in images):
            return self._embeds(text, images, add_special_tokens)
        if images and all(isinstance(image, dict) for image in images):  # Qwen-VL's: rows and their images' grids
            return self._grid_embeds(text, _joined(images), add_special_tokens)
        if any(map(is_tensor, images)):
            raise ValueError("a prompt takes images or image embeddings ([rows, hidden] tensors), not both")
        if not images:
            raise ValueError("multi_modal_data's image list is empty; send at least one image, or no "
                             "multi_modal_data")
        count = text.count(self.image_token)
        if count != len(images):
            raise ValueError(f"the prompt has {count} {self.image_token} placeholders for {len(images)} images; put "
                             f"one {self.image_token} where each image goes")
        try:
            out = self.processor(text=[text], images=[images], return_tensors="pt",
                                 add_special_tokens=add_special_tokens, **kwargs)
        except (ValueError, TypeError, OSError, KeyError, AttributeError, RuntimeError) as exc:  # kwargs: a client's
            raise ValueError(f"the images could not be processed: {exc}") from None
        tensors = {name: out[name][0] if self.batched else out[name] for name in self.tensors if name in out}
        ids = out["input_ids"][0].tolist()
        rows = self._rows(tensors)
        if ids.count(self.image_token_id) != rows:
            raise ValueError(f"the processor wrote {ids.count(self.image_token_id)} image tokens for {rows} image "
                             "rows; send images the model's processor can take")
        return ids, inputs_of(tensors, self._items(images, rows, kwargs))

    def _embeds(self, text: str, rows: list[torch.Tensor], add_special_tokens: bool) -> tuple[list[int],
                                                                                            MultiModalInputs]:
        """Precomputed image embeddings in place of images (vLLM's: one [rows, hidden] tensor an image, or all of
        them as [images, rows, hidden]): each placeholder expanded into one image token a row; the rows go to the
        decoder as they are (a LLaVA model's only: SmolVLM's placeholders expand into tiles' markers)."""
        import torch

        if self.batched or self.config["architectures"][0] not in LLAVA:
            raise ValueError("image embeddings are taken by LLaVA models; send this model the images themselves")
        from pagellm.model.hf_config import with_defaults

        width = int(with_defaults(self.config.get("text_config") or {})["hidden_size"])
        if any(r.shape[-1] != width or not r.shape[0] or not r.is_floating_point() or not bool(r.isfinite().all())
               for r in rows):
            raise ValueError(f"image embeddings must be finite float tensors of [rows, {width}] (the model's hidden "
                             f"size) an image; got {[tuple(r.shape) for r in rows]}")
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(rows):
            raise ValueError(f"the prompt has {len(pieces) - 1} {self.image_token} placeholders for {len(rows)} "
                             f"images' embeddings; put one {self.image_token} where each image goes")
        text = pieces[0] + "".join(self.image_token * len(r) + piece for r, piece in zip(rows, pieces[1:]))
        ids = self.processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if ids.count(self.image_token_id) != sum(len(r) for r in rows):
            raise ValueError("the prompt's text holds image tokens of its own; write only one placeholder an image")
        items = [(hashlib.sha256(pack(r).data).hexdigest(), len(r)) for r in rows]
        return ids, inputs_of({"image_embeds": torch.cat([r.float() for r in rows])}, items)

    def _grid_embeds(self, text: str, given: dict[str, Any], add_special_tokens: bool) -> tuple[list[int],
                                                                                              MultiModalInputs]:
        """Qwen-VL's precomputed image embeddings (vLLM's ``{"image_embeds": [tokens, width], "image_grid_thw":
        [images, 3]}``: the tower's rows, Qwen3-VL's DeepStack rows beside each, and each image's patch grid, which
        places its tokens and their M-RoPE positions)."""
        if self.config["architectures"][0] not in QWEN_VL:
            raise ValueError("image embeddings with grids ({image_embeds, image_grid_thw}) are Qwen-VL models'; send "
                             "this model the images, or its embeddings as tensors")
        rows, grids = given.get("image_embeds"), given.get("image_grid_thw")
        width = self._row_width()
        if not (is_tensor(rows, 2) and is_tensor(grids, 2) and rows.shape[1] == width and grids.shape[1] == 3
                and rows.is_floating_point() and not grids.is_floating_point() and bool(rows.isfinite().all())
                and bool((grids > 0).all())):
            raise ValueError(f"Qwen-VL image embeddings are {{\"image_embeds\": a finite float tensor of [tokens, "
                             f"{width}], \"image_grid_thw\": an integer tensor of [images, 3]}}")
        counts = [int(n) // self._merge ** 2 for n in grids.prod(-1).tolist()]
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(counts) or sum(counts) != rows.shape[0]:
            raise ValueError(f"{len(counts)} image grids making {sum(counts)} image tokens for {rows.shape[0]} rows "
                             f"and {len(pieces) - 1} {self.image_token} placeholders; send one grid an image, one "
                             "placeholder an image, one row an image token")
        text = pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))
        ids = self.processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if ids.count(self.image_token_id) != sum(counts):
            raise ValueError("the prompt's text holds image tokens of its own; write only one placeholder an image")
        ends = [0, *[sum(counts[:i + 1]) for i in range(len(counts))]]
        items = [(hashlib.sha256(pack(rows[a:b]).data + pack(grid).data).hexdigest(), n)
                 for a, b, grid, n in zip(ends, ends[1:], grids, counts)]
        return ids, inputs_of({"image_embeds": rows.float(), "image_grid_thw": grids.long()}, items)

    @property
    def _merge(self) -> int:
        """A Qwen-VL model's patches merged along each side into one image token."""
        return int(self.config["vision_config"].get("spatial_merge_size", 2))

    def _row_width(self) -> int:
        """A Qwen-VL model's image row: its decoder's width, times 1 + Qwen3-VL's DeepStack layers."""
        from pagellm.model.hf_config import with_defaults

        text = with_defaults(self.config.get("text_config") or {}) or self.config
        deepstack = self.config["vision_config"].get("deepstack_visual_indexes") or ()
        return int(text["hidden_size"]) * (1 + len(deepstack))

    def _items(self, images: list[Any], rows: int, kwargs: dict[str, Any]) -> list[tuple[str, int]]:
        """Each image's digest and image tokens (the processor's own count, ``_get_num_multimodal_tokens``, as vLLM
        reads it); none where the processor cannot say or its counts do not add up to ``rows``. An image processed
        under other ``kwargs`` makes other rows: its digest covers them."""
        try:
            sizes = [(image.height, image.width) for image in images]
            counts = [int(n) for n in self.processor._get_num_multimodal_tokens(image_sizes=sizes, **kwargs)
                      .num_image_tokens]
        except (AttributeError, TypeError, ValueError, KeyError):
            return []
        settings = json.dumps(kwargs, sort_keys=True, default=str)
        digests = [hashlib.sha256(f"{settings}:{image_digest(image)}".encode()).hexdigest() for image in images]
        return list(zip(digests, counts)) if sum(counts) == rows else []

    def _rows(self, tensors: dict[str, torch.Tensor]) -> int:
        """The rows the model's encoder makes of ``tensors``: SmolVLM's ``image_seq_len`` a tile (all-zero padding
        tiles dropped); LLaVA's a tile's patches (``model/llava.py``: ``image_tokens``), LLaVA-NeXT's by each
        image's size; Gemma 3's ``mm_tokens_per_image`` a crop; Qwen2-VL's one a merged block of patches."""
        pixels = tensors["pixel_values"]
        if self.batched:
            tiles = int((pixels != 0).flatten(1).any(1).sum())
            return tiles * int(getattr(self.processor, "image_seq_len", 0))
        architecture = self.config["architectures"][0]
        if architecture in QWEN_VL:  # Qwen2-VL's: one a merged block of 2 x 2 patches
            return int(tensors["image_grid_thw"].prod(-1).sum()) // self._merge ** 2
        if architecture not in LLAVA:  # Gemma 3's: a fixed count a crop
            from pagellm.model.gemma3_mm import tokens_per_image

            return pixels.shape[0] * tokens_per_image(self.config)
        from pagellm.model.llava import image_tokens

        sizes = tensors["image_sizes"].tolist() if "image_sizes" in tensors else [(0, 0)] * pixels.shape[0]
        return sum(image_tokens(self.config, architecture, int(h), int(w)) for h, w in sizes)

