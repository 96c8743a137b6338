"""``skip_tokenizer_init`` (vLLM's ``--skip-tokenizer-init``): a model folder without tokenizer files runs on token
ids alone, generating the tokens it generates with its tokenizer, with the EOS ids of its configs; what needs text
is refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def weights_only(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("weights-only")
    for path in tiny_llama.iterdir():
        if not path.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(path, folder / path.name)
    return folder


def test_token_ids_in_token_ids_out(tiny_llama: Path, weights_only: Path) -> None:
    prompts = [[72, 101, 108, 108, 111], [84, 104, 101, 32, 115, 107, 121]]
    expected = LLM(str(tiny_llama), dtype="float32", max_model_len=64).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(weights_only), dtype="float32", max_model_len=64, skip_tokenizer_init=True)
    assert llm.tokenizer.eos_token_ids == frozenset({257})  # the model's config.json
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, ref in zip(outputs, expected):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.outputs[0].text == ""
        assert [list(e) for e in out.outputs[0].logprobs] == [list(e) for e in ref.outputs[0].logprobs]
        assert all(lp.decoded_token == "" for e in out.outputs[0].logprobs for lp in e.values())
    for call in (lambda: llm.generate(["text"], GREEDY, use_tqdm=False),
                 lambda: llm.generate([prompts[0]], SamplingParams(stop=["x"]), use_tqdm=False),
                 lambda: llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)):
        with pytest.raises(ValueError, match="runs without a tokenizer .*--skip-tokenizer-init"):
            call()
    with pytest.raises(ValueError, match="runs without a tokenizer .*--skip-tokenizer-init"):
        llm.get_tokenizer()
    with pytest.raises(ValueError, match="leave tokenizer unset"):
        LLM(str(weights_only), skip_tokenizer_init=True, tokenizer=str(tiny_llama))
