"""Shared fixtures: tiny random Llama-family models built in code and saved as Hugging Face directories, and the
packed GEMM's path (``isa``)."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

# Tiny models run as fast on one thread, and one thread cannot spin against a busy neighbour on a shared 2-core box.
os.environ.setdefault("PAGELLM_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["PAGELLM_NUM_THREADS"]))

# Ray's head waits 30 s for its GCS server to bind a port; on a 2-core box whose other test worker is compiling a
# kernel, that start once took longer (a fresh-clone CI run, 2026-12-07: a module's tests all errored in setup).
# Ray's own override for slow starts gives it 120 s; nothing waits longer where it starts at once.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
# Ray's memory monitor kills workers once the node reads 95 % used, and in this VM's cgroup that count includes the
# page cache of the run's own file I/O (a fresh-clone CI run, 2026-12-07: a tiny model's replicas killed at "22.2 of
# 23.5 GB"). Its documented off switch leaves real exhaustion to the OS; these tests' models are tiny.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")

TINY_VOCAB = 320  # 256 byte tokens + specials + spare ids


@pytest.fixture(scope="module", autouse=True)
def _one_ray_module_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    """``make test`` runs two pytest workers; a module that sets ``USES_RAY`` holds an exclusive lock on a file both
    share while it runs (its Ray fixtures start after this one and stop before it ends), so no two Ray instances
    meet: Ray takes one local instance, and some of these tests check that none runs."""
    if not getattr(request.module, "USES_RAY", False):
        yield
        return
    with open(Path(tempfile.gettempdir()) / "pagellm-tests-ray.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _byte_tokenizer():
    """A real byte-level BPE tokenizer (no merges) with chat special tokens, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(sorted(byte_vocab))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


# Mixture-of-experts shapes: 4 experts, 2 per token; Qwen2-MoE with its gated shared expert.
MOE_DEFAULTS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
}


# What makes each family's own parts show in a tiny model: SmolLM3's second layer without a rotary embedding;
# Granite's multipliers (Granite 3's embedding and logit ones; an attention scale not 1/sqrt(head_dim)); OLMo 3's
# sliding layer (a window the prompts pass) beside its full one; EXAONE 4's sliding layer and NoPE full one.
FAMILY_DEFAULTS: dict[str, dict] = {
    "smollm3": dict(no_rope_layer_interval=2),
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.5,
                    logits_scaling=8.0, initializer_range=0.1),
    "granitemoe": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.5,
                       logits_scaling=8.0, initializer_range=0.1, num_local_experts=4, num_experts_per_tok=2),
    # Granite 4.0's attention-only models (granite-4.0-micro): every layer attention, the shared MLP alone
    "granite4": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.5,
                     logits_scaling=8.0, initializer_range=0.1, num_local_experts=0, shared_intermediate_size=96,
                     layer_types=["attention", "attention"], position_embedding_type="rope"),
    "olmo3": dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    # EXAONE 4's hybrid (its 32B's): a sliding layer, then a full-attention one without a rotary embedding
    "exaone4": dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    # Cohere's logit scale (Command R's); Command R7B's sliding layer, then a full-attention one without rotary
    "cohere": dict(logit_scale=0.0625, initializer_range=0.1),
    "cohere2": dict(logit_scale=0.25, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                    initializer_range=0.1),
    # gpt-oss's sliding layer and full one, YaRN past its original context, a clamp low enough to bite at this size
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.3, initializer_range=0.1,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128}),
}


def build_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random float32 model (``arch`` in llama, qwen2, qwen3, mistral, phi3, smollm3, granite, olmo2,
    olmo3, exaone4, ernie4_5, cohere, cohere2, gemma, gemma2, gemma3 and the mixtures of experts mixtral, qwen2_moe,
    qwen3_moe, granitemoe, gpt_oss, and granite4: Granite 4.0's attention-only kind) with a tokenizer under
    ``path``."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=256, eos_token_id=257)
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "granitemoe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM),
        "granite4": (transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM),
        "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM),
        "ernie4_5": (transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM),
        "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM),
        "cohere2": (transformers.Cohere2Config, transformers.Cohere2ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[arch]
    if arch in ("phi3", "smollm3", "ernie4_5", "cohere", "cohere2"):  # default pad ids (32000, 128004, 0) outside the
        common.setdefault("pad_token_id", None)  # tiny vocabulary or among the prompts' bytes
    if arch in ("qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3", "ernie4_5"):  # default head_dim not hidden / heads
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
    if arch == "gemma3":  # a sliding layer (a short window, its own rope base) and a global one; a scale not 1/sqrt(d)
        common.setdefault("sliding_window", 16)
        common.setdefault("layer_types", ["sliding_attention", "full_attention"])
        common.setdefault("query_pre_attn_scalar", 24)
        common.setdefault("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                              "full_attention": {"rope_type": "default", "rope_theta": 100000.0}})
    if arch == "gemma2":  # caps low enough to bite at this size; a sliding layer, a global one; a scale not 1/sqrt(d)
        common.setdefault("attn_logit_softcapping", 1.0)
        common.setdefault("final_logit_softcapping", 3.0)
        common.setdefault("sliding_window", 16)
        common.setdefault("query_pre_attn_scalar", 24)
    if arch.startswith("gemma"):  # its default pad id (0) is a byte the prompts use; weights large enough that
        common.setdefault("pad_token_id", None)  # GeGLU's gates reach where gelu's tanh form parts from the exact one
        common.setdefault("initializer_range", 0.1)
    for key, value in FAMILY_DEFAULTS.get(arch, {}).items():
        common.setdefault(key, value)
    for key, value in MOE_DEFAULTS.get(arch, {}).items():
        common.setdefault(key, value)
    model = model_cls(config_cls(**common)).to(torch.float32).eval()
    with torch.no_grad():  # random init leaves biases at zero; make them matter
        for name, param in model.named_parameters():
            if name.endswith((".bias", "_bias")):  # gpt-oss's experts' too
                param.normal_(0, 0.5)
            elif name.endswith(".sinks"):  # gpt-oss's: logits on the scores' scale
                param.normal_(0, 1.0)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # ones would hide a misplaced q/k norm
                param.uniform_(0.5, 1.5)
            elif arch.startswith("gemma") and name.endswith("norm.weight"):  # zeros (1 + w = 1) would hide the 1 + w
                param.uniform_(-0.5, 0.5)
            elif (name.endswith("gate.weight") and "proj" not in name) or name.endswith("router.weight"):
                # routers (Granite MoE's by that name), the shared expert's gate
                param.normal_(0, 0.5)  # a decisive router: near-uniform ones would make top-k a coin toss
    model.save_pretrained(path)
    _byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        key = (arch, seed, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("qwen2")


@pytest.fixture(params=["vector", "amx"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test on one of the packed GEMM's paths: its vector path (AVX-512 BF16, or AVX2 + FMA where the CPU has
    no AVX-512 BF16), or AMX tiles, only where this CPU has AMX (and the OS grants it)."""
    from pagellm.ops import gemm

    default = gemm.amx()
    if gemm.use_amx(request.param == "amx") != (request.param == "amx"):
        gemm.use_amx(default)
        pytest.skip("this CPU has no AMX-BF16")
    yield request.param
    gemm.use_amx(default)
