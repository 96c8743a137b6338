"""Every environment variable pagellm reads, typed, read in one place.

Values are read when accessed (not at import), so tests can set them with ``monkeypatch``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted weights (GGUF → safetensors) are kept: ``PAGELLM_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/pagellm``, else ``~/.cache/pagellm``."""
    explicit = os.environ.get("PAGELLM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagellm"


def num_threads() -> int | None:
    """``PAGELLM_NUM_THREADS``: torch intra-op threads; ``None`` leaves torch's default."""
    value = os.environ.get("PAGELLM_NUM_THREADS")
    return int(value) if value else None


def native_decoder() -> bool:
    """``PAGELLM_NATIVE_DECODER``: ``0`` keeps bfloat16 models on the Python decoder layers instead of the one-call
    native stack (``pagellm/model/native_stack.py``); default on."""
    return os.environ.get("PAGELLM_NATIVE_DECODER", "1") != "0"


def dp_prefix_affinity() -> bool:
    """``PAGELLM_DP_PREFIX_AFFINITY``: ``0`` routes data-parallel requests by load alone, not toward the core that
    was given their prompt's leading blocks (``pagellm/engine/dp_client.py``); default on. For A/B runs."""
    return os.environ.get("PAGELLM_DP_PREFIX_AFFINITY", "1") != "0"


def tp_shm_comm() -> bool:
    """``PAGELLM_TP_SHM_COMM``: ``0`` sends the tensor-parallel ranks' all-reduces and all-gathers through gloo (its
    loopback TCP) instead of shared memory (``pagellm/distributed/shm_comm.py``); default on."""
    return os.environ.get("PAGELLM_TP_SHM_COMM", "1") != "0"


def gemm_amx() -> bool:
    """``PAGELLM_GEMM_AMX``: ``0`` keeps the packed GEMMs on their vector paths on CPUs with AMX instead of AMX tiles:
    the bfloat16 one on AVX-512 BF16 (``pagellm/ops/gemm.py``), the W8A8 int8 one on VNNI (``gemm_w8a8.py``); default
    on."""
    return os.environ.get("PAGELLM_GEMM_AMX", "1") != "0"


def attention_amx() -> bool:
    """``PAGELLM_ATTENTION_AMX``: ``0`` keeps the bfloat16 flash tiles of prompt attention on AVX-512 BF16 on CPUs
    with AMX instead of AMX tiles (``pagellm/attention/cpu_paged.py``); default on."""
    return os.environ.get("PAGELLM_ATTENTION_AMX", "1") != "0"


def kv_huge_pages() -> bool:
    """``PAGELLM_KV_HUGE_PAGES``: ``1`` advises the KV cache's pages as transparent huge pages
    (``pagellm/attention/base.py``); default off: 4 KiB pages, whose first touch costs far less on VMs whose host
    takes back the guest's free 2 MiB blocks (docs/performance.md, Round 38)."""
    return os.environ.get("PAGELLM_KV_HUGE_PAGES", "0") == "1"


def native_scheduler() -> bool:
    """``PAGELLM_NATIVE_SCHEDULER``: ``0`` keeps the scheduler on its numpy and Python paths instead of the native
    fast path (``pagellm/sched/native.py``); default on."""
    return os.environ.get("PAGELLM_NATIVE_SCHEDULER", "1") != "0"


def log_level() -> str:
    """``PAGELLM_LOG_LEVEL``: the level of pagellm's loggers (default INFO)."""
    return os.environ.get("PAGELLM_LOG_LEVEL", "INFO").upper()


def api_key() -> str | None:
    """``PAGELLM_API_KEY``: the key ``pagellm serve`` requires as a Bearer token (``--api-key`` wins)."""
    return os.environ.get("PAGELLM_API_KEY") or None


def server_dev_mode() -> bool:
    """``PAGELLM_SERVER_DEV_MODE`` (or vLLM's ``VLLM_SERVER_DEV_MODE``): ``1`` adds the server's development routes
    (``server/openai/dev_routes.py``: ``POST /collective_rpc`` runs worker methods by name; not for untrusted
    clients)."""
    return "1" in (os.environ.get("PAGELLM_SERVER_DEV_MODE"), os.environ.get("VLLM_SERVER_DEV_MODE"))
