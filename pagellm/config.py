"""Engine configuration: frozen sub-configs composed into one ``EngineConfig``.

Each component takes only the sub-config it uses. Every field carries its help text in ``metadata["help"]``;
the CLI generates its flags from these fields. Validation raises ``ValueError`` that names the fix. Values found
at run time (number of KV blocks, EOS ids, the model's context length) live in runtime objects, never here.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagellm import no_effect
from pagellm.disagg.config import KVTransferConfig
from pagellm.distributed.config import ParallelConfig
from pagellm.kv.events import KVEventsConfig
from pagellm.kv.hash_algos import check_algo
from pagellm.lora import target_projections
from pagellm.mm_config import MultiModalConfig, json_object
from pagellm.sampling_params import LOGPROBS_MODES, MAX_LOGPROBS
from pagellm.sched.config import SchedulerConfig
from pagellm.spec.config import DISABLE_BY_BATCH_SIZE, SPEC_METHODS, SpeculativeConfig  # noqa: F401
from pagellm.spec.config import SHORTHANDS as SPEC_SHORTHANDS
from pagellm.thinking import ReasoningConfig

GiB = 1024**3
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
               "g": GiB, "gib": GiB, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: int | str, name: str | None = None) -> int:
    """Bytes from an int or a string: ``4294967296``, ``4GiB``, ``4G`` or ``4g`` (binary units: K, M, G, T, with or
    without ``iB``), ``4GB`` (decimal: KB, MB, GB, TB), ``1.5GiB``. Errors show ``name=value`` (or the value)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name or 'a size'} must be a number of bytes or a size such as 4GiB, got {value!r}")
    if isinstance(value, int):
        return value
    match = _SIZE.fullmatch(value)
    unit = _SIZE_UNITS.get(match.group(2).lower()) if match else None
    if unit is None:
        shown = f"{name}={value!r}" if name else repr(value)
        raise ValueError(f"{shown} is not a size: write bytes (4294967296) or a number with a unit (4GiB, 512MiB, "
                         "4G; KB/MB/GB are powers of 1000)")
    return int(float(match.group(1)) * unit)


def _processor_names(value: Any) -> tuple[str, ...]:
    """``logits_processors`` as ``module:Class`` names (one name or class, or a list of them)."""
    from pagellm.sample.custom import qualified_name  # no torch until a processor is resolved

    items = [value] if isinstance(value, (str, type)) else list(value or ())
    return tuple(qualified_name(item) for item in items)


def _help(text: str, nargs: str | None = None, **kwargs: Any) -> Any:
    """A config field with its help text (and, for a flag that takes several values, its argparse ``nargs``)."""
    return field(metadata={"help": text, **({"nargs": nargs} if nargs else {})}, **kwargs)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and in which precision."""

    model: str | None = _help(
        "Hugging Face model directory or .gguf file; empty for the built-in SmolLM2-135M-Instruct.", default=None
    )
    dtype: str = _help("Weights and KV dtype: auto (bfloat16 on CPUs with AVX-512 BF16/AMX), float32, bfloat16.",
                       default="auto")
    max_model_len: int | None = _help(
        "Longest sequence (prompt + output) a request may reach; default: the model's context length.", default=None
    )
    disable_sliding_window: bool = _help(
        "Run a sliding-window model with full attention, its context capped to the window (vLLM's flag).",
        default=False)
    seed: int = _help("Seed of the sampler for requests that set no seed of their own.", default=0)
    attention_backend: str = _help(
        "Attention kernels: auto (cpu_paged when its C++ kernel compiles, else torch_ref), cpu_paged, torch_ref.",
        default="auto")
    quantization: str | None = _help(
        "Quantize decoder weights at load (bfloat16, AVX-512 VNNI): w8a8_int8 or w4a8_int4 (4 bits, groups of 32, "
        "llama.cpp's Q4_1; a 4-bit checkpoint's own), int8 activations; w4a16_int4 (those 4 bits, bfloat16 "
        "activations; AVX-512 BF16). Default: none (a 4-bit checkpoint: w4a16_int4 where it runs).", default=None)
    quantize_lm_head: bool = _help(
        "Quantize the LM head (and a tied embedding, the same matrix) to int8 per vocabulary row: on a small model "
        "decoding reads it as much as the layers. With or without --quantization; the same needs. Default: off.",
        default=False)
    generation_config: str = _help(
        "Default sampling parameters for requests that leave them unset: auto (the model's generation_config.json: "
        "temperature, top_p, top_k, min_p, penalties, and max_new_tokens as max_tokens, as vLLM does), vllm (the "
        "neutral OpenAI defaults), or a folder holding a generation_config.json.", default="auto")
    override_generation_config: dict[str, Any] | str | None = _help(
        "Sampling defaults set over generation_config's, as a JSON object of its keys (vLLM's flag), e.g. "
        "'{\"temperature\": 0.5, \"max_new_tokens\": 256}'.", default=None)
    hf_overrides: dict[str, Any] | str | None = _help(
        "Keys of the model's config.json set over its own, as a JSON object (vLLM's flag), e.g. "
        "'{\"max_position_embeddings\": 8192, \"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2.0}}'.",
        default=None)
    pooler_config: dict[str, Any] | str | None = _help(
        "How an encoder-only embedding model (BERT, XLM-RoBERTa) pools its token states, as JSON (vLLM's flag): "
        "'{\"pooling_type\": \"MEAN\"}' (CLS, MEAN or LAST). Default: its sentence-transformers Pooling config's, "
        "else CLS.", default=None)
    runner: str = _help(
        "What the model serves (vLLM's flag): auto (generation, or pooling for an embedding or classifier "
        "checkpoint), generate, or pooling (embeddings and scores only: generation is refused).", default="auto")
    convert: str = _help(
        "Serve a generative checkpoint as another kind (vLLM's flag): auto or none (as it is), or embed (as an "
        "embedding model: last-token pooling, generation refused).", default="auto")
    language_model_only: bool = _help(
        "Serve a vision-language model's decoder alone (vLLM's flag): its vision encoder is neither built nor "
        "loaded (less memory, a faster start), and prompts with images are refused. Default: off.", default=False)
    tokenizer: str | None = _help(
        "Tokenizer directory (tokenizer.json or tokenizer_config.json) to use instead of the model's own, e.g. the "
        "original model's beside a .gguf file (vLLM's flag). Default: the model's.", default=None)
    skip_tokenizer_init: bool = _help(
        "Run without a tokenizer (vLLM's flag), for a frontend that tokenizes itself: prompts are token ids, the "
        "output is token ids (return_token_ids; its text is empty); no chat, stop strings, bad words or structured "
        "outputs. Default: off.", default=False)
    max_logprobs: int = _help(
        "Most logprobs, top_logprobs or prompt_logprobs a request may ask for per token (vLLM's flag); -1: the whole "
        "vocabulary.", default=MAX_LOGPROBS)
    logprobs_mode: str = _help(
        "What logprobs carry (vLLM's flag): raw_logprobs (the model's, before any processing), processed_logprobs "
        "(of the distribution sampled from: after penalties, bias, bans, temperature, top-k/p, min-p), raw_logits or "
        "processed_logits (the logit values themselves). Prompt logprobs stay raw logprobs.", default="raw_logprobs")
    load_format: str = _help(
        "How the weights load (vLLM's flag): auto (the model's safetensors or .gguf file), safetensors, gguf, or "
        "dummy (random weights in the model's shapes, from its config.json alone: for timing a model without its "
        "weights).", default="auto")
    enable_prompt_embeds: bool = _help(
        "Take prompts as input embeddings (vLLM's flag): LLM.generate({\"prompt_embeds\": tensor}), or the "
        "completions API's prompt_embeds (a base64 torch.save of a [num_tokens, hidden_size] tensor). The API "
        "server then loads torch to read them. Default: off.", default=False)
    logits_processors: tuple[str, ...] = _help(
        "Custom logits processors (vLLM's flag): package.module:Class names of AdapterLogitsProcessor subclasses "
        "(pagellm.sample.custom), importable by the server and its workers; requests opt in through their "
        "extra_args (the API's vllm_xargs). Default: none.", default=(), nargs="+")
    enable_lora: bool = _help(
        "Serve requests with LoRA adapters (PEFT directories, one per request: LLM.generate(lora_request=...)); "
        "adapted steps run the Python layers. Default: off.", default=False)
    max_lora_rank: int | None = _help(
        "With enable_lora: the highest adapter rank served; an adapter of a higher rank is refused when named "
        "(vLLM's flag). Default: any rank.", default=None)
    max_cpu_loras: int | None = _help(
        "With enable_lora: how many adapters each worker keeps loaded; past it, the least recently used ones that no "
        "running request uses are dropped (loaded again from their folders when named again). Default: all.",
        default=None)
    lora_target_modules: tuple[str, ...] | None = _help(
        "With enable_lora: the only modules adapters apply to (vLLM's flag): qkv_proj, o_proj, gate_up_proj, "
        "down_proj (or q_proj, k_proj, ...); an adapter's matrices for others are not applied. Default: all.",
        default=None, nargs="+")
    worker_extension_cls: str | None = _help(
        "A class (package.module:Name, vLLM's flag) whose methods every worker gains, importable by the workers: "
        "LLM.collective_rpc(\"method\") runs one on every rank (an RL loop's weight sync). Default: none.",
        default=None)

    def __post_init__(self) -> None:
        source = self.generation_config
        if source not in ("auto", "vllm") and not (Path(source) / "generation_config.json").is_file():
            raise ValueError(f"generation_config={source!r}: use auto (the model's generation_config.json), vllm "
                             "(the neutral defaults) or a folder holding a generation_config.json")
        object.__setattr__(self, "override_generation_config", json_object(self.override_generation_config,
                                                                            "override_generation_config"))
        object.__setattr__(self, "hf_overrides", json_object(self.hf_overrides, "hf_overrides"))
        object.__setattr__(self, "pooler_config", json_object(self.pooler_config, "pooler_config"))
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner={self.runner!r}; use auto, generate or pooling")
        if self.convert not in ("auto", "none", "embed"):
            raise ValueError(f"convert={self.convert!r}; use auto, none or embed (a classifier needs its "
                             "*ForSequenceClassification checkpoint)")
        object.__setattr__(self, "logits_processors", _processor_names(self.logits_processors))
        if isinstance(self.worker_extension_cls, type):  # a class given in code: its import name
            cls = self.worker_extension_cls
            object.__setattr__(self, "worker_extension_cls", f"{cls.__module__}:{cls.__qualname__}")
        if self.quantization not in (None, "w8a8_int8", "w4a8_int4", "w4a16_int4"):
            raise ValueError(f"quantization={self.quantization!r} is not supported; use w8a8_int8, w4a8_int4, "
                             "w4a16_int4 or leave it unset")
        quantized = f"quantization={self.quantization}" if self.quantization else \
            "quantize_lm_head" if self.quantize_lm_head else None
        if quantized and self.dtype in ("float32", "fp32", "float"):
            raise ValueError(f"{quantized} runs on bfloat16 models; set dtype bfloat16")
        if self.attention_backend not in ("auto", "cpu_paged", "torch_ref"):
            raise ValueError(f"attention_backend={self.attention_backend!r}; use auto, cpu_paged or torch_ref")
        if self.dtype not in ("auto", "float32", "fp32", "float", "bfloat16", "bf16"):
            raise ValueError(f"dtype={self.dtype!r} is not supported; use auto, float32 or bfloat16")
        self._check_load_format()
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}; use one of {', '.join(LOGPROBS_MODES)}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 for the whole vocabulary; got {self.max_logprobs}")
        if self.skip_tokenizer_init and self.tokenizer is not None:
            raise ValueError("skip_tokenizer_init runs without a tokenizer: leave tokenizer unset")
        if self.tokenizer is not None and not _has_tokenizer_files(Path(self.tokenizer)):
            raise ValueError(f"tokenizer={self.tokenizer!r} is not a directory holding tokenizer.json or "
                             "tokenizer_config.json; pass the folder of a Hugging Face tokenizer")
        for name in ("max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (value < 1 or not self.enable_lora):
                raise ValueError(f"{name} must be >= 1 and goes with enable_lora (--enable-lora); got {value}")
        if self.lora_target_modules is not None:
            if not self.enable_lora:
                raise ValueError("lora_target_modules goes with enable_lora (--enable-lora)")
            target_projections(self.lora_target_modules)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


    def _check_load_format(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r}; use one of {', '.join(LOAD_FORMATS)}")
        gguf = self.model is None or str(self.model).lower().endswith(".gguf")
        if (self.load_format == "gguf" and not gguf) or (self.load_format == "safetensors" and gguf):
            raise ValueError(f"load_format={self.load_format} does not read {self.model or 'the built-in .gguf'}: "
                             "a .gguf file loads with gguf, a model directory with safetensors (or leave it auto)")
        if self.load_format == "dummy" and gguf:
            raise ValueError("load_format=dummy makes a model from its config.json: pass a model directory")

    def tokenizer_dir(self, model_dir: Path) -> Path:
        """The folder the tokenizer loads from: ``tokenizer`` when set, else the model's own."""
        return Path(self.tokenizer) if self.tokenizer is not None else model_dir

    def logprobs_cap(self, vocab_size: int) -> int:
        """The most logprobs per token a request may ask for (``max_logprobs``, -1 being the vocabulary)."""
        return vocab_size if self.max_logprobs == -1 else self.max_logprobs


def _has_tokenizer_files(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = _help("Tokens per KV-cache block.", default=16)
    kv_cache_memory: int = field(default=2 * GiB, metadata={
        "help": "Memory for the KV cache (all layers): bytes, or a size such as 4GiB, 512MiB or 4G.", "size": True,
        "aliases": ("--kv-cache-memory-bytes",)})  # vLLM's name
    num_gpu_blocks_override: int | None = _help(
        "The number of KV-cache blocks, instead of what kv_cache_memory holds (vLLM's flag, named for GPUs; here the "
        "CPU cache's blocks), e.g. for a test or a benchmark that needs an exact pool. Default: from "
        "kv_cache_memory.", default=None)
    enable_prefix_caching: bool = _help("Reuse KV blocks of identical prompt prefixes across requests.",
                                        default=True)
    prefix_caching_hash_algo: str | None = _help(
        "Hash the prefix cache's blocks as vLLM does, with sha256, sha256_cbor, xxhash or xxhash_cbor (vLLM's "
        "flag), so that a KV-aware router computing vLLM's hashes finds them in the KV events (set PYTHONHASHSEED "
        "as for vLLM). Default: pagellm's own hashes (SHA-256), computed natively, which no router reproduces.",
        default=None)
    kv_cache_metrics: bool = _help(
        "Histograms of how long KV blocks stay (lifetime, idle before eviction, gaps between prefix-cache hits) for "
        "a sample of them (vLLM's flag; the scheduler then takes its Python paths).", default=False)
    kv_cache_metrics_sample: float = _help("The share of KV blocks --kv-cache-metrics follows, in (0, 1].",
                                           default=0.01)
    kv_cache_prefault: bool = _help("Populate the KV cache's memory in the background, on CPU time nothing else "
                                    "wants, so that a block's first use does not pay for it.", default=True)
    enable_sleep_mode: bool = _help(
        "Let the engine sleep (vLLM's flag: LLM.sleep(), POST /sleep): while asleep the KV cache's memory goes back "
        "to the OS and requests are refused; waking up takes it back. Default: off.", default=False)
    kv_cache_dtype: str = _help(
        "KV cache element type: auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e4m3 or fp8_e5m2. An 8-bit cache "
        "holds twice the tokens in the same kv_cache_memory and halves attention's reads; K/V are stored rounded "
        "(scale 1.0, saturating), so outputs drift from the model's dtype.", default="auto")

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory, "kv_cache_memory"))
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}; use auto, fp8, fp8_e4m3 or fp8_e5m2")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        check_algo(self.prefix_caching_hash_algo)
        if not 0.0 < self.kv_cache_metrics_sample <= 1.0:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {self.kv_cache_metrics_sample}")


# The default step budget, as vLLM picks its own on CPUs: offline (``LLM``, ``pagellm bench throughput``) larger steps
# amortise each step's weight reads over more prompt tokens (4096 gave 1-4 % more output tok/s than 2048 on the
# built-in model, docs/performance.md Round 12); a server's newcomers wait for the step that is running, so it keeps
# steps shorter (``EngineConfig.for_serving``, applied by ``AsyncLLM``).
@dataclass(frozen=True)
class ProfilerConfig:
    """Torch profiler sessions of the engine's workers, started and stopped on request."""

    profiler_dir: str | None = _help(
        "Folder for torch profiler traces and op summaries. Set, the server answers POST /start_profile and POST "
        "/stop_profile (and LLM.start_profile() / stop_profile() work); unset, profiling is off.", default=None)
    profiler_with_stack: bool = _help("Record each op's Python stack in the traces (slower, larger files).",
                                      default=False)

    def require(self) -> None:
        """A ValueError saying how to turn profiling on, when it is off."""
        if not self.profiler_dir:
            raise ValueError("profiling is off: start the engine with a folder for its traces (pagellm serve "
                             "--profiler-dir DIR, or LLM(..., profiler_dir=DIR))")


# Flat engine arguments map onto these sections; the speculative section is one JSON argument.
_SECTIONS: dict[str, type] = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "profiler_config": ProfilerConfig,
    "multimodal_config": MultiModalConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, sliced by component."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)
    multimodal_config: MultiModalConfig = field(default_factory=MultiModalConfig)
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig)
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    reasoning_config: ReasoningConfig = field(default_factory=ReasoningConfig)  # a reasoning model's thinking tags

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if spec.method == "eagle" and spec.model is None and self.model_config.model is not None:
            raise ValueError("eagle needs 'model': the head's .safetensors file from `pagellm train-draft --method "
                             "eagle` (only the built-in model has a shipped default head)")
        self.parallel_config.check_engine(spec.method == "draft_model" and spec.model is None)
        if self.model_config.logits_processors and spec.method is not None:
            raise ValueError("custom logits_processors do not run with speculative decoding (they see every sampled "
                             "token, which drafts would skip): drop one of them")
        if self.model_config.enable_prompt_embeds and spec.method is not None:
            raise ValueError("enable_prompt_embeds does not run with speculative decoding (proposers draft from "
                             "token ids, which an embeddings prompt has not): drop one of them")
        if self.parallel_config.data_parallel_size > 1 and self.kv_transfer_config.kv_connector is not None:
            raise ValueError("kv_transfer_config runs with data_parallel_size 1 (one engine core per prefill or "
                             "decode server)")
        if self.kv_events_config.enable_kv_cache_events and not self.cache_config.enable_prefix_caching:
            raise ValueError("kv_events_config needs enable_prefix_caching: the events describe the prefix cache")
        if self.kv_events_config.publishes and self.parallel_config.data_parallel_size > 1:
            self.kv_events_config.for_rank(0)  # each core publishes on its own port: refused by name when it cannot
        algo = self.cache_config.prefix_caching_hash_algo
        if algo is not None and algo.startswith("xxhash") and self.kv_transfer_config.kv_connector is not None \
                and os.environ.get("PYTHONHASHSEED") is None:
            raise ValueError(f"prefix_caching_hash_algo={algo} with a kv_transfer_config needs PYTHONHASHSEED set, "
                             "the same on both servers: without it each process roots its xxHash hashes on a "
                             "random seed, and no stored block would ever match")
        self.kv_transfer_config.check_engine(self.cache_config.enable_prefix_caching,
                                             self.parallel_config.world_size, self.model_config.enable_lora,
                                             self.speculative_config.method)

    def for_serving(self) -> EngineConfig:
        """This config with the online-serving defaults filled in (``SchedulerConfig.for_serving``)."""
        return dataclasses.replace(self, scheduler_config=self.scheduler_config.for_serving())

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat, vLLM-style keyword arguments (``max_num_seqs=64``, ``dtype="float32"``, ...); vLLM's
        arguments that do nothing here (``gpu_memory_utilization``, ..., ``no_effect.ENGINE``) are taken and logged."""
        kwargs = no_effect.drop_engine_args(kwargs)
        speculative = SpeculativeConfig.parse(kwargs.pop("speculative_config", None),
                                              **{name: kwargs.pop(name, None) for name, _ in SPEC_SHORTHANDS})
        kv_transfer = KVTransferConfig.parse(kwargs.pop("kv_transfer_config", None))
        kv_events = KVEventsConfig.parse(kwargs.pop("kv_events_config", None))
        reasoning = ReasoningConfig.parse(kwargs.pop("reasoning_config", None), kwargs.pop("reasoning_parser", None))
        owners = flat_field_owners()
        per_section: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in kwargs.items():
            if key not in owners:
                close = difflib.get_close_matches(key, owners, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                valid = ", ".join(sorted([*owners, "speculative_config", "kv_transfer_config", "kv_events_config",
                                          "reasoning_config", "reasoning_parser",
                                          *(name for name, _ in SPEC_SHORTHANDS)]))
                raise ValueError(f"unknown engine argument {key!r}{hint}; valid ones: {valid}")
            per_section[owners[key]][key] = value
        sections = {name: _SECTIONS[name](**values) for name, values in per_section.items()}
        return cls(speculative_config=speculative, kv_transfer_config=kv_transfer, kv_events_config=kv_events,
                   reasoning_config=reasoning, **sections)


def flat_field_owners() -> dict[str, str]:
    """Map each flat engine-argument name to the sub-config section that owns it."""
    return {f.name: section for section, klass in _SECTIONS.items() for f in dataclasses.fields(klass)}


def flat_fields() -> list[dataclasses.Field]:
    """Every engine argument as a dataclass field (for generating CLI flags)."""
    return [f for klass in _SECTIONS.values() for f in dataclasses.fields(klass)]
