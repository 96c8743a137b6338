"""``load_format="dummy"`` (vLLM's ``--load-format dummy``): a model directory holding only its config.json (and a
tokenizer) runs in its shapes with random weights in [-1e-3, 1e-3], whose logits are all but equal; the other load
formats are checked against the model source."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams


@pytest.fixture(scope="module")
def config_only(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("config-only")
    for path in tiny_llama.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    return folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dummy_weights_run_the_models_shapes(config_only: Path, dtype: str) -> None:
    with pytest.raises(ValueError, match="no \\*.safetensors weights.*--load-format dummy"):
        LLM(str(config_only), dtype=dtype)
    llm = LLM(str(config_only), dtype=dtype, load_format="dummy", max_model_len=64)
    model = llm.engine.core.executor.worker.runner.model
    values = torch.cat([p.detach().float().flatten() for p in model.parameters() if p.dtype.is_floating_point])
    assert 0 < values.abs().max() <= 1e-3 * 1.01  # bfloat16 rounds the bound up a little
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate(["hello there"], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6
    vocab = json.loads((config_only / "config.json").read_text())["vocab_size"]
    uniform = -math.log(vocab)  # logits of weights this small are all but equal
    assert [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])] == \
        pytest.approx([uniform] * (len(out.prompt_token_ids) - 1), abs=1e-3)


def test_load_format_is_checked_against_the_source(config_only: Path) -> None:
    with pytest.raises(ValueError, match="load_format='pt'; use one of auto, safetensors, gguf, dummy"):
        LLM(str(config_only), load_format="pt")
    with pytest.raises(ValueError, match="load_format=gguf does not read"):
        LLM(str(config_only), load_format="gguf")
    with pytest.raises(ValueError, match="load_format=safetensors does not read the built-in .gguf"):
        LLM(None, load_format="safetensors")
    with pytest.raises(ValueError, match="load_format=dummy makes a model from its config.json"):
        LLM(None, load_format="dummy")
