"""How a request shapes its prompt (vLLM's fields): ``truncate_prompt_tokens`` keeps the last k tokens,
``continue_final_message`` leaves the last message open for the model to continue, ``add_special_tokens`` adds the
tokenizer's BOS (completions by default, chat only when asked: the template writes its own), ``cache_salt`` keeps
one tenant's prefix-cache blocks from another's."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from metrics_utils import scrape, value
from server_utils import ServerProcess
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.processors import TemplateProcessing

from pagellm.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.server.openai.serving_chat import OpenAIServingChat
from pagellm.server.openai.serving_completion import OpenAIServingCompletion
from pagellm.tokenizer import Tokenizer

BOS = 256  # the tiny tokenizer's <s>
CONTINUED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The sky is"}]
OPEN = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe sky is"  # the tiny template, last turn open


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.OpenAI) -> None:
    prompt = "0123456789abcdefghij"  # one token per character
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, echo=True,
                                    extra_body={"truncate_prompt_tokens": 6, "ignore_eos": True})
    assert cut.usage.prompt_tokens == 6 and cut.choices[0].text.startswith("efghij")
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1, "ignore_eos": True})
    assert whole.usage.prompt_tokens == 20  # -1: up to max_model_len, which the prompt is under
    chat = client.chat.completions.create(model="tiny", messages=CONTINUED, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 5, "ignore_eos": True})
    assert chat.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError, match=r"truncate_prompt_tokens \(513\) must be at most max_model_len"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": 513})


def test_truncation_side_right_keeps_the_first_tokens(client: openai.OpenAI) -> None:
    """vLLM 0.32's ``truncation_side``: "right" cuts the prompt's end (completions, chat, embeddings), "left" its
    start, as without it; anything else is a 400 naming the field."""
    prompt = "0123456789abcdefghij"  # one token per character
    for side, kept in (("right", "012345"), ("left", "efghij")):
        cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, echo=True, extra_body={
            "truncate_prompt_tokens": 6, "truncation_side": side, "ignore_eos": True})
        assert cut.usage.prompt_tokens == 6 and cut.choices[0].text.startswith(kept)
    chat = client.chat.completions.create(model="tiny", messages=CONTINUED, max_tokens=1, extra_body={
        "truncate_prompt_tokens": 5, "truncation_side": "right", "ignore_eos": True, "return_token_ids": True})
    head = client.completions.create(model="tiny", prompt=OPEN, max_tokens=1, extra_body={
        "truncate_prompt_tokens": 5, "truncation_side": "right", "add_special_tokens": False,
        "return_token_ids": True})
    assert chat.usage.prompt_tokens == 5  # the template's first 5 tokens ran
    assert chat.model_extra["prompt_token_ids"] == head.choices[0].model_extra["prompt_token_ids"]
    right = client.embeddings.create(model="tiny", input=prompt, extra_body={"truncate_prompt_tokens": 6,
                                                                             "truncation_side": "right"})
    first = client.embeddings.create(model="tiny", input=prompt[:6])
    assert right.data[0].embedding == first.data[0].embedding and right.usage.prompt_tokens == 6
    with pytest.raises(openai.BadRequestError, match="truncation_side"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={
            "truncate_prompt_tokens": 6, "truncation_side": "middle"})


def test_cache_salt_shares_prefix_cache_blocks_only_within_one_salt(server: ServerProcess,
                                                                    client: openai.OpenAI) -> None:
    prompt = "cache salt test: a prompt of three whole sixteen-token blocks and some more characters"  # 1 per char

    def hits_of(**extra: object) -> float:
        before = value(scrape(server.base_url), "pagellm:prefix_cache_hits_total")
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra)
        return value(scrape(server.base_url), "pagellm:prefix_cache_hits_total") - before

    assert hits_of(cache_salt="tenant-a") == 0  # the first with this prompt
    assert hits_of(cache_salt="tenant-a") >= 64  # the same tenant again
    assert hits_of(cache_salt="tenant-b") == 0  # another tenant: its own blocks
    assert hits_of() == 0  # no salt: none of the salted blocks
    assert hits_of() >= 64
    assert hits_of(cache_salt="tenant-a", prompt_logprobs=0) == 0  # scoring the prompt computes all of it
    chat = [{"role": "user", "content": prompt}]
    for extra, hits in (({}, 0), ({"cache_salt": "tenant-c"}, 0), ({"cache_salt": "tenant-c"}, 64)):
        before = value(scrape(server.base_url), "pagellm:prefix_cache_hits_total")
        client.chat.completions.create(model="tiny", messages=chat, max_tokens=1, extra_body=extra)
        got = value(scrape(server.base_url), "pagellm:prefix_cache_hits_total") - before
        assert got >= hits if hits else got == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": ""})


def test_continue_final_message_leaves_the_last_turn_open(server: ServerProcess, client: openai.OpenAI) -> None:
    tokens = httpx.post(f"{server.base_url}/tokenize", json={
        "messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True}).json()["tokens"]
    assert tokens == Tokenizer.from_dir(server.model).encode(OPEN, add_special_tokens=False)
    reply = client.chat.completions.create(model="tiny", messages=CONTINUED, max_tokens=3, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True})
    assert reply.usage.prompt_tokens == len(tokens) and reply.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="continue_final_message needs add_generation_prompt: false"):
        client.chat.completions.create(model="tiny", messages=CONTINUED, max_tokens=1,
                                       extra_body={"continue_final_message": True})


@pytest.fixture(scope="module")
def bos_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a tokenizer that adds <s> before every encoded text, as Llama's does."""
    path = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(tiny_llama, path)
    backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    backend.save(str(path / "tokenizer.json"))
    return path


def _engine(model: Path) -> SimpleNamespace:
    """What request preparation reads of the engine (no request is run): its tokenizer and limits."""
    return SimpleNamespace(tokenizer=Tokenizer.from_dir(model), sampling_defaults={}, max_logprobs=20,
                           enable_prompt_embeds=False, check_custom=lambda params: None, image_placeholder=None,
                           runtime=SimpleNamespace(max_model_len=512, vocab_size=320, hidden_size=64,
                                                   pooling_only=False, labels=()))


def test_add_special_tokens_puts_the_bos_where_asked(bos_model: Path) -> None:
    completions = OpenAIServingCompletion(_engine(bos_model), ["tiny"])
    abc = completions.tokenizer.encode("abc", add_special_tokens=False)
    assert len(abc) == 3 and BOS not in abc
    assert completions.prepare(CompletionRequest(prompt="abc")).prompts == [[BOS, *abc]]
    assert completions.prepare(CompletionRequest(prompt="abc", add_special_tokens=False)).prompts == [abc]
    chat = OpenAIServingChat(_engine(bos_model), ["tiny"])
    rendered = chat.tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False)
    messages = CONTINUED[:1]
    assert chat.prepare(ChatCompletionRequest(messages=messages)).prompt == rendered
    assert chat.prepare(ChatCompletionRequest(messages=messages, add_special_tokens=True)).prompt == [BOS, *rendered]
