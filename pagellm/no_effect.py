"""vLLM engine arguments that have nothing to do in pagellm (GPU memory, graph capture, the model hub, remote code):
``LLM(...)`` (through ``EngineConfig.from_kwargs``) and ``pagellm serve`` take them, so a ported script or command
line runs, and each one given is logged with what it would have done and what to use instead. The server's own
flags of that kind (``--disable-log-requests``, ...) are ``server/vllm_cli.py``'s."""

from __future__ import annotations

import argparse
import logging
from typing import Any

logger = logging.getLogger(__name__)

NO_HUB = "pagellm loads local model directories and .gguf files only (no model hub)"
NO_GRAPHS = "pagellm captures no graphs on the CPU"
NO_GPU_COMMS = "dual-batch overlap and all-to-all backends hide GPU communication; tensor-parallel CPU ranks " \
    "reduce over shared memory"
NO_EPLB = "expert-parallel load balancing moves experts between GPUs; pagellm's experts stay on their rank"
NO_GPU_TRACE = "Nsight and NVTX trace GPUs; --profiler-dir records the workers' ops with the torch profiler"
NO_MM_CACHE = "pagellm keeps no cache of processed images: each request's images go through the processor, and the " \
    "images the prefix cache already holds are not encoded again"

# engine argument → why it does nothing here
ENGINE: dict[str, str] = {
    "gpu_memory_utilization": "pagellm serves from CPU memory: kv_cache_memory (--kv-cache-memory) sizes the KV cache",
    "swap_space": "the KV cache lives in CPU memory already (kv_cache_memory, --kv-cache-memory)",
    "enforce_eager": "pagellm captures no graphs on the CPU",
    "trust_remote_code": "pagellm runs its own model code only; nothing from the model directory is executed",
    "max_loras": "every step mixes any number of adapters (no per-step adapter slots on the CPU); max_cpu_loras "
                 "(--max-cpu-loras) bounds the adapters kept loaded",
    "max_seq_len_to_capture": "pagellm captures no graphs on the CPU",
    "disable_custom_all_reduce": "tensor-parallel ranks reduce over shared memory and gloo; there is no custom "
                                 "all-reduce to turn off",
    "disable_cascade_attn": "pagellm has no cascade attention",
    "max_parallel_loading_workers": "weights load layer by layer in one pass",
    "download_dir": NO_HUB,
    "cpu_offload_gb": "the weights live in CPU memory already",
    "compilation_config": "pagellm captures no graphs and compiles no model code; its native kernels are built at "
                          "start",
    "revision": "pagellm loads local directories and .gguf files, which have no hub revision",
    "tokenizer_revision": "pagellm loads local tokenizers, which have no hub revision",
    "code_revision": "pagellm runs no model code from the model directory",
    "async_scheduling": "the engine core's scheduler step takes tens of microseconds beside a forward pass of "
                        "milliseconds, and outputs are detokenized in the frontend's own process: there is no gap "
                        "between steps to overlap",
    "hf_token": NO_HUB,
    # vLLM 0.32's GPU knobs a ported command line carries
    "cudagraph_capture_sizes": NO_GRAPHS,
    "max_cudagraph_capture_size": NO_GRAPHS,
    "cudagraph_metrics": NO_GRAPHS,
    "optimization_level": "pagellm compiles no model code; its native kernels are built at start",
    "performance_mode": "pagellm's steps are sized by --max-num-batched-tokens (2,048 tokens served, 4,096 offline)",
    "attention_config": "pagellm picks its attention kernel itself, by the CPU's instruction set",
    "kernel_config": "pagellm's kernels are its own, picked by the CPU's instruction set",
    "enable_flashinfer_autotune": "pagellm's kernels are its own, not FlashInfer's",
    "enable_cumem_allocator": "there is no CUDA memory to pool; --enable-sleep-mode gives the KV cache's memory back",
    "all2all_backend": NO_GPU_COMMS,
    "enable_dbo": NO_GPU_COMMS,
    "ubatch_size": NO_GPU_COMMS,
    "dbo_decode_token_threshold": NO_GPU_COMMS,
    "dbo_prefill_token_threshold": NO_GPU_COMMS,
    "disable_nccl_for_dp_synchronization": "data-parallel engine cores are coordinated by the front end, without NCCL",
    "enable_eplb": NO_EPLB,
    "eplb_config": NO_EPLB,
    "disable_hybrid_kv_cache_manager": "pagellm keeps one KV cache group for every layer",
    "ray_workers_use_nsight": NO_GPU_TRACE,
    "enable_layerwise_nvtx_tracing": NO_GPU_TRACE,
    "enable_mfu_metrics": "pagellm exports no model-FLOPs-utilisation series; bench serve reports the server's CPU use",
    "use_tqdm_on_load": "weights load layer by layer, with one log line",
    "safetensors_load_strategy": "safetensors files are memory-mapped and read layer by layer",
    "pt_load_map_location": "weights load onto the CPU",
    # vLLM 0.32's multimodal knobs with nothing to tune here
    "mm_processor_cache_gb": NO_MM_CACHE,
    "mm_processor_cache_type": NO_MM_CACHE,
    "mm_shm_cache_max_object_size_mb": "images travel to the engine core inside their requests (no shared-memory "
                                       "cache)",
    "skip_mm_profiling": "pagellm profiles no encoder memory at start: --kv-cache-memory sizes the KV cache",
    "mm_encoder_tp_mode": "each tensor-parallel rank runs the whole vision encoder on the step's images",
    "mm_encoder_attn_backend": "the vision encoder attends through the backend --attention-backend picks",
}

_SWITCH: dict[str, Any] = {"action": "store_true"}
_TOGGLE: dict[str, Any] = {"action": argparse.BooleanOptionalAction}  # --x and --no-x, as vLLM's switches
# ENGINE's names as vLLM's flags: name → argparse kwargs
FLAGS: dict[str, dict[str, Any]] = {
    "gpu_memory_utilization": {"type": float}, "swap_space": {"type": float}, "enforce_eager": _SWITCH,
    "trust_remote_code": _SWITCH, "max_loras": {"type": int}, "max_seq_len_to_capture": {"type": int},
    "disable_custom_all_reduce": _SWITCH, "disable_cascade_attn": _SWITCH,
    "max_parallel_loading_workers": {"type": int}, "download_dir": {}, "cpu_offload_gb": {"type": float},
    "compilation_config": {}, "revision": {}, "tokenizer_revision": {}, "code_revision": {},
    "async_scheduling": _TOGGLE, "hf_token": {"nargs": "?", "const": True},
    "cudagraph_capture_sizes": {"type": int, "nargs": "+"}, "max_cudagraph_capture_size": {"type": int},
    "cudagraph_metrics": _TOGGLE, "optimization_level": {"type": int}, "performance_mode": {},
    "attention_config": {}, "kernel_config": {}, "enable_flashinfer_autotune": _TOGGLE,
    "enable_cumem_allocator": _TOGGLE, "all2all_backend": {}, "enable_dbo": _TOGGLE, "ubatch_size": {"type": int},
    "dbo_decode_token_threshold": {"type": int}, "dbo_prefill_token_threshold": {"type": int},
    "disable_nccl_for_dp_synchronization": _TOGGLE, "enable_eplb": _TOGGLE, "eplb_config": {},
    "disable_hybrid_kv_cache_manager": _TOGGLE, "ray_workers_use_nsight": _TOGGLE,
    "enable_layerwise_nvtx_tracing": _TOGGLE, "enable_mfu_metrics": _TOGGLE, "use_tqdm_on_load": _TOGGLE,
    "safetensors_load_strategy": {}, "pt_load_map_location": {},
    "mm_processor_cache_gb": {"type": float}, "mm_processor_cache_type": {},
    "mm_shm_cache_max_object_size_mb": {"type": int}, "skip_mm_profiling": _TOGGLE, "mm_encoder_tp_mode": {},
    "mm_encoder_attn_backend": {},
}


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, why: dict[str, str],
              kinds: dict[str, dict[str, Any]] = FLAGS) -> None:
    """The flags of ``why``'s names (``--gpu-memory-utilization``, ...), each helped by why it does nothing, parsed to
    None when not given; ``kinds`` holds their argparse kwargs (a switch when absent)."""
    for name, reason in why.items():
        parser.add_argument("--" + name.replace("_", "-"), default=None, help=f"ignored: {reason}",
                            **kinds.get(name, _SWITCH))


def drop_engine_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without ``ENGINE``'s names, logging each one that was given a value."""
    for name in ENGINE.keys() & kwargs.keys():
        if kwargs[name] not in (None, False):  # a switch left off, or no value, is not worth a log line
            logger.warning("%s has no effect in pagellm: %s", name, ENGINE[name])
    return {key: value for key, value in kwargs.items() if key not in ENGINE}
