"""Model loading: the conversion cache, safetensors reading, bad paths, dtype names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_gguf import random_model, tiny_config, write_tiny_gguf
from tokenizers import Tokenizer as BackendTokenizer

from pagellm.model import gguf_convert, loader
from pagellm.model.loader import (
    iter_weights,
    load_hf_config,
    resolve_dtype,
    resolve_model_dir,
)

# ---------------------------------------------------------------------------------------------- cache


@pytest.fixture
def tiny_gguf(tmp_path: Path, tiny_tokenizer: BackendTokenizer, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    model = random_model(tiny_config("llama", tiny_tokenizer.get_vocab_size(), True))
    write_tiny_gguf(tmp_path / "tiny.gguf", model, tiny_tokenizer, "llama")
    return tmp_path / "tiny.gguf"


def count_conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = gguf_convert.convert_gguf_to_hf

    def counting(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        real(gguf_path, out_dir)

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", counting)
    return calls


def test_conversion_is_cached(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = count_conversions(monkeypatch)
    first = resolve_model_dir(str(tiny_gguf))
    assert first.parent == tmp_path / "cache" / "converted" and first.name.startswith("tiny-")
    assert resolve_model_dir(str(tiny_gguf)) == first
    assert len(calls) == 1
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no staging left behind

    stat = tiny_gguf.stat()  # a rewritten file (new mtime) is converted again, into a new directory
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = resolve_model_dir(str(tiny_gguf))
    assert second != first and len(calls) == 2


def test_a_conversion_removes_the_ones_it_makes_stale(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """A rewritten file's, or an older converter's, conversion of the same path is deleted when the new one is made;
    another file of the same name elsewhere keeps its own."""
    import shutil

    elsewhere = tmp_path / "elsewhere" / tiny_gguf.name
    elsewhere.parent.mkdir()
    shutil.copy2(tiny_gguf, elsewhere)
    other = resolve_model_dir(str(elsewhere))
    first = resolve_model_dir(str(tiny_gguf))
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = resolve_model_dir(str(tiny_gguf))
    assert not first.exists() and (second / "config.json").is_file() and (other / "config.json").is_file()
    monkeypatch.setattr(gguf_convert, "CONVERTER_VERSION", gguf_convert.CONVERTER_VERSION + 1)
    third = resolve_model_dir(str(tiny_gguf))
    assert third != second and not second.exists() and sorted(third.parent.iterdir()) == sorted([third, other])


def test_resolving_a_converted_gguf_imports_no_torch(tiny_gguf: Path, tmp_path: Path) -> None:
    """The server's frontend resolves the model while the engine core loads it: a cached conversion is found without
    torch (about 0.9 s of CPU on this machine's two cores, taken from the load beside it)."""
    import subprocess
    import sys

    env = {**os.environ, "PAGELLM_CACHE_DIR": str(tmp_path / "cache")}
    code = ("import sys; from pagellm.model.loader import resolve_model_dir; "
            f"print(resolve_model_dir({str(tiny_gguf)!r}).is_dir(), "
            "sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert first.stdout.split()[0] == "True" and again.stdout.strip() == "True []"


def test_concurrent_resolves_convert_once(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The server's frontend and engine core resolve the model at the same time on a cold start: the second waits
    # for the first's conversion (a lock file) instead of converting too.
    import threading
    import time

    calls: list[Path] = []
    real = gguf_convert.convert_gguf_to_hf

    def slow(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        time.sleep(0.5)  # long enough that the other caller arrives while this one converts
        real(gguf_path, out_dir)

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", slow)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model_dir(str(tiny_gguf)))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]
    assert (results[0] / "config.json").is_file()


def test_a_killed_conversions_staging_is_removed(tiny_gguf: Path, tmp_path: Path) -> None:
    # A process killed mid-conversion leaves its staging directory; the next conversion (holding the lock, so no
    # other is under way) removes it.
    target = loader._cache_dir_for(tiny_gguf.resolve(), gguf_convert.CONVERTER_VERSION)
    stale = target.parent / f".tmp-{target.name}-killed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    assert resolve_model_dir(str(tiny_gguf)) == target
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_failed_conversion_leaves_no_cache(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def crashing(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_convert, "convert_gguf_to_hf", crashing)
        with pytest.raises(RuntimeError, match="disk full"):
            resolve_model_dir(str(tiny_gguf))
    assert list((tmp_path / "cache" / "converted").iterdir()) == []
    calls = count_conversions(monkeypatch)
    assert load_hf_config(resolve_model_dir(str(tiny_gguf)))["model_type"] == "llama"
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------- safetensors


def test_sharded_safetensors(tmp_path: Path) -> None:
    model = random_model(tiny_config("llama", 320, False))
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    names = [name for name, _ in iter_weights(tmp_path)]
    assert len(names) == len(set(names))
    state = model.state_dict()
    assert sorted(names) == sorted(state)
    for name, tensor in iter_weights(tmp_path):
        assert torch.equal(tensor, state[name]), name
    assert resolve_model_dir(str(tmp_path)) == tmp_path


def test_unindexed_safetensors_are_globbed(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, str(tmp_path / "first.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "second.safetensors"))
    assert [name for name, _ in iter_weights(tmp_path)] == ["a", "b"]


def test_no_weights_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        list(iter_weights(tmp_path))


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_model_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"does not exist.*config\.json.*\.gguf.*no hub access"):
        resolve_model_dir(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="without config.json"):
        resolve_model_dir(str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="pass the file itself"):
        resolve_model_dir(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a .gguf file"):
        resolve_model_dir(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_config(tmp_path)


def test_resolve_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype("float32") is resolve_dtype("fp32") is resolve_dtype("float") is torch.float32
    assert resolve_dtype("bfloat16") is resolve_dtype(" BF16 ") is torch.bfloat16
    monkeypatch.setattr(loader, "_cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert resolve_dtype("auto") is torch.bfloat16
    monkeypatch.setattr(loader, "_cpu_flags", lambda: frozenset({"avx2"}))
    assert resolve_dtype("auto") is torch.float32
    with pytest.raises(ValueError, match="use one of: auto, float32.*bfloat16"):
        resolve_dtype("float16")
