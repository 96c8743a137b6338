"""Images in chat requests (OpenAI's ``image_url`` parts) on a live server through the ``openai`` SDK: a tiny
random Idefics3 (``vlm_utils``), one image as a data URL and one fetched from a real HTTP server on this machine.

The reply's tokens must be the offline ``LLM.chat``'s on the same conversation (whose tokens are transformers',
``tests/engine/test_idefics3.py``), whole and streamed, with the images' tokens counted in the usage; images that
cannot be read are a 400 that says what to send, and the server serves on."""

from __future__ import annotations

import base64
import http.server
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import anthropic
import openai
import pytest
from server_utils import ServerProcess
from vlm_utils import build_llava, build_qwen2_vl, build_vlm, data_url, image, png

from pagellm import LLM, SamplingParams
from pagellm.cli import main
from pagellm.prompt_embeds import save
from pagellm.server.openai.protocol import ChatCompletionRequest
from pagellm.server.openai.serving_chat import OpenAIServingChat
from pagellm.tokenizer import Tokenizer

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def vlm(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vlm(tiny_llama, tmp_path_factory.mktemp("vlm-serving"))


@pytest.fixture(scope="module")
def picture_url() -> Iterator[str]:
    """An HTTP server on this machine with one PNG at /cat.png (anything else: 404)."""
    body = png(image(7, 50, 38))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the handler's name)
            found = self.path == "/cat.png"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(body if found else b"")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the server reads file:// images from: one PNG, and a link to one outside it."""
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png(image(1, 40, 56)))
    (folder.parent / "outside.png").write_bytes(png(image(2, 40, 56)))
    (folder / "link.png").symlink_to(folder.parent / "outside.png")
    return folder


@pytest.fixture(scope="module")
def server(vlm: Path, media: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ["--served-model-name", "tiny", "--allowed-local-media-path", str(media),
             "--allowed-media-domains", "127.0.0.1"]
    process = ServerProcess(vlm, flags, tmp_path_factory.mktemp("vlm-server") / "log")
    try:
        process.wait_healthy()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def _messages(*urls: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Compare these."},
                                         *({"type": "image_url", "image_url": {"url": url}} for url in urls)]}]


def test_a_served_reply_to_images_is_the_offline_chats(client: openai.OpenAI, vlm: Path, picture_url: str) -> None:
    messages = _messages(data_url(image(1, 40, 56)), picture_url)
    offline = LLM(str(vlm), dtype="float32", kv_cache_memory=1 << 24).chat(
        messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    body = {"return_token_ids": True, "ignore_eos": True}
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=body)
    assert reply.choices[0].token_ids == offline.outputs[0].token_ids
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids) > 2 * 20  # two images of 20 tokens each
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, extra_body=body))
    assert [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])] == \
        offline.outputs[0].token_ids


def test_the_responses_api_reads_input_images_as_chat_reads_image_parts(client: openai.OpenAI,
                                                                        picture_url: str) -> None:
    """``input_image`` parts (a data URL, and an http(s) one the route fetches) become the chat's image parts: the
    reply is the chat reply's."""
    first = data_url(image(1, 40, 56))
    chat = client.chat.completions.create(model="tiny", messages=_messages(first, picture_url), max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
    content = [{"type": "input_text", "text": "Compare these."}, {"type": "input_image", "image_url": first},
               {"type": "input_image", "image_url": picture_url}]
    response = client.responses.create(model="tiny", input=[{"role": "user", "content": content}],
                                       max_output_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_anthropic_image_blocks_are_read_as_chat_reads_image_parts(server: ServerProcess, client: openai.OpenAI,
                                                                   picture_url: str) -> None:
    """Through the ``anthropic`` SDK: a base64 source and a url source (fetched by the route) become the chat's image
    parts: the reply, its usage and count_tokens are the chat's."""
    picture = image(1, 40, 56)
    chat = client.chat.completions.create(model="tiny", messages=_messages(data_url(picture), picture_url),
                                          max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(picture)).decode()}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare these."},
                                             {"type": "image", "source": source},
                                             {"type": "image", "source": {"type": "url", "url": picture_url}}]}]
    message = claude.messages.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                     extra_body={"temperature": 0, "ignore_eos": True})
    assert message.content[0].text == chat.choices[0].message.content
    usage = message.usage  # Anthropic counts the prefix cache's reads apart (the same images: the chat's blocks)
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert claude.messages.count_tokens(model="tiny", messages=messages).input_tokens == chat.usage.prompt_tokens
    messages[0]["content"][2]["source"]["url"] = picture_url.replace("cat", "dog")
    with pytest.raises(anthropic.BadRequestError, match="answered HTTP 404"):
        claude.messages.create(model="tiny", messages=messages, max_tokens=2)


def test_bench_serve_random_mm_drives_the_server_with_images(server: ServerProcess, tmp_path: Path) -> None:
    """``pagellm bench serve --dataset-name random-mm`` (vLLM's workload and flags): every request served, its
    prompt counted by the server with its image's tokens (20 each here)."""
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", server.base_url, "--no-progress", "--dataset-name", "random-mm",
               "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "3", "--num-warmups", "0",
               "--random-mm-bucket-config", "{(40, 56, 1): 1.0}", "--result-json", str(out)])
    assert rc == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["metrics"]["completed"], run["metrics"]["failed"], run["metrics"]["total_output_tokens"]) == (3, 0, 9)
    assert all(r["prompt_len"] > 20 + 4 for r in run["requests"])


def test_a_requests_mm_processor_kwargs_reach_the_processor(client: openai.OpenAI) -> None:
    """vLLM's ``mm_processor_kwargs`` request field: SmolVLM's image as one tile (4 image tokens) instead of five."""
    messages = _messages(data_url(image(1, 40, 56)))
    whole, split = (client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body=body)
                    for body in ({"mm_processor_kwargs": {"do_image_splitting": False}}, {}))
    assert split.usage.prompt_tokens - whole.usage.prompt_tokens >= 16


def test_images_that_cannot_be_read_are_refused_and_the_server_serves_on(client: openai.OpenAI,
                                                                         picture_url: str) -> None:
    for url, message in [("data:image/png;base64,!!!", "base64 does not decode"),
                         ("data:image/png;base64,aGVsbG8=", "is no image PIL can open"),
                         (picture_url.replace("cat", "dog"), "answered HTTP 404"),
                         ("file:///etc/passwd", "is outside --allowed-local-media-path")]:
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model="tiny", messages=_messages(url), max_tokens=2)
    embeds = [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": "AAAA"}]}]
    with pytest.raises(openai.BadRequestError, match=r"image embeddings need --enable-mm-embeds"):
        client.chat.completions.create(model="tiny", messages=embeds, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="use_beam_search cannot carry a prompt's images"):
        client.chat.completions.create(model="tiny", messages=_messages(picture_url), max_tokens=2,
                                       extra_body={"use_beam_search": True})
    reply = client.chat.completions.create(model="tiny", messages=_messages(picture_url), max_tokens=2)
    assert reply.choices[0].finish_reason == "length"


def test_file_urls_inside_the_media_folder_and_only_the_allowed_hosts_are_read(client: openai.OpenAI, media: Path,
                                                                              picture_url: str) -> None:
    """--allowed-local-media-path: a file:// image there is the data URL of its bytes to the model (the same reply);
    a link out of it is refused. --allowed-media-domains 127.0.0.1: the same server by another name is refused."""
    replies = [client.chat.completions.create(model="tiny", messages=_messages(url), max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
               for url in (f"file://{media}/cat.png", data_url(image(1, 40, 56)))]
    assert replies[0].choices[0].token_ids == replies[1].choices[0].token_ids
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens
    for url, message in [(f"file://{media}/link.png", "is outside --allowed-local-media-path"),
                         (picture_url.replace("127.0.0.1", "localhost"), "names host 'localhost', not one of "
                                                                         r"--allowed-media-domains \(127.0.0.1\)")]:
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model="tiny", messages=_messages(url), max_tokens=2)


def test_a_model_without_images_says_so(tiny_llama: Path) -> None:
    engine = SimpleNamespace(tokenizer=Tokenizer.from_dir(tiny_llama), sampling_defaults={}, max_logprobs=20,
                             enable_prompt_embeds=False, check_custom=lambda params: None, image_placeholder=None,
                             runtime=SimpleNamespace(max_model_len=512, vocab_size=320, hidden_size=64,
                                                     pooling_only=False, labels=()))
    request = ChatCompletionRequest(messages=_messages("data:image/png;base64,AAAA"))
    with pytest.raises(ValueError, match=r"only text parts are supported \(this model takes no images\), got a "
                                         "'image_url' part"):
        OpenAIServingChat(engine, ["tiny"]).prepare(request)


def test_image_embeds_parts_are_served_with_enable_mm_embeds(tiny_llama: Path, tmp_path: Path) -> None:
    """A LLaVA server started with --enable-mm-embeds (vLLM's flag) reads chat's ``image_embeds`` parts (base64 of a
    torch.save): the reply is the one to the image itself."""
    model = build_llava(tiny_llama, tmp_path / "llava")
    picture = image(5, 44, 60)
    offline = LLM(str(model), dtype="float32", kv_cache_memory=1 << 22)
    rows = offline.engine.core.executor.worker.runner.model.image_rows(
        offline.input_processor.process_images("<image>", [picture]).inputs)
    server = ServerProcess(model, ["--served-model-name", "tiny", "--enable-mm-embeds"], tmp_path / "log")
    try:
        server.wait_healthy()
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
        replies = [client.chat.completions.create(
            model="tiny", max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}])
            for part in ({"type": "image_url", "image_url": {"url": data_url(picture)}},
                         {"type": "image_embeds", "image_embeds": base64.b64encode(save(rows)).decode()})]
    finally:
        server.stop()
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens > 16


def test_a_qwen2_vl_server_replies_to_images_as_offline_chat(tiny_qwen2: Path, tmp_path: Path) -> None:
    """A tiny Qwen2.5-VL (``vlm_utils.build_qwen2_vl``) served: a chat with two images of different sizes gets the
    offline ``LLM.chat``'s tokens (transformers' own, ``tests/engine/test_qwen2_vl.py``), whole and streamed, and
    each image's tokens (one a merged 2 x 2 block of its patches) counted in the usage."""
    model = build_qwen2_vl(tiny_qwen2, tmp_path / "qwen2_5_vl", "qwen2_5_vl")
    messages = _messages(data_url(image(1, 40, 56)), data_url(image(2, 110, 80)))
    offline = LLM(str(model), dtype="float32", kv_cache_memory=1 << 22).chat(
        messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    server = ServerProcess(model, ["--served-model-name", "tiny"], tmp_path / "log")
    body = {"return_token_ids": True, "ignore_eos": True}
    try:
        server.wait_healthy()
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body=body)
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True, extra_body=body))
    finally:
        server.stop()
    assert reply.choices[0].token_ids == offline.outputs[0].token_ids
    assert [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])] == \
        offline.outputs[0].token_ids
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids) > 6 + 12  # 2 x 3 and 4 x 3 merged blocks
