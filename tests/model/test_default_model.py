"""The built-in SmolLM2-135M-Instruct end to end through ``LLM``: greedy chat parity with transformers, seeded
sampling that is reproducible in any batch, stop strings and length caps.

The GGUF is converted once per session into the same cache root test_loader.py and test_tokenizer.py use. One
engine serves every test here; the greedy run is shared (the stop-string test picks its stop word from it).
Generation on CPU is the cost here, so every generate call batches what it can and runs few steps.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.model.loader import hf_model_dir, resolve_model_dir
from pagellm.outputs import RequestOutput

# Chosen so the chat template makes them the same length (36 tokens): transformers then runs them as one batch
# with no padding, so its reference needs no attention-mask subtleties and one generate() call.
USER_PROMPTS = ["Why is the sky blue?", "Explain what a CPU does.", "How do plants make food?"]
MAX_TOKENS = 32
SAMPLE_TOKENS = 10


def conversation(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def greedy_params(**overrides: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **overrides})


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The converted built-in model; the cache root stays set while this module's engine is built and used."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGELLM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "pagellm-cache"))
        yield resolve_model_dir(None)


@pytest.fixture(scope="module")
def llm(default_dir: Path) -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def hf_tokenizer(default_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_dir), local_files_only=True)


@pytest.fixture(scope="module")
def greedy(llm: LLM) -> list[RequestOutput]:
    outputs = llm.chat([conversation(p) for p in USER_PROMPTS], greedy_params(), use_tqdm=False)
    for out in outputs:
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == MAX_TOKENS
    return outputs


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_llm_uses_the_converted_default_model(llm: LLM, default_dir: Path) -> None:
    assert resolve_model_dir(None) == default_dir
    assert llm.engine.runtime.vocab_size == 49152
    assert llm.tokenizer.eos_token_ids == {2}  # <|im_end|>


def test_chat_prompts_match_transformers_template(greedy: list[RequestOutput], hf_tokenizer: Any) -> None:
    for text, out in zip(USER_PROMPTS, greedy):
        expected = hf_tokenizer.apply_chat_template(conversation(text), add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
        assert out.prompt_token_ids == list(expected)
        assert out.prompt is None  # chat prompts reach generate() as token ids


def test_greedy_chat_parity_with_transformers(greedy: list[RequestOutput], default_dir: Path,
                                              hf_tokenizer: Any) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [out.prompt_token_ids for out in greedy]
    assert len({len(p) for p in prompts}) == 1, "USER_PROMPTS must template to one length (no padding)"
    # transformers reads the 4-bit matrices' float32 copies, written now (the engine decoded the blocks)
    model = AutoModelForCausalLM.from_pretrained(hf_model_dir(None), dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    # An explicit mask: otherwise generate() takes prompt tokens equal to the pad id (here EOS) for padding.
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=hf_tokenizer.pad_token_id, output_logits=True,
                         return_dict_in_generate=True)
    logits = torch.stack(ref.logits, dim=1).float()  # [batch, steps, vocab]
    flips = 0
    for row, out in enumerate(greedy):
        ours = out.outputs[0].token_ids
        theirs = ref.sequences[row, ids.shape[1]:].tolist()
        assert len(theirs) == MAX_TOKENS
        for step, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:  # a float tie: both must be transformers' top-2 there; compare no further
                top2 = logits[row, step].topk(2).indices.tolist()
                assert a in top2 and b in top2, f"prompt {row} step {step}: ours {a}, transformers {b}, top-2 {top2}"
                flips += 1
                break
        else:
            # Same tokens: the text is what transformers decodes (output after the prompt, specials skipped).
            full = hf_tokenizer.decode(out.prompt_token_ids + ours, skip_special_tokens=True)
            prompt_text = hf_tokenizer.decode(out.prompt_token_ids, skip_special_tokens=True)
            assert out.outputs[0].text == full[len(prompt_text):]
    assert flips <= 1, f"{flips} float-tie flips in {len(greedy)} prompts is not a tie"


def test_seeded_sampling_is_reproducible_in_any_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=SAMPLE_TOKENS, ignore_eos=True)
    first = conversation(USER_PROMPTS[0])
    alone = llm.chat(first, seeded, use_tqdm=False)[0].outputs[0]
    batch = llm.chat(
        [conversation(USER_PROMPTS[1]), first, first],
        [SamplingParams(temperature=1.0, max_tokens=SAMPLE_TOKENS - 4),  # unseeded noise shares the batch
         seeded,
         SamplingParams(temperature=0.8, top_p=0.95, seed=4321, max_tokens=SAMPLE_TOKENS, ignore_eos=True)],
        use_tqdm=False)
    assert len(alone.token_ids) == SAMPLE_TOKENS
    assert batch[1].outputs[0].token_ids == alone.token_ids
    assert batch[1].outputs[0].text == alone.text
    assert batch[2].outputs[0].text != alone.text, "another seed must sample another text"
    assert_all_blocks_free(llm)


def pick_stop_word(text: str) -> str:
    """A word of the greedy text, early enough that the stop run is short, late enough that text precedes it."""
    for match in re.finditer(r"[A-Za-z]{5,}", text):
        if match.start() > len(text) // 4 and text.index(match.group()) == match.start():
            return match.group()
    raise AssertionError(f"no usable stop word in {text!r}")


def test_stop_strings_and_max_tokens(llm: LLM, greedy: list[RequestOutput]) -> None:
    reference = greedy[1].outputs[0]
    word = pick_stop_word(reference.text)
    cut = reference.text.index(word)
    excluded, included, capped = llm.chat(
        [conversation(USER_PROMPTS[1])] * 3,
        [greedy_params(stop=[word]), greedy_params(stop=[word], include_stop_str_in_output=True),
         greedy_params(max_tokens=5)],
        use_tqdm=False)

    for out, text in ((excluded, reference.text[:cut]), (included, reference.text[:cut + len(word)])):
        completion = out.outputs[0]
        assert completion.text == text
        assert completion.finish_reason == "stop" and completion.stop_reason == word
        assert 0 < len(completion.token_ids) < MAX_TOKENS
        assert completion.token_ids == reference.token_ids[:len(completion.token_ids)]

    completion = capped.outputs[0]
    assert completion.token_ids == reference.token_ids[:5]
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert reference.text.startswith(completion.text) and completion.text
    assert_all_blocks_free(llm)  # the two stop-string requests were aborted in the core


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                                  {"method": "draft_model", "num_speculative_tokens": 3, "draft_layers": 10}],
                         ids=["ngram", "self-spec"])
def test_speculative_greedy_is_token_identical(greedy: list[RequestOutput], spec: dict[str, Any]) -> None:
    spec_llm = LLM(dtype="float32", speculative_config=spec)
    outputs = spec_llm.chat([conversation(p) for p in USER_PROMPTS], greedy_params(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in greedy]
    stats = [s.spec_decoding for s in spec_llm.last_stats if s.spec_decoding is not None]
    assert sum(s.num_accepted_tokens for s in stats) > 0
    assert_all_blocks_free(spec_llm)
