"""Images named by URL in chat messages (OpenAI's ``image_url`` parts), read into PIL images for the model's
processor.

- ``data:`` URLs (``data:image/png;base64,...``) carry the image itself;
- ``http://`` and ``https://`` URLs are fetched (``fetch``: concurrently, each within ``FETCH_TIMEOUT_S`` and at
  most ``MAX_IMAGE_BYTES``, as vLLM fetches them; ``fetch_sync`` for the offline ``LLM.chat``);
- other schemes (``file:``) are refused: a server does not read its own files for a client.

Anything that is no image PIL can open is a ValueError naming the part and what to send.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from typing import Any

FETCH_TIMEOUT_S = 10.0
MAX_IMAGE_BYTES = 20 << 20
_SEND = "send a data:image/...;base64 URL or an http(s) URL of a PNG, JPEG, GIF or WebP image"


def is_remote(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def load(url: str, fetched: dict[str, bytes] | None = None) -> Any:
    """The RGB PIL image of ``url``: a data URL's, or the bytes ``fetched`` holds for an http(s) URL; an
    ``image_embeds`` part's tensor (``chat_content.EmbedsSource``)."""
    from PIL import Image, UnidentifiedImageError

    from pagellm.chat_content import EmbedsSource

    if isinstance(url, EmbedsSource):
        return load_embeds(url)

    if url.startswith("data:"):
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise ValueError(f"an image data URL must be base64 (data:image/png;base64,...); {_SEND}")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"an image data URL's base64 does not decode; {_SEND}") from None
    elif is_remote(url) and fetched is not None and url in fetched:
        data = fetched[url]
    else:
        raise ValueError(f"image URL {url[:60]!r} cannot be read here; {_SEND}")
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"image {url[:60]!r} is no image PIL can open ({exc}); {_SEND}") from None


def load_embeds(payload: str) -> Any:
    """An ``image_embeds`` part's tensor: base64 of a ``torch.save``d tensor (read with ``weights_only``: anything but
    tensors is refused, never run) or of a ``.npy`` array (no pickles); [rows, hidden], dense, floating, finite."""
    import numpy as np
    import torch

    why = "image_embeds must be base64 of a torch.save()d tensor or a .npy array of [rows, hidden] floats"
    try:
        data = base64.b64decode(payload, validate=True)
        tensor = torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False)) if data[:6] == b"\x93NUMPY" \
            else torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001  (base64, numpy and torch raise many kinds for damaged input)
        raise ValueError(why) from None
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided or tensor.dim() != 2 \
            or not tensor.is_floating_point() or not tensor.numel() or not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{why} (finite, at least one row)")
    return tensor.contiguous()


async def fetch(urls: list[str]) -> dict[str, bytes]:
    """The bytes of each http(s) URL of ``urls`` (fetched concurrently); ValueError naming one that fails."""
    import httpx

    remote = sorted({url for url in urls if is_remote(url)})
    if not remote:
        return {}
    async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=True) as client:
        bodies = await asyncio.gather(*(_get(client, url) for url in remote))
    return dict(zip(remote, bodies))


def fetch_sync(urls: list[str]) -> dict[str, bytes]:
    """``fetch`` for callers without an event loop (the offline ``LLM.chat``)."""
    return asyncio.run(fetch(urls)) if any(is_remote(url) for url in urls) else {}


async def _get(client: Any, url: str) -> bytes:
    import httpx

    try:
        async with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise ValueError(f"image URL {url[:60]!r} answered HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_IMAGE_BYTES:
                    raise ValueError(f"image URL {url[:60]!r} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
            return bytes(body)
    except httpx.HTTPError as exc:
        raise ValueError(f"image URL {url[:60]!r} could not be fetched: {type(exc).__name__}") from None
