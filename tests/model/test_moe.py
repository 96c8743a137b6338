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
from pagellm.model import llama
from pagellm.model.layers.moe import SparseMoeBlock, route
from pagellm.ops import gemm, gemm_w4a16, gemm_w8a8
from pagellm.ops.decoder_stack import DecoderStack
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
    # every expert's two GEMMs, the router, and the shared expert's two and its gate
    shared = packed.shared_expert is not None
    assert pack_weights(packed) == 2 * len(packed.experts) + 1 + 3 * shared
    assert gemm.weight_format(packed.gate.weight) == "bf16"
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        want, got = plain(x).float(), packed(x).float()
        same = _untied(packed.gate(x), packed.moe.top_k) & _untied(plain.gate(x), plain.moe.top_k)
    assert same.sum() >= 26
    assert torch.allclose(got[same], want[same], atol=0.02 * want.abs().max().item(), rtol=0)


native = pytest.mark.skipif(not moe_kernel.available(), reason="the native experts need the packed GEMM's kernels")
# The native cases: the gate/up GEMM with SiLU·mul in one pass (widths of whole panels), and in two calls (40 is not).
NATIVE_CASES = [*CASES, ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40)),
                ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=40))]


def _untied(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The tokens whose top_k + 1 largest router logits all differ: the others sit on an exact tie (bfloat16 logits
    make them common) that each top-k breaks its own way (torch's is unspecified; the native one takes the lower
    index)."""
    top = logits.float().topk(min(top_k + 1, logits.shape[-1]), dim=-1).values
    return (top[:, 1:] != top[:, :-1]).all(dim=-1)


def _bound(arch: str, config: dict, quantization: str | None = None) -> SparseMoeBlock:
    block, cfg = _hf_block(arch, **config)
    ours = _ours(block, cfg, torch.bfloat16)
    pack_weights(ours, quantization)
    return ours


@native
@pytest.mark.parametrize("quantization", [None, "w8a8_int8", "w4a8_int4", "w4a16_int4"])
@pytest.mark.parametrize(("arch", "config"), NATIVE_CASES)
def test_native_experts_equal_the_python_loop_bit_for_bit(arch: str, config: dict, quantization: str | None) -> None:
    """Given a routing, the native experts make the Python loop's kernel calls: the same bits; and the whole layer
    in one call is the router's GEMM, the native routing and those experts."""
    if quantization and not gemm_w8a8.available():
        pytest.skip("the quantized GEMMs need AVX-512 VNNI")
    if quantization == "w4a16_int4" and not gemm_w4a16.available():
        pytest.skip("the W4A16 kernel needs AVX-512 BF16 and VNNI")
    ours = _bound(arch, config, quantization)
    native, moe = ours.native_experts(), ours.moe
    assert native is not None and native.routes and native.weight_format == (quantization or "bf16")
    for tokens in (1, 6, 45):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
        weights, experts = route(ours.gate(x), moe.top_k, moe.renormalize)
        weights = weights.to(x.dtype) if moe.weights_in_model_dtype else weights
        order = torch.argsort(experts.reshape(-1), stable=True)
        rows, scales = order // moe.top_k, weights.reshape(-1)[order]
        counts = torch.bincount(experts.reshape(-1), minlength=moe.num_experts)
        with torch.no_grad():
            loop = ours.routed_torch(x, rows, scales.unsqueeze(-1), counts.tolist())
        assert torch.equal(native(x, rows, scales.float(), counts), loop)
        routing = moe_kernel.route(gemm.linear(x, ours.gate.weight), moe.top_k, moe.renormalize,
                                   moe.weights_in_model_dtype)
        routed = native(x, *routing)
        if ours.shared_expert is None:
            assert torch.equal(native.forward(x), routed)
        else:  # plus the shared expert, its sigmoid gate computed natively (torch's up to the exp's last bits)
            with torch.no_grad():
                shared = torch.sigmoid(ours.shared_expert_gate(x)) * ours.shared_expert(x)
            want = (routed + shared).float()
            torch.testing.assert_close(native.forward(x).float(), want, rtol=0, atol=0.01 * want.abs().max().item())


@native
@pytest.mark.parametrize(("arch", "config"), NATIVE_CASES)
def test_native_routing_is_torchs(arch: str, config: dict) -> None:
    """The native softmax and top-k choose torch's experts, in its grouped order, with its weights up to the
    softmax's last bits (a bfloat16 rounding of them, for Qwen)."""
    ours = _bound(arch, config)
    moe = ours.moe
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    logits = gemm.linear(x, ours.gate.weight)
    weights, experts = route(logits, moe.top_k, moe.renormalize)
    weights = weights.to(torch.bfloat16).float() if moe.weights_in_model_dtype else weights
    order = torch.argsort(experts.reshape(-1), stable=True)
    rows, scales, counts = moe_kernel.route(logits, moe.top_k, moe.renormalize, moe.weights_in_model_dtype)
    untied = _untied(logits, moe.top_k)
    assert untied.sum() >= 56
    if untied.all():  # the whole grouping is torch's
        assert torch.equal(counts, torch.bincount(experts.reshape(-1), minlength=moe.num_experts))
        assert torch.equal(rows, order // moe.top_k)
    _assert_tokens_routed_alike(rows, scales, counts, experts, weights, untied, rtol=2 ** -8)


def _assert_tokens_routed_alike(rows: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor,
                                weights: torch.Tensor, untied: torch.Tensor, rtol: float) -> None:
    """Each untied token's experts and weights in the native grouping (``rows``, ``scales``, ``counts``) as torch
    chose and weighed them (``experts``, ``weights``: [tokens, top_k])."""
    native_experts = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    for token in untied.nonzero().flatten().tolist():
        mine = sorted(zip(native_experts[rows == token].tolist(), scales[rows == token].tolist()))
        theirs = sorted(zip(experts[token].tolist(), weights[token].tolist()))
        assert [e for e, _ in mine] == [e for e, _ in theirs]
        torch.testing.assert_close(torch.tensor([w for _, w in mine]), torch.tensor([w for _, w in theirs]),
                                   rtol=rtol, atol=0)


@native
def test_native_experts_refuse_rows_that_name_no_token() -> None:
    block, cfg = _hf_block(CASES[0][0], **CASES[0][1])
    ours = _ours(block, cfg, torch.bfloat16)
    pack_weights(ours)
    native = ours.native_experts()
    assert native is not None
    x = torch.randn(3, HIDDEN).to(torch.bfloat16)
    counts = torch.zeros(8, dtype=torch.int64)
    counts[2] = 2
    with pytest.raises(IndexError, match=r"expert rows must name tokens in \[0, 3\)"):
        native(x, torch.tensor([0, 3]), torch.ones(2), counts)
    assert torch.equal(native(x, torch.tensor([0, 2]), torch.ones(2), counts)[1], torch.zeros(HIDDEN,
                                                                                               dtype=torch.bfloat16))


def _engine_run(path, monkeypatch: pytest.MonkeyPatch, native: str) -> list[tuple[list[int], float]]:  # noqa: ANN001
    monkeypatch.setenv("PAGELLM_NATIVE_DECODER", native)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory="4MiB", max_num_batched_tokens=32)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in outs]


@native
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_the_native_decoder_stack_runs_a_mixture_of_experts_as_its_python_layers_do(
        tiny_model_factory, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """Mixtral, Qwen2-MoE (its shared expert too) and Qwen3-MoE take the one-call decoder stack, whose sparse layers
    make the layer's native call: the same tokens and logprobs as the Python layers around that call, bit for bit;
    and greedy tokens equal the plain-PyTorch twin's (torch's routing, the Python loop)."""
    path = tiny_model_factory(arch)
    calls: list[int] = []
    real = DecoderStack.run
    monkeypatch.setattr(DecoderStack, "run", lambda self, *a: calls.append(1) or real(self, *a))
    stacked = _engine_run(path, monkeypatch, "1")
    assert calls  # every step took the stack
    twin = _engine_run(path, monkeypatch, "0")
    assert [tokens for tokens, _ in twin] == [tokens for tokens, _ in stacked]
    assert [lp for _, lp in twin] == pytest.approx([lp for _, lp in stacked], abs=1e-3)
    monkeypatch.setattr(llama, "run_native", lambda *a: None)  # the Python layers, the native call inside
    taken = len(calls)
    assert _engine_run(path, monkeypatch, "1") == stacked and len(calls) == taken


def _gpt_oss_block(quantization: str | None) -> SparseMoeBlock:
    """gpt-oss's sparse layer (biases on the router and the experts, the softmax of the chosen logits, a clamp low
    enough to bite) with random weights, packed."""
    config = transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=48, num_local_experts=8,
                                       num_experts_per_tok=3, swiglu_limit=0.3, num_attention_heads=4, head_dim=16,
                                       num_hidden_layers=1, vocab_size=32)
    cfg = ArchConfig.from_hf(config.to_dict() | {"architectures": ["GptOssForCausalLM"]})
    assert cfg.moe is not None and cfg.moe.bias and cfg.moe.softmax_top_k
    ours = SparseMoeBlock(cfg.moe, HIDDEN, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * (0.5 if name.startswith("gate.") else 0.2))
    pack_weights(ours, quantization)
    return ours


@native
@pytest.mark.parametrize("quantization", [None, "w8a8_int8", "w4a16_int4"])
def test_native_gpt_oss_experts_equal_the_python_loop_bit_for_bit(quantization: str | None) -> None:
    """gpt-oss's layer in the native call: given a routing, the Python loop's bits (gate/up bias in the GEMM, the
    clamped SwiGLU, the down bias after it); the whole layer is its router (with its bias), the softmax of the chosen
    logits and those experts."""
    if quantization and not (gemm_w8a8.available() and (quantization != "w4a16_int4" or gemm_w4a16.available())):
        pytest.skip("the quantized GEMMs need AVX-512 VNNI (and BF16)")
    ours = _gpt_oss_block(quantization)
    native, moe = ours.native_experts(), ours.moe
    assert native is not None and native.routes and native.weight_format == (quantization or "bf16")
    for tokens in (1, 6, 45):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
        with torch.no_grad():
            assert (ours.experts[0].gate_up_proj(x).float().abs() > moe.swiglu_limit).any()  # the clamp bites
            weights, experts = route(ours.gate(x), moe.top_k, moe.renormalize, softmax_top_k=True)
            weights = weights.to(x.dtype)
            order = torch.argsort(experts.reshape(-1), stable=True)
            rows, scales = order // moe.top_k, weights.reshape(-1)[order]
            counts = torch.bincount(experts.reshape(-1), minlength=moe.num_experts)
            loop = ours.routed_torch(x, rows, scales.unsqueeze(-1), counts.tolist())
        assert torch.equal(native(x, rows, scales.float(), counts), loop)
        routing = moe_kernel.route(gemm.linear(x, ours.gate.weight, ours.gate.bias), moe.top_k, moe.renormalize,
                                   moe.weights_in_model_dtype, softmax_top_k=True)
        assert torch.equal(native.forward(x), native(x, *routing))


@native
def test_native_gpt_oss_routing_is_the_softmax_of_the_chosen_logits() -> None:
    ours = _gpt_oss_block(None)
    moe = ours.moe
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    logits = gemm.linear(x, ours.gate.weight, ours.gate.bias)
    weights, experts = route(logits, moe.top_k, moe.renormalize, softmax_top_k=True)
    rows, scales, counts = moe_kernel.route(logits, moe.top_k, moe.renormalize, False, softmax_top_k=True)
    untied = _untied(logits, moe.top_k)
    assert untied.sum() >= 56
    _assert_tokens_routed_alike(rows, scales, counts, experts, weights, untied, rtol=1e-6)


@native
def test_gpt_oss_serves_with_its_experts_in_the_native_call_as_in_the_python_loop(
        tiny_model_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """In bfloat16 gpt-oss's sparse layers make the native call (here inside the Python layers, the one-call stack
    set aside: it makes the same call, ``test_family_layers.py``); greedy tokens equal the Python loop's (its twin:
    torch's routing, the loop) and log-probabilities agree within the routing's last bits."""
    path = tiny_model_factory("gpt_oss")
    monkeypatch.setattr(llama, "run_native", lambda *a: None)
    calls: list[int] = []
    real = moe_kernel.Experts.forward
    monkeypatch.setattr(moe_kernel.Experts, "forward", lambda self, x: calls.append(1) or real(self, x))
    native_run = _engine_run(path, monkeypatch, "1")
    assert calls
    taken = len(calls)
    twin = _engine_run(path, monkeypatch, "0")
    assert len(calls) == taken  # the twin made no native call
    assert [tokens for tokens, _ in twin] == [tokens for tokens, _ in native_run]
    assert [lp for _, lp in twin] == pytest.approx([lp for _, lp in native_run], abs=1e-3)
