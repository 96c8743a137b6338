"""The offline ``LLM`` API on tiny models: prompt and parameter forms, output order and metrics, the progress bar,
token-level stops (stop ids, EOS, min_tokens), argument errors, priorities, chat, KV hygiene and the CLI.

The tiny models use a byte-level tokenizer (ids 0..255 are bytes, 256 ``<s>``, 257 ``</s>``), so prompts are short
strings and greedy runs are deterministic; expectations come from a first greedy run of the same engine or from
transformers' ``generate()`` where our engine's logic (``min_tokens``) has a transformers twin.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.cli import main as cli_main
from pagellm.outputs import RequestOutput

# 2 layers x 2 KV heads x 16 dims x 2 (K and V) x 4 bytes = 512 B per token; 256 blocks of 16 tokens.
KV_BYTES_PER_TOKEN = 512
SMALL_KV = 256 * 16 * KV_BYTES_PER_TOKEN
PROMPT = "hi"


def greedy(max_tokens: int, **overrides: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **overrides)


def completion(out: RequestOutput):
    assert out.finished and len(out.outputs) == 1
    return out.outputs[0]


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not llm.engine.has_unfinished_requests()
    assert not llm.llm_engine.output_processor.has_unfinished_requests()
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[int]:
    """The greedy continuation of PROMPT, EOS ignored (24 tokens)."""
    out = completion(llm.generate(PROMPT, greedy(24, ignore_eos=True), use_tqdm=False)[0])
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    return out.token_ids


_HF_MODELS: dict[str, Any] = {}


def hf_generate(model_dir: Path, prompt: list[int], **kwargs: Any) -> list[int]:
    import transformers

    if str(model_dir) not in _HF_MODELS:
        _HF_MODELS[str(model_dir)] = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = _HF_MODELS[str(model_dir)].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                              pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------------------------- prompt forms


def test_generate_accepts_every_prompt_form(llm: LLM) -> None:
    encoded = llm.tokenizer.encode(PROMPT)
    one_string = llm.generate(PROMPT, greedy(4), use_tqdm=False)
    one_ids = llm.generate(encoded, greedy(4), use_tqdm=False)
    assert len(one_string) == len(one_ids) == 1
    assert one_string[0].prompt == PROMPT and one_string[0].prompt_token_ids == encoded
    assert one_ids[0].prompt is None and one_ids[0].prompt_token_ids == encoded
    assert completion(one_ids[0]).token_ids == completion(one_string[0]).token_ids
    assert completion(one_ids[0]).text == completion(one_string[0]).text

    default = completion(llm.generate(PROMPT, use_tqdm=False)[0])  # SamplingParams() defaults: 16 tokens
    assert len(default.token_ids) == 16 or default.finish_reason == "stop"


def test_outputs_follow_input_order(llm: LLM) -> None:
    strings = ["a long one", "b", "mid c"]
    max_tokens = [7, 1, 4]  # the first finishes last, so finishing order differs from input order
    outs = llm.generate(strings, [greedy(n, ignore_eos=True) for n in max_tokens], use_tqdm=False)
    assert [o.prompt for o in outs] == strings
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(s) for s in strings]
    assert [len(completion(o).token_ids) for o in outs] == max_tokens
    assert len({o.request_id for o in outs}) == 3

    id_lists = [llm.tokenizer.encode(s) for s in reversed(strings)]
    outs_ids = llm.generate(id_lists, [greedy(n, ignore_eos=True) for n in reversed(max_tokens)], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs_ids] == id_lists
    assert [completion(o).token_ids for o in outs_ids] == [completion(o).token_ids for o in reversed(outs)]

    shared = llm.generate(strings, greedy(3, ignore_eos=True), use_tqdm=False)  # one params for all
    for one, alone, n in zip(shared, outs, max_tokens):
        k = min(3, n)  # greedy: the shorter run is a prefix of the longer
        assert len(completion(one).token_ids) == 3
        assert completion(one).token_ids[:k] == completion(alone).token_ids[:k]
    assert_all_blocks_free(llm)


def test_request_metrics_are_ordered(llm: LLM) -> None:
    before = time.time()
    outs = llm.generate(["x", "yz"], greedy(3, ignore_eos=True), use_tqdm=False)
    after = time.time()
    for out in outs:
        m = out.metrics
        assert before <= m.arrival_time <= m.first_token_time <= m.finished_time <= after
        assert m.time_to_first_token >= 0 and m.e2e_latency >= m.time_to_first_token


def test_progress_bar_only_when_asked(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(["p", "q"], greedy(2), use_tqdm=False)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    llm.generate(["p", "q"], greedy(2), use_tqdm=True)
    captured = capsys.readouterr()
    assert "Processed prompts" in captured.err and "2/2" in captured.err
    assert captured.out == ""


# ---------------------------------------------------------------------------------------------- token-level stops


def test_stop_token_ids(llm: LLM, reference: list[int]) -> None:
    stop_id = reference[2]
    assert stop_id not in reference[:2]
    out = completion(llm.generate(PROMPT, greedy(16, stop_token_ids=[stop_id]), use_tqdm=False)[0])
    assert out.token_ids == reference[:3]  # the stop token is kept in the ids
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert_all_blocks_free(llm)


def test_min_tokens_suppresses_stop_ids_until_reached(llm: LLM, reference: list[int], tiny_llama: Path) -> None:
    stop_id = reference[2]  # greedy emits it as output token 2 (0-based)
    params = greedy(16, stop_token_ids=[stop_id], min_tokens=5)
    out = completion(llm.generate(PROMPT, params, use_tqdm=False)[0])
    assert out.token_ids[:2] == reference[:2]
    assert stop_id not in out.token_ids[:5], "the stop id may not be sampled before min_tokens outputs"
    # transformers' min_new_tokens bans the EOS ids the same way; ours also bans the real EOS (257) until then.
    expected = hf_generate(tiny_llama, llm.tokenizer.encode(PROMPT), max_new_tokens=16, min_new_tokens=5,
                           eos_token_id=[stop_id, 257])
    assert out.token_ids == expected
    if out.token_ids[-1] == stop_id:
        assert len(out.token_ids) > 5 and out.finish_reason == "stop" and out.stop_reason == stop_id
    else:
        assert len(out.token_ids) == 16 and out.finish_reason == "length"

    # min_tokens past the point where the stop id would end it: no effect on a request that stops later.
    late = completion(llm.generate(PROMPT, greedy(16, stop_token_ids=[stop_id], min_tokens=2), use_tqdm=False)[0])
    assert late.token_ids == reference[:3] and late.stop_reason == stop_id


def test_eos_stops_unless_ignored(tiny_model_factory: Any, reference: list[int]) -> None:
    eos = reference[3]  # same seed, same weights: only the configured EOS id differs
    assert eos not in reference[:3]
    model_dir = tiny_model_factory("llama", eos_token_id=eos)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=SMALL_KV)
    assert eos in llm.tokenizer.eos_token_ids

    stopped, ignored, delayed = llm.generate(
        [PROMPT] * 3, [greedy(12), greedy(12, ignore_eos=True), greedy(12, min_tokens=6)], use_tqdm=False)
    out = completion(stopped)
    assert out.token_ids == reference[:4]
    assert out.finish_reason == "stop" and out.stop_reason is None  # EOS is not a stop_reason
    out = completion(ignored)
    assert out.token_ids == reference[:12] and out.finish_reason == "length"
    out = completion(delayed)
    assert out.token_ids[:3] == reference[:3] and eos not in out.token_ids[:6]
    assert_all_blocks_free(llm)


# ---------------------------------------------------------------------------------------------- bad arguments


def test_unknown_engine_argument_suggests_the_name(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown engine argument 'max_num_seq'.*did you mean 'max_num_seqs'"):
        LLM(str(tiny_llama), max_num_seq=4)


def test_vllms_gpu_arguments_are_taken_and_named_in_the_log(tiny_llama: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    # a ported script's LLM(...) runs: vLLM's arguments that do nothing on the CPU are logged, not refused
    with caplog.at_level(logging.WARNING, logger="pagellm.no_effect"):
        llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, gpu_memory_utilization=0.9, enforce_eager=True,
                  trust_remote_code=True, swap_space=4, disable_custom_all_reduce=False, revision=None,
                  mm_processor_cache_gb=4, skip_mm_profiling=True)
    logged = caplog.text
    assert "mm_processor_cache_gb has no effect in pagellm: pagellm keeps no cache of processed images" in logged
    assert "skip_mm_profiling has no effect" in logged
    assert "gpu_memory_utilization has no effect in pagellm: pagellm serves from CPU memory: kv_cache_memory" in logged
    assert "enforce_eager has no effect" in logged and "swap_space has no effect" in logged
    assert "disable_custom_all_reduce" not in logged and "revision" not in logged  # left off: nothing to say
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


def test_bad_dtype(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match=r"dtype='float16' is not supported; use auto, float32 or bfloat16"):
        LLM(str(tiny_llama), dtype="float16")


def test_kv_cache_too_small_names_the_bytes_needed(tiny_llama: Path) -> None:
    needed = 512 // 16 * 16 * KV_BYTES_PER_TOKEN  # one max_model_len=512 request: 32 blocks
    with pytest.raises(ValueError, match=rf"kv_cache_memory=100000 bytes.*max_model_len=512.*at least {needed}\b"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory=100_000)


def test_negative_temperature() -> None:
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=-0.5)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "the prompt is empty"),
        ([[]], "the prompt is empty"),
        ([[1, 320]], r"prompt token ids must be in \[0, 320\); got 1\.\.320"),
        ([[-1, 5]], r"must be in \[0, 320\)"),
        ([[1.5, 2]], "a string or a list of integer token ids"),
        ("x" * 600, "the prompt has 600 tokens but max_model_len is 512"),
        ("y" * 512, "the prompt has 512 tokens but max_model_len is 512; shorten it to at most 511"),
    ],
    ids=["empty-string", "empty-ids", "id-too-big", "id-negative", "float-ids", "too-long", "no-room-to-generate"],
)
def test_bad_prompts(llm: LLM, prompt: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, greedy(2), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_longest_prompt_gets_the_remaining_room(llm: LLM) -> None:
    out = completion(llm.generate("z" * 511, greedy(16, ignore_eos=True), use_tqdm=False)[0])
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_bad_batches_queue_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params has 3 entries for 2 prompts"):
        llm.generate(["a", "b"], [greedy(2)] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], greedy(2), use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match=r"logit_bias: token ids must be in \[0, 320\)"):
        llm.generate("a", SamplingParams(logit_bias={400: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate(["fine", ""], greedy(2), use_tqdm=False)  # the valid first prompt is not queued either
    assert_all_blocks_free(llm)
    assert len(llm.generate(["a", "b"], greedy(2), use_tqdm=False)) == 2


# ---------------------------------------------------------------------------------------------- scheduling


def finish_order(outs: list[RequestOutput]) -> list[int]:
    return sorted(range(len(outs)), key=lambda i: outs[i].metrics.finished_time)


@pytest.mark.parametrize(
    ("policy", "priority", "expected"),
    [
        ("priority", [2, 0, 1], [1, 2, 0]),
        ("priority", [0, 0, 0], [0, 1, 2]),  # ties: first come, first served
        ("fcfs", [2, 0, 1], [0, 1, 2]),  # fcfs ignores priorities
    ],
)
def test_priority_scheduling(tiny_llama: Path, policy: str, priority: list[int], expected: list[int]) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV, scheduling_policy=policy, max_num_seqs=1)
    outs = llm.generate(["first", "second", "third"], greedy(3, ignore_eos=True), use_tqdm=False, priority=priority)
    order = finish_order(outs)
    assert order == expected
    times = [outs[i].metrics.finished_time for i in order]
    assert times == sorted(set(times)), "max_num_seqs=1 finishes one request per step"
    for before, after in zip(order, order[1:]):  # one at a time: the next starts after the previous ends
        assert outs[after].metrics.first_token_time > outs[before].metrics.finished_time
    assert_all_blocks_free(llm)


# ---------------------------------------------------------------------------------------------- chat


def test_chat_one_and_many_conversations(llm: LLM) -> None:
    one = [{"role": "user", "content": "hi"}]
    two = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}]
    single = llm.chat(one, greedy(3), use_tqdm=False)
    assert len(single) == 1
    assert single[0].prompt_token_ids == llm.tokenizer.apply_chat_template(one)
    assert llm.tokenizer.decode(single[0].prompt_token_ids, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")

    many = llm.chat([two, one], [greedy(2), greedy(3)], use_tqdm=False)
    assert [o.prompt_token_ids for o in many] == [llm.tokenizer.apply_chat_template(c) for c in (two, one)]
    assert [len(completion(o).token_ids) for o in many] == [2, 3]
    assert completion(many[1]).token_ids == completion(single[0]).token_ids

    no_prompt = llm.chat(one, greedy(3), use_tqdm=False, add_generation_prompt=False)
    assert no_prompt[0].prompt_token_ids == llm.tokenizer.apply_chat_template(one, add_generation_prompt=False)


@pytest.mark.parametrize("messages", [[], [[]], [{"role": "user"}, "not a message"]], ids=["none", "empty", "bad"])
def test_chat_rejects_empty_or_malformed_messages(llm: LLM, messages: Any) -> None:
    with pytest.raises(ValueError, match="messages"):
        llm.chat(messages, greedy(2), use_tqdm=False)
    assert_all_blocks_free(llm)


# ---------------------------------------------------------------------------------------------- KV hygiene


def test_every_block_comes_back_after_stop_string_aborts(llm: LLM, reference: list[int]) -> None:
    text = completion(llm.generate(PROMPT, greedy(24, ignore_eos=True), use_tqdm=False)[0]).text
    # A character that first occurs after the start, so the stop leaves some text before it.
    cut, stop = next((i, ch) for i, ch in enumerate(text) if i > 0 and ch.isascii() and ch.isalnum()
                     and text.index(ch) == i)
    prompts = [PROMPT, "other", PROMPT, "a longer prompt that fills more than one sixteen-token block"]
    params = [greedy(24, ignore_eos=True, stop=[stop]), greedy(20, ignore_eos=True),
              greedy(24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True), greedy(30, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, expected in ((outs[0], text[:cut]), (outs[2], text[:cut + 1])):
        c = completion(out)
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == expected and len(c.token_ids) < 24
        assert c.token_ids == reference[:len(c.token_ids)]
    assert [len(completion(o).token_ids) for o in outs[1::2]] == [20, 30]
    assert_all_blocks_free(llm)


# ---------------------------------------------------------------------------------------------- CLI


def run_cli(argv: list[str]) -> int:
    try:
        return cli_main(argv)
    except SystemExit as exc:  # argparse reports bad flags by exiting with status 2
        return int(exc.code or 0)


def test_cli_generate(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", str(SMALL_KV),
            "--max-tokens", "4", "--prompt", "hi"]
    assert run_cli(argv) == 0
    out = capsys.readouterr().out
    expected = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV).generate(
        "hi", greedy(4), use_tqdm=False)[0].outputs[0].text
    assert out == f"### hi\n{expected}\n\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-tokens", "many", "--prompt", "hi"], "argument --max-tokens: invalid int value: 'many'"),
        (["--dtype", "float16", "--prompt", "hi"], "pagellm: dtype='float16' is not supported"),
        (["--max-num-sequences", "2", "--prompt", "hi"], "unrecognized arguments: --max-num-sequences"),
        ([], "pagellm: give at least one prompt"),
        (["--kv-cache-dtype", "int8", "--prompt", "hi"],
         "pagellm: kv_cache_dtype='int8'; use auto, fp8, fp8_e4m3 or fp8_e5m2"),
        (["--quantization", "awq", "--prompt", "hi"],
         "pagellm: quantization='awq' is not supported; use w8a8_int8, w4a8_int4, w4a16_int4 or leave it unset"),
        (["--quantization", "w8a8_int8", "--dtype", "float32", "--prompt", "hi"],
         "pagellm: quantization=w8a8_int8 runs on bfloat16 models; set dtype bfloat16"),
        (["--kv-cache-memory", "4 lots", "--prompt", "hi"],
         "argument --kv-cache-memory/--kv-cache-memory-bytes: '4 lots' is not a size: write bytes (4294967296)"),
    ],
    ids=["not-an-int", "bad-dtype", "unknown-flag", "no-prompt", "bad-kv-cache-dtype", "bad-quantization",
         "quantized-float32", "not-a-size"],
)
def test_cli_bad_flags(tiny_llama: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    assert run_cli(["generate", "--model", str(tiny_llama), *flags]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_a_profile_of_generate_names_the_engines_spans(tiny_llama: Path, tmp_path: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV, profiler_dir=str(tmp_path))
    assert llm.start_profile() and not llm.start_profile()  # one session at a time
    outputs = llm.generate([PROMPT] * 2, SamplingParams(max_tokens=4), use_tqdm=False)
    files = llm.stop_profile()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    assert llm.stop_profile() == []
    summary = Path(files[1]).read_text()
    for name in ("schedule", "prepare_inputs", "forward", "compute_logits", "sample", "update_from_output"):
        assert f"pagellm::{name}" in summary


def test_profiling_needs_a_folder(llm: LLM) -> None:
    with pytest.raises(ValueError, match="profiling is off.*profiler_dir=DIR"):
        llm.start_profile()


def test_profile_block_hands_back_its_files_even_when_the_block_fails(tiny_llama: Path, tmp_path: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV, profiler_dir=str(tmp_path))
    with pytest.raises(ValueError, match="max_tokens"):
        with llm.profile() as files:
            llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
            llm.generate([PROMPT], SamplingParams(max_tokens=-1), use_tqdm=False)
    assert len(files) == 2 and all(Path(f).exists() for f in files)
    assert llm.start_profile()  # the block's session was stopped: a new one starts
    with pytest.raises(ValueError, match="recording already"):
        with llm.profile():
            pass
    assert len(llm.stop_profile()) == 2


def test_hf_overrides_act_as_an_edited_config_json(tiny_llama: Path, tmp_path: Path) -> None:
    """vLLM's hf_overrides: the model's config.json keys set over its own, as if the file said so."""
    import json
    import shutil

    overrides = {"max_position_embeddings": 128, "rope_theta": 37.0}
    edited = tmp_path / "edited"
    shutil.copytree(tiny_llama, edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, **overrides}))
    prompts, params = ["the quick brown fox", "0123456789"], greedy(16, ignore_eos=True)

    def tokens(model: Path, **args: Any) -> tuple[list[list[int]], int]:
        llm = LLM(str(model), dtype="float32", kv_cache_memory=SMALL_KV, **args)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], \
            llm.engine.runtime.max_model_len

    as_edited = tokens(edited)
    assert as_edited[1] == 128
    assert tokens(tiny_llama, hf_overrides=json.dumps(overrides)) == as_edited
    assert tokens(tiny_llama)[0] != as_edited[0]  # the overrides took effect
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        LLM(str(tiny_llama), dtype="float32", hf_overrides="[1]")


def test_num_gpu_blocks_override_sets_the_pool(tiny_llama) -> None:
    """vLLM's --num-gpu-blocks-override: exactly that many KV blocks, whatever kv_cache_memory would hold."""
    from pagellm.cli import build_parser, engine_kwargs
    from pagellm.config import CacheConfig

    args = build_parser().parse_args(["serve", "--num-gpu-blocks-override", "40"])
    assert engine_kwargs(args)["num_gpu_blocks_override"] == 40
    llm = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=40, max_model_len=256)
    assert llm.engine.core.scheduler.kv.pool.num_blocks == 40
    with pytest.raises(ValueError, match="num_gpu_blocks_override=8 blocks .* cannot hold one max_model_len=256"):
        LLM(str(tiny_llama), dtype="float32", num_gpu_blocks_override=8, max_model_len=256)
    with pytest.raises(ValueError, match="num_gpu_blocks_override must be >= 1"):
        CacheConfig(num_gpu_blocks_override=0)


def test_get_tokenizer_is_the_models_hugging_face_tokenizer(llm: LLM, tiny_llama: Path) -> None:
    """vLLM's ``LLM.get_tokenizer()``: the tokenizer the engine encodes with, as transformers loads it."""
    from transformers import AutoTokenizer

    tokenizer, theirs = llm.get_tokenizer(), AutoTokenizer.from_pretrained(tiny_llama)
    assert type(tokenizer) is type(theirs) and tokenizer.encode("héllo") == theirs.encode("héllo")
    chat = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = llm.chat(chat, greedy(1), use_tqdm=False)[0].prompt_token_ids
    assert ids == tokenizer.encode(text, add_special_tokens=False) and tokenizer.decode(ids) == text


def test_truncate_prompt_tokens_keeps_the_prompts_tail(llm: LLM) -> None:
    """vLLM's ``SamplingParams.truncate_prompt_tokens``: the prompt's last k tokens run, as if given alone; -1 keeps
    up to max_model_len; a k past max_model_len, or 0, is refused."""
    long = list(range(10, 40))
    cut = llm.generate([long], greedy(4, truncate_prompt_tokens=8), use_tqdm=False)[0]
    alone = llm.generate([long[-8:]], greedy(4), use_tqdm=False)[0]
    assert cut.prompt_token_ids == long[-8:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    text = llm.generate("hello world", greedy(1, truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert text.prompt_token_ids == llm.get_tokenizer().encode("hello world")[-3:]
    assert llm.generate([long], greedy(1, truncate_prompt_tokens=-1), use_tqdm=False)[0].prompt_token_ids == long
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 .* or >= 1, got 0"):
        greedy(1, truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(100000\) must be at most max_model_len"):
        llm.generate([long], greedy(1, truncate_prompt_tokens=100_000), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_truncation_side_right_keeps_the_prompts_head(llm: LLM) -> None:
    """vLLM 0.32's ``truncation_side``: "right" keeps the first k tokens, "left" (the default) the last; offline
    through ``tokenization_kwargs`` (vLLM's) as well as the parameters; other keys or sides are refused."""
    long = list(range(10, 40))
    head = llm.generate([long], greedy(4, truncate_prompt_tokens=8, truncation_side="right"), use_tqdm=False)[0]
    alone = llm.generate([long[:8]], greedy(4), use_tqdm=False)[0]
    assert head.prompt_token_ids == long[:8] and head.outputs[0].token_ids == alone.outputs[0].token_ids
    for side, kept in (("right", long[:5]), ("left", long[-5:])):
        out = llm.generate([long], greedy(1), use_tqdm=False,
                           tokenization_kwargs={"truncate_prompt_tokens": 5, "truncation_side": side})[0]
        assert out.prompt_token_ids == kept
    chat = llm.chat([{"role": "user", "content": "hello there"}], greedy(1), use_tqdm=False,
                    tokenization_kwargs={"truncate_prompt_tokens": 3, "truncation_side": "right"})[0]
    assert llm.get_tokenizer().decode(chat.prompt_token_ids) == "<|im_start|>us"
    with pytest.raises(ValueError, match="truncation_side must be 'left' .* or 'right'"):
        greedy(1, truncation_side="middle")
    with pytest.raises(ValueError, match=r"tokenization_kwargs: unknown keys \['padding'\]"):
        llm.generate([long], greedy(1), use_tqdm=False, tokenization_kwargs={"padding": "max_length"})
    assert_all_blocks_free(llm)
