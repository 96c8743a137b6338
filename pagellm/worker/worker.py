"""A worker owns one device's tensors: it sets up threads and seeds, loads the model, sizes and allocates the
KV cache, and runs the model runner. ``RuntimeInfo`` (``runtime.py``) reports what it found (context length,
number of blocks)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch

from pagellm import envs, native_build
from pagellm.plugins import import_object
from pagellm.attention import cpu_paged
from pagellm.attention.base import get_backend, resolve_kv_dtype
from pagellm.attention.runs import native_attention
from pagellm.config import CacheConfig, KVTransferConfig, ModelConfig, ProfilerConfig, SpeculativeConfig
from pagellm.disagg.connector import KVStore, layout_dir
from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.kv.hash_algos import make_hasher
from pagellm.metrics.profiler import Profiler
from pagellm.model import fp8_checkpoint, gguf_convert, mxfp4, weight_only
from pagellm.model.arch import ArchConfig
from pagellm.model.encoder_config import encoder_settings, pooling_type
from pagellm.model.layers.rotary import use_long_factors
from pagellm.model.loader import iter_weights, load_hf_config, resolve_dtype, resolve_model_dir
from pagellm.model.registry import build_model
from pagellm.ops import decoder_stack, fused, gemm, gemm_mxfp4, gemm_w4a16, gemm_w8a8
from pagellm.ops.build import build_library
from pagellm.sample import native as sample_native
from pagellm.sched.output import ModelRunnerOutput, SchedulerOutput
from pagellm.spec.base import make_proposer
from pagellm.worker.kv_prefault import KVPrefaulter, discard, release_freed_memory
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.runtime import RuntimeInfo

logger = logging.getLogger(__name__)


def worker_class(extension: str | None) -> type[Worker]:
    """``Worker``, or with ``worker_extension_cls`` a subclass that also has the extension's methods (which must not
    replace a worker's own: ValueError naming them)."""
    if extension is None:
        return Worker
    cls = import_object(extension, "--worker-extension-cls")
    if not isinstance(cls, type):
        raise ValueError(f"--worker-extension-cls {extension!r}: give a class, not a {type(cls).__name__}")
    clashes = sorted(name for name in vars(cls) if not name.startswith("__") and hasattr(Worker, name))
    if clashes:
        raise ValueError(f"--worker-extension-cls {extension!r} replaces the worker's own {', '.join(clashes)}; "
                         "name its methods otherwise")
    return type(f"Worker[{cls.__name__}]", (Worker, cls), {})


class Worker:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, spec_config: SpeculativeConfig,
                 parallel: ParallelState = SINGLE, profiler_config: ProfilerConfig = ProfilerConfig(),
                 num_threads: int | None = None, kv_transfer: KVTransferConfig = KVTransferConfig()) -> None:
        threads = num_threads or envs.num_threads()  # a tensor-parallel rank: its share
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(model_config.seed)
        start = time.perf_counter()
        self.parallel = parallel
        self.dtype = resolve_dtype(model_config.dtype)
        self.kv_dtype = resolve_kv_dtype(cache_config.kv_cache_dtype, self.dtype)
        _start_kernel_builds(self.dtype, self.kv_dtype, model_config.attention_backend, model_config.quantization,
                             model_config.quantize_lm_head)
        model_dir = resolve_model_dir(model_config.model)
        arch, max_model_len = resolve_arch(model_dir, model_config, spec_config)
        model, quantization = _load_model(arch, model_dir, self.dtype, parallel, model_config)
        model.eval()
        _suggest_four_bits(model_dir, quantization, self.dtype)
        num_blocks = kv_cache_blocks(cache_config, arch, self.kv_dtype, max_model_len)
        backend = get_backend(model_config.attention_backend)
        # Model-based proposers keep their own cache with as many blocks as the target's (their layers only).
        proposer = make_proposer(spec_config, model, backend=backend, block_size=cache_config.block_size,
                                 num_blocks=num_blocks, dtype=self.dtype, seed=model_config.seed)
        self.runner = ModelRunner(model, backend, cache_config.block_size, proposer, model_config.seed,
                                  arch.vocab_size, model_dir, spec_config.disable_by_batch_size,
                                  model_config.tokenizer_dir(model_dir), model_config.logits_processors,
                                  model_config.max_cpu_loras, model_config.lora_target_modules)
        self.runner.bind_kv_cache(num_blocks, self.kv_dtype)
        store_dir = self._bind_kv_store(kv_transfer, model_dir, arch, cache_config)
        self.prefaulter = KVPrefaulter(self.runner.kv_caches) \
            if cache_config.kv_cache_prefault and self.runner.kv_caches else None  # none: an encoder-only model
        self.asleep = False  # sleep mode (``set_asleep``)
        self.weights_from: str | None = None  # the checkpoint last loaded (None: the served model's); sleep level 2
        self.model_config, self.spec_config, self.arch = model_config, spec_config, arch  # update_weights
        self.profiler_config = profiler_config
        self.profiler = Profiler(profiler_config.profiler_dir, profiler_config.profiler_with_stack) \
            if profiler_config.profiler_dir else None
        if self.dtype == torch.bfloat16:  # build/load the native layer kernels now, not during the first request
            flash_amx = isinstance(backend, cpu_paged.CpuPagedBackend) and cpu_paged.load_kernel().use_amx()
            logger.info("native kernels: packed GEMM %s%s, fused element-wise %s, decoder stack %s, flash tiles %s",
                        f"on ({gemm.path()})" if gemm.available() else "off",
                        f" with {quantization} decoder layers" if quantization else "",
                        "on" if fused.available() else "off",
                        "on" if decoder_stack.available() and envs.native_decoder() else "off",
                        "on AMX" if flash_amx else "without AMX")
        self.runtime = RuntimeInfo(max_model_len, num_blocks, cache_config.block_size, arch.vocab_size,
                                   arch.hidden_size, _pooling_only(arch, model_config), store_dir,
                                   spec_config.method or "",
                                   kv_window(arch, store_dir), arch.labels,
                                   spec_config.num_speculative_tokens if spec_config.method else 0, arch.image_token_id,
                                   arch.bidirectional_images, arch.encoder is not None,
                                   getattr(self.runner.model, "image_row_width", arch.hidden_size))
        logger.info("loaded %s (%s, %s) in %.1fs; KV cache: %d blocks of %d tokens (%s)", model_dir,
                    arch.architecture, self.dtype, time.perf_counter() - start, num_blocks, cache_config.block_size,
                    str(self.kv_dtype).removeprefix("torch."))

    def _bind_kv_store(self, kv_transfer: KVTransferConfig, model_dir: Path, arch: ArchConfig,
                       cache_config: CacheConfig) -> str:
        """With a KV connector: the runner's store of this model's blocks; returns its folder ("" without one)."""
        if kv_transfer.kv_connector is None:
            return ""
        block_size = cache_config.block_size
        first = self.runner.kv_caches[0]
        folder = layout_dir(kv_transfer.kv_connector_extra_config["shared_storage_path"], model_dir, {
            "architecture": arch.architecture, "layers": len(self.runner.kv_caches), "block_size": block_size,
            "kv_shape": tuple(first.shape[2:]), "kv_dtype": str(first.dtype)})
        self.runner.kv_store = KVStore(folder, self.runner.kv_caches, kv_transfer.max_storage_bytes,
                                       make_hasher(cache_config.prefix_caching_hash_algo))
        self.runner.kv_saves = kv_transfer.saves
        logger.info("KV connector %s (%s): blocks in %s", kv_transfer.kv_connector, kv_transfer.kv_role, folder)
        return str(folder)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)

    def rpc(self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None) -> Any:
        """``LLM.collective_rpc`` on this worker: its method ``method`` (an extension's too), or ``method(self,
        *args, **kwargs)``."""
        if isinstance(method, str):
            target = getattr(self, method, None)
            if target is None or method.startswith("_") or not callable(target):
                raise ValueError(f"collective_rpc: the worker has no method {method!r} (add one with "
                                 "worker_extension_cls)")
            return target(*args, **(kwargs or {}))
        return method(self, *args, **(kwargs or {}))

    def set_idle(self, idle: bool) -> None:
        """Idle-time work (populating the KV cache's memory) runs in the background only while ``idle`` (and
        awake)."""
        if self.prefaulter is None or self.asleep:
            return
        if idle:
            self.prefaulter.resume()
        else:
            self.prefaulter.pause()

    def set_asleep(self, asleep: bool, level: int = 1) -> None:
        """Sleep mode: asleep, the KV cache's memory goes back to the OS (``kv_prefault.discard``: the pages come back
        zeroed on their next touch, so the engine must hold no KV worth keeping) and the idle-time population stops;
        at ``level`` 2 the model goes too (its weights' memory back to the OS). Awake, or asleep at level 1, dropped
        weights load again from the checkpoint last loaded (unless an update already loaded one); awake, the cache
        populates again when idle."""
        if asleep and level == 2 and self.runner.model is not None:
            self.runner.model = None
            release_freed_memory()
            logger.info("asleep at level 2: the weights are dropped")
        elif (not asleep or level == 1) and self.runner.model is None:
            self.update_weights(self.weights_from)
        if asleep == self.asleep:
            return
        self.asleep = asleep
        if asleep:
            if self.prefaulter is not None:
                self.prefaulter.close()
            for cache in self.runner.kv_caches:
                if not discard(cache.data_ptr(), cache.numel() * cache.element_size()):
                    raise RuntimeError("madvise(MADV_DONTNEED) failed: the KV cache's memory cannot be released")
        elif self.prefaulter is not None:
            self.prefaulter = KVPrefaulter(self.runner.kv_caches)  # every page anew

    def update_weights(self, model: str | None = None) -> None:
        """Serve the weights of ``model`` (a checkpoint of the same architecture and shapes; None: the served model's
        own, read again) from now on: loaded as at start-up into a new model, which takes over the KV caches; the
        engine resets the prefix cache, whose blocks the old weights computed."""
        model_dir, arch = self.weights_source(model)
        config = dataclasses.replace(self.model_config, load_format="auto")
        new, _ = _load_model(arch, model_dir, self.dtype, self.parallel, config)
        new.eval()
        for attn, cache in zip(new.attention_layers(), self.runner.kv_caches):
            attn.kv_cache = cache
        native_attention(new, self.runner.backend.name)
        self.runner.model, self.weights_from = new, model
        logger.info("weights updated from %s", model_dir)

    def weights_source(self, model: str | None) -> tuple[Path, ArchConfig]:
        """``update_weights``' checks (ValueError), made on rank 0 before any rank loads: the checkpoint's folder
        and its architecture, which must be the served model's."""
        if self.spec_config.method is not None:
            raise ValueError("update_weights runs without speculative decoding (a proposer holds the old weights)")
        model_dir = resolve_model_dir(model or self.model_config.model)
        arch, _ = resolve_arch(model_dir, self.model_config, self.spec_config)
        if arch != self.arch:
            raise ValueError(f"{model_dir} is not a checkpoint of the served model's shapes ({self.arch.architecture},"
                             f" {self.arch.num_layers} layers of {self.arch.hidden_size}): update_weights swaps "
                             "weights, not models")
        return model_dir, arch

    def start_profile(self) -> bool:
        self.profiler_config.require()
        return self.profiler.start()  # type: ignore[union-attr]  # there is one whenever profiling is on

    def stop_profile(self) -> list[str]:
        self.profiler_config.require()
        return self.profiler.stop()  # type: ignore[union-attr]

    def shutdown(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()  # a session still recording leaves its trace rather than nothing
        if self.prefaulter is not None:
            self.prefaulter.close()


def _load_model(arch: ArchConfig, model_dir: Path, dtype: torch.dtype, parallel: ParallelState,
                model_config: ModelConfig) -> tuple[torch.nn.Module, str | None]:
    """The model with its weights loaded, and the weight format its decoder layers run: ``--quantization``'s, or the
    checkpoint's own (``_checkpoint_format``); where a weight-only checkpoint picked for a 4-bit kernel has a layer
    whose groups do not fit it after all (its config did not say so), its weights are dequantized instead."""
    quantization = model_config.quantization or _checkpoint_format(arch, model_dir, dtype)
    kernel = gemm.QUANTIZED.get(quantization) if quantization and not model_config.quantization else None
    if kernel is not None and kernel.runs_here():  # a quantized checkpoint's kernel, built while the weights load
        native_build.start_in_background([kernel.build_job()])
    while True:
        model = build_model(arch, dtype, parallel)
        if model_config.quantize_lm_head and hasattr(model, "lm_head"):
            model.lm_head.quantized = True
        if model_config.load_format == "dummy":
            if arch.quantization is not None:
                raise ValueError(f"load_format dummy makes unquantized weights; {model_dir}'s config.json describes "
                                 f"a {arch.quantization} checkpoint (drop its quantization_config, and pass "
                                 "--quantization to time a quantized run)")
            model.load_dummy_weights(model_config.quantization, model_config.seed)
            return model, model_config.quantization
        try:
            model.load_weights(iter_weights(model_dir, groups=_takes_groups(arch, quantization), dtype=dtype,
                                            transient=True), quantization)
            return model, quantization
        except weight_only.GroupsDoNotFit as exc:
            if model_config.quantization or quantization is None:
                raise
            logger.info("%s: this checkpoint's weights are dequantized instead of kept in %s", exc, quantization)
            quantization = None


def _takes_groups(arch: ArchConfig, quantization: str | None) -> bool:
    """Whether the weights load as 4-bit integers and groups: under a 4-bit format, but an MXFP4 checkpoint's only
    under its own (under another, its exact values load and are quantized as a float checkpoint's are)."""
    return quantization in gemm.FOUR_BIT and (arch.quantization != mxfp4.SCHEME or quantization == gemm_mxfp4.FORMAT)


def _checkpoint_format(arch: ArchConfig, model_dir: Path, dtype: torch.dtype) -> str | None:
    """The kernel a quantized checkpoint runs on without --quantization: a W8A8 one's int8 weights; a weight-only
    one's 4-bit weights with bfloat16 activations (w4a16_int4, its own scheme) where that kernel runs and its groups
    fit it, an MXFP4 one's (gpt-oss's experts) likewise on its MXFP4 GEMM, else ``None`` (dequantized)."""
    if arch.quantization == weight_only.SCHEME:
        fits = weight_only.four_bit_fits(load_hf_config(model_dir))
        return gemm_w4a16.FORMAT if fits and dtype == torch.bfloat16 and gemm_w4a16.runs_here() else None
    if arch.quantization == mxfp4.SCHEME:  # kept in 4 bits where the MXFP4 GEMM runs, else dequantized as it loads
        return gemm_mxfp4.FORMAT if dtype == torch.bfloat16 and gemm_mxfp4.runs_here() else None
    if arch.quantization == fp8_checkpoint.SCHEME:  # dequantized as it loads: the model's dtype's GEMMs
        return None
    return arch.quantization


def _suggest_four_bits(model_dir: Path, quantization: str | None, dtype: torch.dtype) -> None:
    """Say so where a 4-bit GGUF's or weight-only checkpoint's weights were dequantized and this machine could keep
    them in 4 bits."""
    hint = gguf_convert.four_bit_hint(model_dir) or weight_only.four_bit_hint(load_hf_config(model_dir))
    if hint and not quantization and dtype == torch.bfloat16 and gemm_w8a8.runs_here():
        logger.info(hint)


def _start_kernel_builds(dtype: torch.dtype, kv_dtype: torch.dtype, attention_backend: str,
                         quantization: str | None, int8_lm_head: bool = False) -> None:
    """Compile the native kernels this worker will load on background threads, the longest first (``native_build``):
    a cold start then builds them side by side, and beside the model's resolution (a GGUF conversion, or waiting for
    the frontend's) and the weights' loading, instead of one after another as each is first loaded."""
    sources = [cpu_paged.SOURCE] if attention_backend in ("auto", "cpu_paged") else []
    if sources and kv_dtype != dtype:  # a float8 cache: its entries' library
        sources.append(cpu_paged.FP8_SOURCE)
    if dtype == torch.bfloat16 and gemm.runs_here():
        sources += [decoder_stack.ATTENTION, gemm.SOURCE, fused.SOURCE]
        if envs.native_decoder():
            sources.append(decoder_stack.SOURCE)
    sources.append(sample_native.SOURCE)
    builds = [functools.partial(build_library, source) for source in dict.fromkeys(sources)]
    formats = [quantization] + ([gemm_w8a8.FORMAT] if int8_lm_head else [])
    if gemm_w8a8.runs_here():  # both quantized kernels' instructions
        for fmt in dict.fromkeys(f for f in formats if f in gemm.QUANTIZED):
            builds.insert(1, gemm.QUANTIZED[fmt].build_job())  # its own flags (no fused multiply-adds)
    native_build.start_in_background(builds)


def _pooling_only(arch: ArchConfig, model_config: ModelConfig) -> bool:
    """Whether the engine serves pooling requests only: the checkpoint's kind (an embedding model, a classifier), or
    ``runner="pooling"`` / ``convert="embed"`` asking so of a generative one."""
    if arch.pooling_only and model_config.runner == "generate":
        raise ValueError(f"{arch.architecture} has no language-model head: it serves pooling requests only; drop "
                         "runner=generate")
    return arch.pooling_only or model_config.runner == "pooling" or model_config.convert == "embed"


def resolve_arch(model_dir: Path, model_config: ModelConfig,
                 spec_config: SpeculativeConfig) -> tuple[ArchConfig, int]:
    """The model's architecture as this engine runs it (its config.json with ``hf_overrides`` over it, a
    vision-language model's without its vision side under ``language_model_only``; LongRoPE's
    set of factors chosen for its context length; full attention under ``disable_sliding_window``) and that context
    length; drafts as deep as a sliding window are refused."""
    hf_overrides = model_config.hf_overrides
    if hf_overrides:
        logger.info("config.json of %s with hf_overrides: %s", model_dir, hf_overrides)
    arch = ArchConfig.from_hf({**load_hf_config(model_dir), **(hf_overrides or {})})
    if model_config.language_model_only:  # its decoder alone: no vision side, no image token
        arch = dataclasses.replace(arch, vision=None)
    if arch.encoder is not None:  # an encoder-only model: how it pools, where a pair's second text begins
        arch = dataclasses.replace(arch, encoder={**arch.encoder, **encoder_settings(
            model_dir, model_config.tokenizer_dir(model_dir), arch.encoder, model_config.pooler_config)})
    elif model_config.pooler_config and pooling_type(model_dir, model_config.pooler_config, "LAST") != "LAST":
        raise ValueError("a decoder pools its prompt's last token (its prompt may span steps); pooler_config's other "
                         "pooling types are for encoder-only models (BERT, RoBERTa, XLM-RoBERTa)")
    max_model_len = resolve_max_model_len(model_config.max_model_len, arch)
    if model_config.disable_sliding_window and arch.sliding_window:
        arch, max_model_len = without_window(arch, model_config.max_model_len, max_model_len)
    arch = dataclasses.replace(arch, rope_scaling=use_long_factors(arch.rope_scaling, max_model_len))
    if arch.sliding_window and spec_config.method and spec_config.num_speculative_tokens >= arch.sliding_window:
        # a draft tree's nodes attend to their ancestors by ancestry, which a window this short would cut
        raise ValueError(f"num_speculative_tokens={spec_config.num_speculative_tokens} must be below the model's "
                         f"sliding window ({arch.sliding_window})")
    return arch, max_model_len


def without_window(arch: ArchConfig, requested: int | None, max_model_len: int) -> tuple[ArchConfig, int]:
    """``disable_sliding_window`` (vLLM's): every layer attends to every key, and the context is capped to the window,
    inside which the two are the same attention."""
    window = arch.sliding_window
    assert window is not None
    if requested is not None and requested > window:
        raise ValueError(f"max_model_len={requested} exceeds the sliding window ({window}) that "
                         "disable_sliding_window caps the context to; lower it, or keep the window")
    logger.info("sliding window off: full attention over at most %d tokens", min(max_model_len, window))
    return dataclasses.replace(arch, sliding_window=None, full_attention_layers=()), min(max_model_len, window)


def kv_window(arch: ArchConfig, store_dir: str) -> int:
    """The window behind which a request's blocks may be released: the model's, where every layer slides and no
    KV connector stores whole prompts (0: keep every block)."""
    every_layer = arch.sliding_window and not set(arch.full_attention_layers) & set(range(arch.num_layers))
    return int(arch.sliding_window) if every_layer and not store_dir else 0


def resolve_max_model_len(requested: int | None, arch: ArchConfig) -> int:
    limit = arch.context_length
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's context length {limit}; lower it")
    return requested


def kv_cache_blocks(cache: CacheConfig, arch: ArchConfig, dtype: torch.dtype, max_model_len: int) -> int:
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    block_bytes = cache.block_size * arch.kv_bytes_per_token(dtype_bytes)
    num_blocks = cache.num_gpu_blocks_override or cache.kv_cache_memory // block_bytes
    needed = -(-max_model_len // cache.block_size)
    if num_blocks < needed and cache.num_gpu_blocks_override:
        raise ValueError(f"num_gpu_blocks_override={num_blocks} blocks ({num_blocks * cache.block_size} tokens) "
                         f"cannot hold one max_model_len={max_model_len} request ({needed} blocks): give at least "
                         f"{needed} or lower max_model_len")
    if num_blocks < needed:
        raise ValueError(
            f"kv_cache_memory={cache.kv_cache_memory} bytes holds {num_blocks} blocks ({num_blocks * cache.block_size}"
            f" tokens), fewer than one max_model_len={max_model_len} request needs ({needed} blocks): raise "
            f"kv_cache_memory to at least {needed * block_bytes} or lower max_model_len")
    return num_blocks
