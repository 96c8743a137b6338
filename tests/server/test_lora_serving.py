"""LoRA adapters served by name (``--enable-lora --lora-modules name=path``): ``/v1/models`` lists them with their
base, a request naming one runs with it (greedy text equal to ``peft``'s in float32) while the base name runs
without, and a server asked to serve an adapter that does not fit refuses to start, saying why."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest
import torch
import transformers
from lora_utils import build_lora_adapter
from server_utils import ServerProcess

from pagellm.server.options import add_serve_args, serve_options
from pagellm.tokenizer import Tokenizer

PROMPT = "The adapter says"


def _letters(model_dir: Path) -> list[int]:
    """The tiny byte tokenizer's ids of printable ASCII: replies made of them decode one character per token."""
    tokenizer = Tokenizer.from_dir(model_dir)
    return sorted({tokenizer.encode(chr(c), add_special_tokens=False)[0] for c in range(32, 127)})


def _peft_text(model_dir: Path, adapter: Path | None, tokens: int) -> str:
    """PEFT's greedy reply, over printable ASCII only (as the requests ask with allowed_token_ids)."""
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()
    tokenizer = Tokenizer.from_dir(model_dir)
    prompt, allowed = tokenizer.encode(PROMPT), set(_letters(model_dir))
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, suppress_tokens=[t for t in range(model.config.vocab_size)
                                                               if t not in allowed])
    return tokenizer.decode(out[0, len(prompt):].tolist())


@pytest.fixture(scope="module")
def adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lora_adapter(tiny_llama, tmp_path_factory.mktemp("lora") / "sql", 11,
                              ["q_proj", "v_proj", "down_proj"], 8)


def test_a_request_naming_an_adapter_runs_with_it(start_server: Callable[..., ServerProcess], tiny_llama: Path,
                                                  adapter: Path) -> None:
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--enable-lora", "--lora-modules",
                          f"sql={adapter}")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "sql"} and cards["sql"].parent == "tiny" and cards["sql"].root == str(adapter)
    texts = {}
    for model, path in (("sql", adapter), ("tiny", None)):
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={
            "ignore_eos": True, "allowed_token_ids": _letters(tiny_llama)})
        assert reply.choices[0].text == _peft_text(tiny_llama, path, 8) and reply.model == model
        texts[model] = reply.choices[0].text
    assert texts["sql"] != texts["tiny"]  # the adapter changes the reply
    with pytest.raises(openai.NotFoundError, match="this server serves tiny, sql"):
        client.completions.create(model="nosql", prompt=PROMPT, max_tokens=2)
    # an adapter tokenizes as its base model does (vLLM's /tokenize and /detokenize take its name too)
    tokenized = [httpx.post(f"{server.base_url}/tokenize", json={"model": name, "prompt": PROMPT})
                 for name in ("sql", "tiny")]
    assert [r.status_code for r in tokenized] == [200, 200] and tokenized[0].json() == tokenized[1].json()
    back = httpx.post(f"{server.base_url}/detokenize", json={"model": "sql", "tokens": tokenized[0].json()["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == PROMPT
    assert httpx.post(f"{server.base_url}/tokenize", json={"model": "nosql", "prompt": "x"}).status_code == 404


def test_adapters_load_and_unload_at_run_time_when_allowed(start_server: Callable[..., ServerProcess],
                                                           tiny_llama: Path, adapter: Path, tmp_path: Path) -> None:
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--enable-lora", "--allow-runtime-lora-updating")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    url = f"{server.base_url}/v1"
    assert [m.id for m in client.models.list().data] == ["tiny"]
    loaded = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter)})
    assert loaded.status_code == 200 and [m.id for m in client.models.list().data] == ["tiny", "sql"]
    reply = client.completions.create(model="sql", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={
        "ignore_eos": True, "allowed_token_ids": _letters(tiny_llama)})
    assert reply.choices[0].text == _peft_text(tiny_llama, adapter, 8)
    for body, status, message in (({"lora_name": "sql", "lora_path": str(adapter)}, 400, "is served already"),
                                  ({"lora_name": "tiny", "lora_path": str(adapter)}, 400, "is served already"),
                                  ({"lora_name": "bad", "lora_path": str(tmp_path)}, 400, "adapter_config.json")):
        response = httpx.post(f"{url}/load_lora_adapter", json=body)
        assert response.status_code == status and message in response.json()["error"]["message"]
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404
    plain = start_server(tiny_llama, "--enable-lora")  # without the flag the routes do not exist
    assert httpx.post(f"{plain.base_url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}) \
        .status_code == 404


def test_an_adapter_that_does_not_fit_stops_the_start(start_server: Callable[..., ServerProcess], tiny_llama: Path,
                                                      tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="cannot read adapter_config.json"):
        start_server(tiny_llama, "--enable-lora", "--lora-modules", f"gone={tmp_path / 'missing'}")


def test_the_lora_flags_as_vllm_spells_them(tmp_path: Path) -> None:
    cmd = argparse.ArgumentParser()
    add_serve_args(cmd)
    cmd.add_argument("--enable-lora", action="store_true")  # an engine flag in `pagellm serve`
    args = cmd.parse_args(["--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}'])
    assert serve_options(args).lora_modules == (("a", "/x"), ("b", "/y"))
    with pytest.raises(ValueError, match="--lora-modules and --allow-runtime-lora-updating need --enable-lora"):
        serve_options(cmd.parse_args(["--lora-modules", "a=/x"]))
    with pytest.raises(ValueError, match="must differ from each other"):
        serve_options(cmd.parse_args(["--enable-lora", "--lora-modules", "a=/x", "a=/y"]))
    with pytest.raises(SystemExit):
        cmd.parse_args(["--lora-modules", "no-path"])
