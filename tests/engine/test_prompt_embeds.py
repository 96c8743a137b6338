"""Prompts as input embeddings (``enable_prompt_embeds``): greedy parity with transformers' ``inputs_embeds``
in every scheduling mode, the native bfloat16 stack, the prefix cache keyed by the rows, and clear errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
import safetensors.torch
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.ops.decoder_stack import DecoderStack
from pagellm.prompt_embeds import PromptEmbeds, from_tensor, load, save

MAX_TOKENS = 12
LENGTHS = [1, 5, 16, 17, 40, 75]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _embeds(seed: int, lengths: list[int] = LENGTHS, hidden: int = 64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=gen) * 0.5 for n in lengths]


def _hf_greedy(model_dir: Path, embeds: torch.Tensor, **kwargs) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens from ``inputs_embeds``, and its per-step logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(embeds), dtype=torch.long),
                         max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[0].tolist(), torch.stack(out.logits, dim=1)[0]


def _assert_parity(model_dir: Path, embeds: list[torch.Tensor], ours: list[list[int]], **hf_kwargs) -> None:
    """Token for token, but where a float tie flips one: then both candidates are in that step's top 2."""
    for rows, got in zip(embeds, ours):
        ref, logits = _hf_greedy(model_dir, rows, **hf_kwargs)
        assert len(got) == MAX_TOKENS
        for step, (a, b) in enumerate(zip(got, ref)):
            if a != b:
                top2 = logits[step].topk(2).indices.tolist()
                assert a in top2 and b in top2, f"step {step}: ours {a}, transformers {b}, top-2 {top2}"
                break


def _generate(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _token_embeddings(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The model's own embeddings of ``ids`` (its dtype)."""
    with torch.no_grad():
        return llm.engine.core.executor.worker.runner.model.model.embed_tokens(torch.tensor(ids)).clone()


def _no_leaks(llm: LLM) -> None:
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


MODES = {
    "chunked": dict(max_num_batched_tokens=16),
    "unchunked": dict(enable_chunked_prefill=False),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    # 12 blocks of 16 tokens (512 B a token): prompts that fill them, each a token short of a full block, need
    # new blocks at their first outputs, so some are preempted and recomputed
    "preemption": dict(kv_cache_memory=12 * 16 * 512, max_model_len=160),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_parity_with_transformers_inputs_embeds(tiny_llama: Path, mode: str) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", enable_prompt_embeds=True, **MODES[mode])
    embeds = _embeds(seed=1, lengths=[31, 47, 31, 47, 31, 15] if mode == "preemption" else LENGTHS)
    ours = _generate(llm, [{"prompt_embeds": rows} for rows in embeds])
    if mode == "preemption":
        assert sum(s.num_preemptions for s in llm.last_stats) > 0, "the pool was meant to force preemptions"
    _assert_parity(tiny_llama, embeds, ours)
    _no_leaks(llm)


def test_embeddings_and_token_prompts_share_a_batch(tiny_llama: Path) -> None:
    """Mixed in one batch, each prompt gets what it gets alone; rows equal to a token prompt's own embeddings give
    that prompt's tokens, yet never its prefix-cache blocks."""
    llm = LLM(str(tiny_llama), dtype="float32", enable_prompt_embeds=True, max_num_batched_tokens=32)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    own = _token_embeddings(llm, ids)
    alone = _generate(llm, [ids])[0]
    (rows,) = _embeds(seed=3, lengths=[33])
    mixed = llm.generate([ids, {"prompt_embeds": rows}, {"prompt_embeds": own}], GREEDY, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone and mixed[0].num_cached_tokens == 32  # the token prompt's hit
    assert mixed[1].outputs[0].token_ids == _generate(llm, [{"prompt_embeds": rows}])[0]
    assert mixed[2].outputs[0].token_ids == alone and mixed[2].num_cached_tokens == 0
    assert mixed[1].prompt_token_ids == [] and mixed[1].prompt is None  # an embeddings prompt has no tokens
    cut = msgspec.structs.replace(GREEDY, truncate_prompt_tokens=20)  # keeps the last 20 rows
    assert _generate(llm, [{"prompt_embeds": rows}], cut) == _generate(llm, [{"prompt_embeds": rows[-20:]}])
    _no_leaks(llm)


@pytest.mark.parametrize("algo", [None, "sha256_cbor"])
def test_prefix_cache_shares_the_blocks_of_equal_leading_rows(tiny_llama: Path, algo: str | None) -> None:
    """A soft prompt's blocks serve every prompt that starts with it; a block that differs in one row, a token
    prompt of the placeholder ids finds nothing (another cache salt neither: the server's test); what the cache
    serves changes no token. Likewise with vLLM's block hashes (each block keyed by its rows' digest)."""
    llm = LLM(str(tiny_llama), dtype="float32", enable_prompt_embeds=True, prefix_caching_hash_algo=algo)
    (rows,) = _embeds(seed=4, lengths=[40])
    tail = rows.clone()
    tail[-1] += 1.0  # the same first two blocks, another last (partial) block
    early = rows.clone()
    early[20] += 1.0  # the second block differs
    first, again, same_start, second_differs, zeros = llm.generate(
        [{"prompt_embeds": rows}] * 2 + [{"prompt_embeds": tail}, {"prompt_embeds": early}, [0] * 40], GREEDY,
        use_tqdm=False)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32  # two full blocks of 16 came back
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert same_start.num_cached_tokens == 32 and second_differs.num_cached_tokens == 16
    assert zeros.num_cached_tokens == 0  # placeholders are not the rows
    cold = LLM(str(tiny_llama), dtype="float32", enable_prompt_embeds=True, enable_prefix_caching=False)
    for out, prompt in ((same_start, tail), (second_differs, early)):
        assert out.outputs[0].token_ids == _generate(cold, [{"prompt_embeds": prompt}])[0]
    _no_leaks(llm)


def test_penalties_see_no_placeholder_prompt_tokens(tiny_llama: Path, tmp_path: Path) -> None:
    """A repetition penalty counts the generated tokens only (transformers does the same with ``inputs_embeds``):
    the zeros that stand for the rows in the scheduler are not tokens of the prompt. The model is made to favour
    token 0 (its LM-head row is 1.1 times that of the first token it would pick), so penalising it shows."""
    (rows,) = _embeds(seed=5, lengths=[30])
    first = _hf_greedy(tiny_llama, rows)[0][0]
    model_dir = tmp_path / "favours-zero"
    shutil.copytree(tiny_llama, model_dir)
    weights = safetensors.torch.load_file(model_dir / "model.safetensors")
    weights["lm_head.weight"][0] = 1.1 * weights["lm_head.weight"][first]
    safetensors.torch.save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(model_dir), dtype="float32", enable_prompt_embeds=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.8)
    ours = _generate(llm, [{"prompt_embeds": rows}], params)
    assert ours[0][0] == 0  # the favoured token, unpenalised
    _assert_parity(model_dir, [rows], ours, repetition_penalty=1.8)


def test_bfloat16_native_stack_takes_the_rows(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the bfloat16 native decoder stack, rows equal to a token prompt's embeddings give its tokens exactly."""
    calls: list[int] = []
    real = DecoderStack.run
    monkeypatch.setattr(DecoderStack, "run", lambda self, *a: calls.append(1) or real(self, *a))
    llm = LLM(str(tiny_llama), dtype="bfloat16", enable_prompt_embeds=True, max_num_batched_tokens=24)
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(6)).tolist()
    own = _token_embeddings(llm, ids)
    assert own.dtype == torch.bfloat16
    expected = _generate(llm, [ids])
    assert calls, "the native stack was meant to run"
    assert _generate(llm, [{"prompt_embeds": own}]) == expected
    assert _generate(llm, [{"prompt_embeds": own.float()}]) == expected  # float32 rows, cast to the model's dtype


def test_torch_save_round_trip_and_truncation() -> None:
    rows = torch.randn(6, 8, dtype=torch.bfloat16)
    embeds = load(save(rows))
    assert (embeds.dtype, embeds.hidden_size, embeds.num_tokens) == ("bfloat16", 8, 6)
    assert embeds == from_tensor(rows[None])  # [1, tokens, hidden] is the same prompt
    tail = embeds.last(2)
    assert tail == from_tensor(rows[4:]) and tail.digest() != embeds.digest()
    assert from_tensor(rows.double()).dtype == "float32"  # other float types travel as float32


@pytest.mark.parametrize("bad,message", [
    (torch.zeros(4), "[num_tokens, hidden_size]"),
    (torch.zeros(0, 64), "at least one row"),
    (torch.zeros(3, 64, dtype=torch.int64), "floating point"),
    (torch.full((3, 64), float("nan")), "NaN"),
    ([[0.0] * 64], "torch.Tensor"),
    (torch.zeros(3, 64).to_sparse(), "dense tensor"),
    (torch.zeros(3, 64, device="meta"), "dense tensor with its data"),
])
def test_bad_tensors_are_refused(bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        from_tensor(bad)


def test_a_file_that_is_not_a_tensor_is_refused_not_run(tmp_path: Path) -> None:
    class Payload:
        def __reduce__(self):  # what an attacker's pickle would run on an unsafe load
            return (Path.touch, (tmp_path / "ran",))

    with pytest.raises(ValueError, match="torch.save"):
        load(save(Payload()))
    assert not (tmp_path / "ran").exists()
    with pytest.raises(ValueError, match="torch.save"):
        load(b"not a zip file at all")
    with pytest.raises(ValueError, match="torch.Tensor"):
        load(save({"rows": torch.zeros(2, 2)}))


def test_requests_the_engine_cannot_run_are_refused(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", enable_prompt_embeds=True, max_model_len=64)
    (rows,) = _embeds(seed=7, lengths=[8])
    for prompt, params, message in [
        ({"prompt_embeds": torch.zeros(8, 32)}, GREEDY, "hidden size is 64"),
        ({"prompt_embeds": torch.zeros(64, 64)}, GREEDY, "max_model_len is 64"),
        ({"prompt_embeds": rows}, SamplingParams(prompt_logprobs=1), "prompt_logprobs needs the prompt's tokens"),
        ({"prompt_embeds": rows, "prompt": "hi"}, GREEDY, "exactly one of the keys"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {}}, GREEDY, "multi_modal_data takes {.image."),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, params, use_tqdm=False)
    assert _generate(llm, [{"prompt_token_ids": [5, 6, 7]}]) == _generate(llm, [[5, 6, 7]])  # vLLM's dict forms
    assert llm.generate({"prompt": "abc"}, GREEDY, use_tqdm=False)[0].prompt == "abc"
    _no_leaks(llm)


def test_off_unless_enabled_and_not_with_speculation(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32")
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        llm.generate({"prompt_embeds": torch.zeros(3, 64)}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="speculative decoding"):
        LLM(str(tiny_llama), enable_prompt_embeds=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_the_core_refuses_rows_that_do_not_match_the_request(tiny_llama: Path) -> None:
    """The core checks what crosses the process boundary: a row per placeholder, of the model's width."""
    llm = LLM(str(tiny_llama), dtype="float32", enable_prompt_embeds=True)
    base = llm.input_processor.process("x", {"prompt_embeds": torch.zeros(4, 64)}, GREEDY)
    wrong = PromptEmbeds("float32", 64, bytes(3 * 64 * 4))
    with pytest.raises(ValueError, match="one row of the model's hidden size per prompt position"):
        llm.engine.core.add_request(msgspec.structs.replace(base, prompt_embeds=wrong))


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_rows_reach_every_parallel_rank(tiny_llama: Path, parallel: dict) -> None:
    """The rows cross the shared-memory ring to every worker: split models give the one-worker tokens."""
    embeds = [{"prompt_embeds": rows} for rows in _embeds(seed=8, lengths=[5, 40])]
    expected = _generate(LLM(str(tiny_llama), dtype="float32", enable_prompt_embeds=True), embeds)
    llm = LLM(str(tiny_llama), dtype="float32", enable_prompt_embeds=True, **parallel)
    try:
        assert _generate(llm, embeds) == expected
    finally:
        llm.shutdown()


def test_embed_takes_embeddings_prompts(tiny_llama: Path) -> None:
    """``LLM.embed`` pools an embeddings prompt as transformers' last hidden state of ``inputs_embeds``."""
    llm = LLM(str(tiny_llama), dtype="float32", enable_prompt_embeds=True)
    (rows,) = _embeds(seed=10, lengths=[21])
    (out,) = llm.embed([{"prompt_embeds": rows}], use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(inputs_embeds=rows[None], output_hidden_states=True).hidden_states[-1][0, -1]
    torch.testing.assert_close(torch.tensor(out.embedding), ref / ref.norm(), atol=2e-6, rtol=0)
    assert out.prompt_token_ids == []
