"""gpt-oss's GGUF files (llama.cpp's ``gpt-oss`` architecture), written here as llama.cpp's converter writes them from
an MXFP4 checkpoint (each expert block's exponent then its codes in GGML's nibble order, gate and up apart): they
convert back to the checkpoint bit for bit, serve what transformers computes from its float twin, and in bfloat16
keep their experts in 4 bits; a file whose experts are float16 serves the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagellm import LLM, SamplingParams
from pagellm.model.arch import ArchConfig
from pagellm.model.gguf_convert import convert_gguf_to_hf
from pagellm.ops import gemm, gemm_mxfp4

from test_gpt_oss import GPT_OSS_20B, _mxfp4_twins, assert_serves_its_float_twin
from test_parity import _prompts, assert_greedy_parity, run

# gpt-oss's special tokens (its tokenizer's, a few of them) and its pre-tokenizer's split (o200k's, as gpt-oss's
# tokenizer.json and tiktoken write it; llama.cpp's "gpt-4o")
HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
           "<|endoftext|>"]
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "I'M SURE they'll say 12345 and 678\n\nthen stop",
          "def add(a, b):\n    return a + b\n", "<|start|>user<|message|>hi<|end|>"] * 4


def _tokenizer() -> PreTrainedTokenizerFast:
    """A trained byte-level BPE split as gpt-oss's is, with harmony's markers as special tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(O200K), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=HARMONY, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|return|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=HARMONY)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def twins(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny gpt-oss MXFP4 checkpoint with gpt-oss's clamp (llama.cpp fixes it at 7) and tokenizer, and its float
    twin."""
    base = tmp_path_factory.mktemp("oss-base")
    shutil.copytree(tiny_model_factory("gpt_oss", swiglu_limit=7.0), base, dirs_exist_ok=True)
    _tokenizer().save_pretrained(base)
    return _mxfp4_twins(base, tmp_path_factory.mktemp("oss-twins"))


def write_gguf(path: Path, packed: Path, dense: Path, experts: str = "MXFP4", matrices: str = "F32") -> Path:
    """The GGUF llama.cpp's converter writes from ``packed`` (its experts as they are, every other matrix in
    ``matrices``), or with ``experts`` F16 from the float twin (a checkpoint in float)."""
    cfg = json.loads((packed / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    _add_metadata(writer, cfg)
    _add_tokenizer(writer, AutoTokenizer.from_pretrained(packed), cfg["vocab_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg["num_hidden_layers"])
    source = load_file(str((packed if experts == "MXFP4" else dense) / "model.safetensors"))
    for name, tensor in source.items():
        module, _, suffix = name.rpartition(".")
        if ".mlp.experts." in name:
            for gguf_name, values, kind in _experts(name, tensor, experts, source):
                writer.add_tensor(gguf_name, values, raw_dtype=kind)
        elif name.endswith(".sinks"):
            writer.add_tensor(names.get_name(name) + ".weight", tensor.numpy())
        else:
            values = tensor.numpy()
            if values.ndim == 2 and matrices != "F32" and ".router." not in name:  # (llama.cpp's router: F32)
                kind = gguf.GGMLQuantizationType[matrices]
                writer.add_tensor(f"{names.get_name(module)}.{suffix}", gguf.quants.quantize(values, kind),
                                  raw_dtype=kind)
            else:
                writer.add_tensor(f"{names.get_name(module)}.{suffix}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_metadata(writer: gguf.GGUFWriter, cfg: dict) -> None:
    rope = cfg["rope_parameters"]
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_expert_feed_forward_length(cfg["intermediate_size"])


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> None:
    """As llama.cpp's converter writes a byte-level BPE: ids past the tokenizer's as [PADn] (unused), its special
    tokens as control ones."""
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in HARMONY else 5 if i not in by_id else 1 for i, t in enumerate(tokens)])
    writer.add_token_merges([" ".join(m) if not isinstance(m, str) else m
                             for m in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]])
    writer.add_eos_token_id(tokenizer.convert_tokens_to_ids("<|return|>"))
    writer.add_pad_token_id(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    writer.add_chat_template(TEMPLATE)


def _experts(name: str, tensor: torch.Tensor, kind: str,
             source: dict[str, torch.Tensor]) -> list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]:
    """One checkpoint tensor of a layer's experts as llama.cpp's (an MXFP4 one's blocks with their exponents from
    ``source``): gate and up apart (the even and odd outputs)."""
    layer, part = name.split(".")[2], name.rpartition(".mlp.experts.")[2]
    blk = f"blk.{layer}"
    f32 = gguf.GGMLQuantizationType.F32
    if part.endswith("_bias"):
        if part == "down_proj_bias":
            return [(f"{blk}.ffn_down_exps.bias", tensor.numpy(), f32)]
        return [(f"{blk}.ffn_gate_exps.bias", tensor[:, 0::2].numpy(), f32),
                (f"{blk}.ffn_up_exps.bias", tensor[:, 1::2].numpy(), f32)]
    if part.endswith("_scales"):
        return []  # written with their blocks
    if kind == "F16":  # the float layout [experts, in, out] → llama.cpp's [experts, out, in]
        rows = tensor.transpose(1, 2).numpy().astype(np.float16)
        f16 = gguf.GGMLQuantizationType.F16
        if part == "down_proj":
            return [(f"{blk}.ffn_down_exps.weight", rows, f16)]
        return [(f"{blk}.ffn_gate_exps.weight", rows[:, 0::2], f16), (f"{blk}.ffn_up_exps.weight", rows[:, 1::2], f16)]
    scales = source[name.replace("_blocks", "_scales")]
    mx = gguf.GGMLQuantizationType.MXFP4
    if part == "down_proj_blocks":
        return [(f"{blk}.ffn_down_exps.weight", _ggml_mxfp4(tensor, scales), mx)]
    return [(f"{blk}.ffn_gate_exps.weight", _ggml_mxfp4(tensor[:, 0::2], scales[:, 0::2]), mx),
            (f"{blk}.ffn_up_exps.weight", _ggml_mxfp4(tensor[:, 1::2], scales[:, 1::2]), mx)]


def _ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """The checkpoint's blocks (neighbours paired in a byte, the low nibble first) as GGML's rows: each block's
    exponent, then byte j holding value j low and value j + 16 high."""
    values = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., n, 32] codes in order
    ggml = values[..., :16] | (values[..., 16:] << 4)
    rows = torch.cat([scales.unsqueeze(-1), ggml], dim=-1)
    return rows.flatten(-2).numpy()


def test_the_files_experts_are_the_checkpoints_values(twins: tuple[Path, Path], tmp_path: Path) -> None:
    """The file written here holds the float twin's values as gguf's own MXFP4 reader reads them (so its layout is
    llama.cpp's, whatever pagellm makes of it)."""
    packed, dense = twins
    reader = gguf.GGUFReader(str(write_gguf(tmp_path / "oss.gguf", packed, dense)))
    theirs = load_file(str(dense / "model.safetensors"))
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.1.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.MXFP4
    up = gguf.quants.dequantize(tensors["blk.1.ffn_up_exps.weight"].data, gguf.GGMLQuantizationType.MXFP4)
    down = gguf.quants.dequantize(tensors["blk.0.ffn_down_exps.weight"].data, gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(up, theirs["model.layers.1.mlp.experts.gate_up_proj"][..., 1::2].transpose(1, 2).numpy())
    assert np.array_equal(down, theirs["model.layers.0.mlp.experts.down_proj"].transpose(1, 2).numpy())


def test_an_mxfp4_gguf_converts_back_to_its_checkpoint(twins: tuple[Path, Path], tmp_path: Path) -> None:
    packed, dense = twins
    out = tmp_path / "converted"
    convert_gguf_to_hf(write_gguf(tmp_path / "oss.gguf", packed, dense), out)
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(packed / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]) for name in theirs)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == GPT_OSS_20B["quantization_config"]
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    arch = ArchConfig.from_hf(config)
    assert [arch.layer_window(i) for i in range(2)] == [16, None] and arch.attention_sinks and arch.o_proj_bias
    assert arch.moe is not None and (arch.moe.num_experts, arch.moe.top_k, arch.moe.swiglu_limit) == (4, 2, 7.0)
    tokenizer = AutoTokenizer.from_pretrained(packed)
    stops = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert stops == tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>", "<|endoftext|>"])  # not <|end|>
    converted = AutoTokenizer.from_pretrained(out)
    for text in CORPUS[:4] + ["Digits 1234567 split in threes; WE'RE here\r\n\n  ok"]:
        assert converted.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    markers = tokenizer.convert_tokens_to_ids(HARMONY)
    assert converted.encode("".join(HARMONY), add_special_tokens=False) == markers  # each marker one token
    assert converted.chat_template == TEMPLATE


def test_an_mxfp4_gguf_serves_what_transformers_computes(twins: tuple[Path, Path], tmp_path: Path) -> None:
    packed, dense = twins
    assert_serves_its_float_twin(write_gguf(tmp_path / "oss.gguf", packed, dense), dense, seed=7)


@pytest.mark.skipif(not gemm_mxfp4.runs_here(), reason="the MXFP4 GEMM needs AVX-512 BF16 and VNNI")
@pytest.mark.parametrize("matrices", ["BF16", "Q4_0"])
def test_in_bfloat16_a_ggufs_experts_stay_in_4_bits(twins: tuple[Path, Path], tmp_path: Path, matrices: str) -> None:
    """A file as llama.cpp's converter writes it in bfloat16 (its matrices BF16, kept as the file's blocks), or one
    whose other matrices llama-quantize made Q4_0, served in bfloat16: the experts on the MXFP4 GEMM with the
    checkpoint's values exactly, attention bfloat16 (a Q4_0 one dequantized: only the experts come as groups)."""
    packed, dense = twins
    llm = LLM(str(write_gguf(tmp_path / "oss.gguf", packed, dense, matrices=matrices)), dtype="bfloat16")
    try:
        layer = llm.engine.core.executor.worker.runner.model.model.layers[0]
        expert = layer.mlp.experts[3]
        assert gemm.weight_format(expert.gate_up_proj.weight) == gemm.weight_format(expert.down_proj.weight) \
            == gemm_mxfp4.FORMAT
        assert gemm.weight_format(layer.self_attn.qkv_proj.weight) == "bf16"
        theirs = load_file(str(dense / "model.safetensors"))["model.layers.0.mlp.experts.down_proj"][3]
        assert torch.equal(gemm.plain(expert.down_proj.weight).float(), theirs.t())
        out = llm.generate([_prompts(seed=8)[-1]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_a_gguf_with_float_experts_serves_the_same(twins: tuple[Path, Path], tmp_path: Path) -> None:
    """Experts in float16 (a float checkpoint's file) come in transformers' float layout, without MXFP4's
    quantization_config, and serve the float twin's tokens."""
    packed, dense = twins
    gguf_path = write_gguf(tmp_path / "oss-f16.gguf", packed, dense, experts="F16")
    out = tmp_path / "converted"
    convert_gguf_to_hf(gguf_path, out)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(dense / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    llm = LLM(str(gguf_path), dtype="float32")
    try:
        prompts = _prompts(seed=10)
        assert_greedy_parity(dense, prompts, run(llm, prompts))
    finally:
        llm.shutdown()


def test_gpt_oss_layer_patterns_as_llama_cpp_reads_them() -> None:
    """Where a file stores no pattern, llama.cpp's rule for gpt-oss: every other layer slides, the first one; a stored
    period or per-layer flags win; the quantization config only where every expert is MXFP4."""
    from pagellm.model.gguf_families import gpt_oss_config

    meta = {"gpt-oss.attention.sliding_window": 128}
    assert gpt_oss_config(meta, 4, False)["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert "quantization_config" not in gpt_oss_config(meta, 4, False)
    assert gpt_oss_config(meta, 4, True)["quantization_config"]["quant_method"] == "mxfp4"
    period = gpt_oss_config({**meta, "gpt-oss.attention.sliding_window_pattern": 3}, 3, False)["layer_types"]
    assert period == ["sliding_attention", "sliding_attention", "full_attention"]
    flags = gpt_oss_config({**meta, "gpt-oss.attention.sliding_window_pattern": [False, True]}, 2, False)
    assert flags["layer_types"] == ["full_attention", "sliding_attention"] and flags["sliding_window"] == 128


def test_harmonys_end_of_a_message_never_ends_a_reply() -> None:
    """A harmony vocabulary's stop tokens are <|return|>, <|call|> and <|endoftext|>, even where a file names
    <|end|> as its end of turn (llama.cpp drops it from its end-of-generation tokens too)."""
    from pagellm.model.gguf_convert import _generation_config

    tokens = ["a", "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>", "<|start|>"]
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1, 3, 3, 3, 3, 3],
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 1, "tokenizer.chat_template": "<|end|>"}
    assert _generation_config(meta)["eos_token_id"] == [2, 3, 4]
