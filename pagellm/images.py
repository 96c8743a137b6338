"""Images named by URL in chat messages (OpenAI's ``image_url`` parts), read into PIL images for the model's
processor.

- ``data:`` URLs (``data:image/png;base64,...``) carry the image itself;
- ``http://`` and ``https://`` URLs are fetched (``fetch``: concurrently, each within ``FETCH_TIMEOUT_S`` and at
  most ``MAX_IMAGE_BYTES``, as vLLM fetches them; ``fetch_sync`` for the offline ``LLM.chat``);
- ``file:`` URLs are read only under ``--allowed-local-media-path`` (a server does not read its own files for a
  client unless told to), and ``--allowed-media-domains`` names the only hosts http(s) URLs, and the redirects they
  answer with, may reach (``mm_config.MultiModalConfig``, as vLLM's flags).

Anything that is no image PIL can open is a ValueError naming the part and what to send.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
from typing import Any
from urllib.parse import unquote, urlsplit

from pagellm.mm_config import MultiModalConfig

FETCH_TIMEOUT_S = 10.0
MAX_IMAGE_BYTES = 20 << 20
_SEND = "send a data:image/...;base64 URL or an http(s) URL of a PNG, JPEG, GIF or WebP image"


def is_remote(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def is_fetched(url: str) -> bool:
    """Whether ``fetch`` reads the image ``url`` names: an http(s) or a file URL."""
    return is_remote(url) or url.startswith("file:")


def load(url: str, fetched: dict[str, bytes] | None = None) -> Any:
    """The RGB PIL image of ``url``: a data URL's, or the bytes ``fetched`` holds for an http(s) URL; an
    ``image_embeds`` part's tensor (``chat_content.EmbedsSource``)."""
    from PIL import Image, UnidentifiedImageError

    from pagellm.chat_content import EmbedsSource

    if isinstance(url, EmbedsSource):
        rows = load_embeds(url)
        return rows if url.grid is None else {"image_embeds": rows, "image_grid_thw": load_embeds(url.grid, grid=True)}

    if url.startswith("data:"):
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise ValueError(f"an image data URL must be base64 (data:image/png;base64,...); {_SEND}")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"an image data URL's base64 does not decode; {_SEND}") from None
    elif is_fetched(url) and fetched is not None and url in fetched:
        data = fetched[url]
    else:
        raise ValueError(f"image URL {url[:60]!r} cannot be read here; {_SEND}")
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"image {url[:60]!r} is no image PIL can open ({exc}); {_SEND}") from None


def load_embeds(payload: str, grid: bool = False) -> Any:
    """An ``image_embeds`` part's tensor: base64 of a ``torch.save``d tensor (read with ``weights_only``: anything but
    tensors is refused, never run) or of a ``.npy`` array (no pickles); [rows, hidden], dense, floating, finite; or
    (``grid``) a Qwen-VL image's ``image_grid_thw``, [images, 3] integers."""
    import numpy as np
    import torch

    why = "image_grid_thw must be base64 of a torch.save()d tensor or a .npy array of [images, 3] integers" if grid \
        else "image_embeds must be base64 of a torch.save()d tensor or a .npy array of [rows, hidden] floats"
    try:
        data = base64.b64decode(payload, validate=True)
        tensor = torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False)) if data[:6] == b"\x93NUMPY" \
            else torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001  (base64, numpy and torch raise many kinds for damaged input)
        raise ValueError(why) from None
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided or tensor.dim() != 2 \
            or tensor.is_floating_point() != (not grid) or not tensor.numel() or not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{why} (finite, at least one row)")
    return tensor.contiguous()


async def fetch(urls: list[str], media: MultiModalConfig | None = None) -> dict[str, bytes]:
    """The bytes of each http(s) URL of ``urls`` (fetched concurrently) and file URL (read), as ``media`` allows;
    ValueError naming one that fails or is not allowed."""
    import httpx

    media = media or MultiModalConfig()
    wanted = sorted({url for url in urls if is_fetched(url)})
    local = {url: await asyncio.to_thread(_read_local, url, media.allowed_local_media_path)
             for url in wanted if url.startswith("file:")}
    remote = [url for url in wanted if url not in local]
    if not remote:
        return local
    async def check_hop(request: Any) -> None:  # each request before it is sent, redirects included
        _check_host(str(request.url), media.allowed_media_domains)

    async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=True,
                                 event_hooks={"request": [check_hop]}) as client:
        bodies = await asyncio.gather(*(_get(client, url) for url in remote))
    return {**local, **dict(zip(remote, bodies))}


def fetch_sync(urls: list[str], media: MultiModalConfig | None = None) -> dict[str, bytes]:
    """``fetch`` for callers without an event loop (the offline ``LLM.chat``)."""
    return asyncio.run(fetch(urls, media)) if any(is_fetched(url) for url in urls) else {}


def _check_host(url: str, domains: tuple[str, ...] | None) -> None:
    """A ValueError unless ``url``'s host is one of ``domains`` (None: any host)."""
    host = urlsplit(url).hostname
    if domains is not None and host not in domains:
        raise ValueError(f"image URL {url[:60]!r} names host {host!r}, not one of --allowed-media-domains "
                         f"({', '.join(domains)})")


def _read_local(url: str, folder: str | None) -> bytes:
    """The bytes of the image file ``url`` names (``file:///abs/path``, or ``file://localhost/...``), which must
    lie in ``folder`` once symbolic links are followed."""
    if folder is None:
        raise ValueError(f"image URL {url[:60]!r}: file URLs are read only under the folder the server names with "
                         f"--allowed-local-media-path (LLM(allowed_local_media_path=...)); {_SEND}")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise ValueError(f"image URL {url[:60]!r}: a file URL names an absolute local path, file:///path/to/image")
    path = os.path.realpath(unquote(parts.path))
    if os.path.commonpath([path, folder]) != folder:
        raise ValueError(f"image URL {url[:60]!r} is outside --allowed-local-media-path ({folder})")
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"image URL {url[:60]!r} could not be read: {exc.strerror or type(exc).__name__}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"image URL {url[:60]!r} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    return data


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
