"""LoRA adapters made and run by ``peft`` (the reference) and by the engine: greedy tokens equal PEFT's in float32
for each adapter and for the base model, with all of them mixed in one batch, chunked, prefix-cached and in
bfloat16 on the native kernels; adapters that do not fit the model are refused before anything is queued, and every
KV block comes back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from lora_utils import build_lora_adapter

from pagellm import LLM, SamplingParams
from pagellm.lora import LoRARequest

MAX_TOKENS = 10


def _peft_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False)
            out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("lora")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    first = build_lora_adapter(tiny_llama, root / "all", 1, every, 8)
    second = build_lora_adapter(tiny_llama, root / "attn", 2, ["q_proj", "v_proj"], 4, rslora=True)
    return [LoRARequest("all", 1, str(first)), LoRARequest("attn", 2, str(second))]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 256, (20,), generator=gen).tolist()
    return [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17)] + [[5, 6, 7]]


def test_greedy_tokens_equal_peft_for_each_adapter_mixed_in_one_batch(tiny_llama: Path,
                                                                       adapters: list[LoRARequest]) -> None:
    prompts = _prompts()
    expected = {a.lora_int_id if a else 0: _peft_greedy(tiny_llama, Path(a.lora_path) if a else None, prompts)
                for a in (*adapters, None)}
    assert expected[1] != expected[0] and expected[2] != expected[0]  # the adapters change the model's choices
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second round hits the prefix cache, each adapter its own blocks
        batch = [p for p in prompts for _ in range(3)]
        routing = [a for _ in prompts for a in (adapters[0], adapters[1], None)]
        outs = llm.generate(batch, params, use_tqdm=False, lora_request=routing)
        for out, prompt, adapter in zip(outs, batch, routing):
            want = expected[adapter.lora_int_id if adapter else 0][prompts.index(prompt)]
            assert out.outputs[0].token_ids == want
    from peft import PeftModel

    tuned = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tiny_llama,
                                                                                       dtype=torch.float32),
                                      adapters[0].lora_path).eval()
    embedded = llm.embed(prompts, use_tqdm=False, lora_request=adapters[0])
    with torch.no_grad():
        for out, prompt in zip(embedded, prompts):
            ref = tuned(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
            torch.testing.assert_close(torch.tensor(out.embedding), ref / ref.norm(), atol=2e-6, rtol=0)
    chat = [{"role": "user", "content": "hi"}]
    (answer,) = llm.chat(chat, params, use_tqdm=False, lora_request=adapters[1])  # vLLM's LLM.chat takes one too
    rendered = llm.tokenizer.apply_chat_template(chat, True)
    assert answer.outputs[0].token_ids == _peft_greedy(tiny_llama, Path(adapters[1].lora_path), [rendered])[0]
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_bfloat16_adapted_requests_leave_the_native_stack_for_the_python_layers(tiny_llama: Path,
                                                                                 adapters: list[LoRARequest]) -> None:
    llm = LLM(str(tiny_llama), dtype="bfloat16", enable_lora=True, kv_cache_memory="4MiB")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    adapted = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False,
                                                             lora_request=adapters[0])]
    assert plain != adapted and all(len(t) == MAX_TOKENS for t in adapted)


def test_adapters_that_do_not_fit_are_refused_before_anything_runs(tiny_llama: Path, tiny_model_factory,
                                                                    adapters: list[LoRARequest],
                                                                    tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="start it with enable_lora=True"):
        LLM(str(tiny_llama), dtype="float32").generate([[1, 2]], params, use_tqdm=False, lora_request=adapters[0])
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True)

    def refused(path: Path, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            llm.generate([[1, 2]], params, use_tqdm=False, lora_request=LoRARequest("x", 9, str(path)))

    refused(tmp_path / "none", "cannot read adapter_config.json")
    narrow = tiny_model_factory("llama", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                num_key_value_heads=1)
    refused(build_lora_adapter(narrow, tmp_path / "narrow", 3, ["o_proj"], 4),
            r"layer 0 o_proj has lora_A \(4, 32\) and lora_B \(32, 4\); the model needs lora_A \[r, 64\] and "
            r"lora_B \[64, r\]")
    refused(build_lora_adapter(tiny_llama, tmp_path / "embed", 4, ["embed_tokens"], 4),
            "is not a LoRA matrix of a decoder layer's q_proj")
    config = json.loads((Path(adapters[0].lora_path) / "adapter_config.json").read_text())
    (tmp_path / "bias").mkdir()
    (tmp_path / "bias" / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    refused(tmp_path / "bias", "biases, per-module ranks and modules_to_save are not supported")
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("z", 0, adapters[0].lora_path)
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert llm.generate([[1, 2]], params, use_tqdm=False, lora_request=adapters[1])[0].finished  # still serving


@pytest.mark.parametrize("parallel", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}],
                         ids=["stages", "tensor-parallel"])
def test_adapters_on_parallel_ranks_give_pefts_tokens(tiny_llama: Path, adapters: list[LoRARequest],
                                                      parallel: dict) -> None:
    """Each stage applies the adapters' deltas to its own layers (by their number in the whole model); each
    tensor-parallel rank holds B's rows of its output slice (q/k/v, gate/up) and A's columns of its input slice (o,
    down, whose rank-sized products the ranks sum)."""
    prompts = _prompts()
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_num_batched_tokens=24, **parallel)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for adapter in adapters:
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapter)
            assert [o.outputs[0].token_ids for o in outs] == _peft_greedy(tiny_llama, Path(adapter.lora_path),
                                                                          prompts)
    finally:
        llm.shutdown()


def test_a_mixture_of_experts_takes_attention_adapters_and_refuses_expert_ones(tiny_model_factory,
                                                                                tmp_path: Path) -> None:
    moe = tiny_model_factory("qwen3_moe")
    adapter = build_lora_adapter(moe, tmp_path / "attn", 5, ["q_proj", "k_proj", "v_proj", "o_proj"], 4)
    prompts = _prompts()
    expected, base = _peft_greedy(moe, adapter, prompts), _peft_greedy(moe, None, prompts)
    assert expected != base
    llm = LLM(str(moe), dtype="float32", enable_lora=True, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts * 2, params, use_tqdm=False, lora_request=[LoRARequest("attn", 1, str(adapter))] *
                        len(prompts) + [None] * len(prompts))
    assert [o.outputs[0].token_ids for o in outs] == expected + base
    dense = tiny_model_factory("qwen3")  # the same shapes, with a dense MLP to adapt
    mlp = build_lora_adapter(dense, tmp_path / "mlp", 6, ["gate_proj"], 4)
    with pytest.raises(ValueError, match=r"not a LoRA matrix of a decoder layer's q_proj, k_proj, v_proj, o_proj "
                                         r"\(a mixture of experts: adapters on its experts are not served\)"):
        llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("mlp", 2, str(mlp)))
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_max_cpu_loras_keeps_the_recently_used_adapters_and_the_outputs(tiny_llama: Path,
                                                                         adapters: list[LoRARequest]) -> None:
    """With room for one adapter, each worker drops the least recently used one that no running request uses, and
    loads it again when it is named again: the tokens are those of an engine that keeps every adapter."""
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    keep_all = LLM(str(tiny_llama), dtype="float32", enable_lora=True)
    small = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_cpu_loras=1)
    loaded = small.engine.core.executor.worker.runner.adapters.loaded
    for adapter in (adapters[0], adapters[1], adapters[0]):  # each switch evicts the other
        got = small.generate(prompts, params, use_tqdm=False, lora_request=adapter)
        want = keep_all.generate(prompts, params, use_tqdm=False, lora_request=adapter)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert list(loaded) == [adapter.lora_int_id]
    both = small.generate(prompts[:2], params, use_tqdm=False, lora_request=adapters)  # one batch needs both
    assert [o.outputs[0].token_ids for o in both] == \
        [o.outputs[0].token_ids for o in keep_all.generate(prompts[:2], params, use_tqdm=False,
                                                           lora_request=adapters)]
    assert len(keep_all.engine.core.executor.worker.runner.adapters.loaded) == 2


def test_max_lora_rank_refuses_higher_ranks(tiny_llama: Path, adapters: list[LoRARequest]) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_lora_rank=4)
    params = SamplingParams(max_tokens=2)
    assert llm.generate([[1, 2, 3]], params, use_tqdm=False, lora_request=adapters[1])  # rank 4
    with pytest.raises(ValueError, match="has rank 8, above max_lora_rank 4; start the engine with max_lora_rank"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False, lora_request=adapters[0])
    with pytest.raises(ValueError, match="max_cpu_loras must be >= 1 and goes with enable_lora"):
        LLM(str(tiny_llama), max_cpu_loras=2)


def test_lora_target_modules_apply_only_those_modules(tiny_llama: Path, adapters: list[LoRARequest],
                                                      tmp_path: Path) -> None:
    """vLLM's ``lora_target_modules``: with ``qkv_proj`` only, an adapter of every module gives PEFT's tokens for
    the same adapter cut down to q/k/v; one of modules all outside the targets gives the base model's; an unknown
    module is refused by name."""
    from safetensors.torch import load_file, save_file

    source = Path(adapters[0].lora_path)
    cut = tmp_path / "qkv"
    cut.mkdir()
    tensors = load_file(source / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if any(f".{p}." in k for p in ("q_proj", "k_proj", "v_proj"))},
              cut / "adapter_model.safetensors")
    config = json.loads((source / "adapter_config.json").read_text())
    (cut / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "k_proj", "v_proj"]}))
    prompts = _prompts()
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, lora_target_modules=["qkv_proj"])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=adapters[0])]
    assert got == _peft_greedy(tiny_llama, cut, prompts)
    outside = LLM(str(tiny_llama), dtype="float32", enable_lora=True, lora_target_modules=["down_proj"])
    untouched = outside.generate(prompts, params, use_tqdm=False, lora_request=adapters[1])  # a q/v adapter
    assert [o.outputs[0].token_ids for o in untouched] == _peft_greedy(tiny_llama, None, prompts)
    with pytest.raises(ValueError, match="lora_target_modules: 'qkv' is not a decoder layer's module"):
        LLM(str(tiny_llama), enable_lora=True, lora_target_modules=["qkv"])
