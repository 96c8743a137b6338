"""The mixture-of-experts MLP (``model/layers/moe.py``) against transformers' own blocks; its packed bfloat16 path
against its plain twin; its native call (``ops/moe.py``) against the Python loop, bit for bit, alone and in the
engine."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.model.arch import ArchConfig
from pagellm.model.layers.linear import pack_weights
from pagellm.model.layers.moe import SparseMoeBlock
from pagellm.ops import gemm, gemm_w8a8
from pagellm.ops import moe as moe_kernel

HIDDEN = 64


def _hf_block(arch: str, **config) -> tuple[torch.nn.Module, ArchConfig]:
    """transformers' sparse block of ``arch`` with random weights (a decisive router), and our reading of its
    config."""
    config_cls, block_cls = {
        "mixtral": (transformers.MixtralConfig, transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock),
        "qwen2_moe": (transformers.Qwen2MoeConfig,
                      transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock),
        "qwen3_moe": (transformers.Qwen3MoeConfig,
                      transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock),
    }[arch]
    config = {"intermediate_size": 80, "moe_intermediate_size": 48} | config
    cfg = config_cls(hidden_size=HIDDEN, num_attention_heads=4, num_hidden_layers=1, vocab_size=32, **config)
    torch.manual_seed(0)
    block = block_cls(cfg).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.5 if param.dim() == 2 and param.shape[0] <= 8 else 0.1)
    return block, ArchConfig.from_hf(cfg.to_dict() | {"architectures": [cfg.architectures or ""]})


def _ours(block: torch.nn.Module, arch: ArchConfig, dtype: torch.dtype) -> SparseMoeBlock:
    """Our block with transformers' block's weights (its experts held as [experts, 2·inter, hidden] and
    [experts, hidden, inter] tensors in memory)."""
    assert arch.moe is not None
    ours = SparseMoeBlock(arch.moe, HIDDEN, dtype)
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(block.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(block.experts.down_proj[e])
        if ours.shared_expert is not None:
            shared = block.shared_expert
            ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
            ours.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
    return ours


CASES = [
    ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=96)),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=1, norm_topk_prob=False)),  # most experts idle
]


@pytest.mark.parametrize(("arch", "config"), CASES)
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_float32_block_equals_transformers_to_the_bit(arch: str, config: dict, tokens: int) -> None:
    block, cfg = _hf_block(arch, **config)
    ours = _ours(block, cfg, torch.float32)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        expected = block(x.unsqueeze(0))
        expected = (expected[0] if isinstance(expected, tuple) else expected).squeeze(0)
        got = ours(x)
    assert torch.equal(got, expected)


@pytest.mark.skipif(not gemm.available(), reason="the packed bfloat16 GEMM needs AVX-512 BF16 or AVX2")
@pytest.mark.parametrize(("arch", "config"), CASES[1:3])
def test_packed_bfloat16_experts_match_their_plain_twin(arch: str, config: dict) -> None:
    block, cfg = _hf_block(arch, **config)
    plain = _ours(block.to(torch.bfloat16), cfg, torch.bfloat16)
    packed = _ours(block, cfg, torch.bfloat16)
    # every expert's two GEMMs and the shared expert's: none of the routers
    assert pack_weights(packed) == 2 * (len(packed.experts) + (packed.shared_expert is not None))
    assert gemm.packed_shape(packed.gate.weight) is None
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        want, got = plain(x).float(), packed(x).float()
    assert torch.allclose(got, want, atol=0.02 * want.abs().max().item(), rtol=0)


native = pytest.mark.skipif(not moe_kernel.available(), reason="the native experts need the packed GEMM's kernels")
# The native cases: the gate/up GEMM with SiLU·mul in one pass (widths of whole panels), and in two calls (40 is not).
NATIVE_CASES = [*CASES, ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40)),
                ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=40))]


@native
@pytest.mark.parametrize("quantization", [None, "w8a8_int8"])
@pytest.mark.parametrize(("arch", "config"), NATIVE_CASES)
def test_native_experts_equal_the_python_loop_bit_for_bit(monkeypatch: pytest.MonkeyPatch, arch: str, config: dict,
                                                          quantization: str | None) -> None:
    if quantization and not gemm_w8a8.available():
        pytest.skip("the int8 GEMM needs AVX-512 VNNI")
    block, cfg = _hf_block(arch, **config)
    ours = _ours(block, cfg, torch.bfloat16)
    pack_weights(ours, quantization)
    native = ours._native()
    assert native is not None and native.weight_format == (quantization or "bf16")
    for tokens in (1, 6, 45):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
        monkeypatch.setenv("PAGELLM_NATIVE_DECODER", "1")
        with torch.no_grad():
            fast = ours(x)
        monkeypatch.setenv("PAGELLM_NATIVE_DECODER", "0")
        with torch.no_grad():
            assert torch.equal(ours(x), fast)


@native
def test_native_experts_refuse_rows_that_name_no_token() -> None:
    block, cfg = _hf_block(CASES[0][0], **CASES[0][1])
    ours = _ours(block, cfg, torch.bfloat16)
    pack_weights(ours)
    native = ours._native()
    assert native is not None
    x = torch.randn(3, HIDDEN).to(torch.bfloat16)
    counts = torch.zeros(8, dtype=torch.int64)
    counts[2] = 2
    with pytest.raises(IndexError, match=r"expert rows must name tokens in \[0, 3\)"):
        native(x, torch.tensor([0, 3]), torch.ones(2), counts)
    assert torch.equal(native(x, torch.tensor([0, 2]), torch.ones(2), counts)[1], torch.zeros(HIDDEN,
                                                                                               dtype=torch.bfloat16))


@native
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_engine_greedy_tokens_are_identical_on_the_native_experts(tiny_model_factory,
                                                                 monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    path = tiny_model_factory(arch)
    calls: list[int] = []
    real = moe_kernel.Experts.__call__
    monkeypatch.setattr(moe_kernel.Experts, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGELLM_NATIVE_DECODER", flag)
        llm = LLM(str(path), dtype="bfloat16", kv_cache_memory="4MiB", max_num_batched_tokens=32)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in outs])
        if flag == "1":
            assert calls  # every sparse layer of every step took the native call
            taken = len(calls)
    assert results[0] == results[1] and len(calls) == taken
