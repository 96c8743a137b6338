"""A GGUF's 4-bit blocks in the 4-bit kernels.

The built-in model's GGUF stores its decoder layers in Q4_1 (llama.cpp's 4 bits in groups of 32 with a float16
scale and minimum each), the very format of ``--quantization w4a8_int4``. A GGUF is dequantized when it is converted
and loaded in bfloat16; quantizing those weights back gives exactly the file's own 4-bit values, scales and minima
(its weights were bfloat16 before llama.cpp quantized them, so each group's minimum and maximum survive the round
trip).

Files in Q4_0 and Q4_K (and mixed files, as llama.cpp's Q4_K_M is) keep their blocks in place of float weights
(``model/gguf_blocks.py``), and ``--quantization w4a16_int4`` or ``w4a8_int4`` packs them as they are: their values
are held to gguf's own ``dequantize``; the layers in other types are quantized at load as float layers are (here Q8_0,
Q6_K and Q5_0, kept as blocks too and decoded at load, and the ternary TQ2_0, converted to float32)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from tiny_gguf import quantize_q4_k, random_model, tiny_config, write_tiny_gguf
from tokenizers import Tokenizer as BackendTokenizer

from pagellm import LLM, SamplingParams
from pagellm.model import gguf_blocks, gguf_convert
from pagellm.model.gguf_convert import convert_gguf_to_hf
from pagellm.model.gguf_tensors import hf_arrays, hf_tensor_name, unpermute_rotary_rows
from pagellm.model.arch import ArchConfig
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.loader import FLOAT_COPIES, default_model_path, hf_model_dir, iter_weights, load_hf_config
from pagellm.ops import fused, gemm, gemm_w4a8, gemm_w4a16

HEADS = {"q_proj": 9, "k_proj": 3}  # SmolLM2-135M's attention heads and KV heads (llama.cpp permutes their rows)


def _blocks(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # noqa: ANN001
    """(q, d, m) of a Q4_1 tensor [N, K]: each 20-byte block is d and m (float16), then 16 bytes whose low nibbles
    are the group's first 16 values and high nibbles its last 16."""
    n, k = int(tensor.shape[1]), int(tensor.shape[0])
    raw = np.asarray(tensor.data).view(np.uint8).reshape(n, k // 32, 20)
    d = raw[..., 0:2].copy().view(np.float16).reshape(n, -1)
    m = raw[..., 2:4].copy().view(np.float16).reshape(n, -1)
    nibbles = raw[..., 4:]
    return np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(n, k), d, m


@pytest.mark.parametrize("layer", [0, 29])
def test_4bit_quantization_of_the_built_in_model_gives_back_its_gguf_blocks(layer: int) -> None:
    reader = GGUFReader(str(default_model_path()))
    tensors = [t for t in reader.tensors if t.name.startswith(f"blk.{layer}.") and t.name.endswith(".weight")
               and t.tensor_type == GGMLQuantizationType.Q4_1]
    assert len(tensors) == 7  # q, k, v, o, gate, up, down
    for tensor in tensors:
        hf_name = hf_tensor_name(tensor.name)
        [(_, values)] = hf_arrays(tensor, hf_name, HEADS)
        q, d, m = gemm_w4a8.quantize(torch.from_numpy(values).to(torch.bfloat16))  # as the loaded model's weight
        want = _blocks(tensor)
        projection = hf_name.split(".")[-2]
        if projection in HEADS:  # whole rows move, and a row's blocks with them
            want = tuple(unpermute_rotary_rows(a, HEADS[projection]) for a in want)
        assert np.array_equal(q.numpy(), want[0]), tensor.name
        assert np.array_equal(d.numpy(), want[1]) and np.array_equal(m.numpy(), want[2]), tensor.name


# ------------------------------------------------------------------------------------ Q4_0, Q4_1 and Q4_K blocks

MIXED = {"*": "Q4_K", "attn_k": "TQ2_0", "attn_v": "Q6_K", "attn_output": "Q4_1", "ffn_gate": "Q8_0", "ffn_up": "Q5_0",
         "ffn_down": "Q4_0", "ffn_down_exps": "Q4_0", "ffn_up_exps": "BF16", "token_embd": "Q6_K", "output": "Q4_1"}
ARCHS = ("llama", "qwen3moe", "phi3")
SIZES = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, head_dim=64)  # Q4_K: 256 inputs


def _random_q4_k_blocks(rows: int, supers: int, seed: int) -> np.ndarray:
    """Q4_K blocks whose scale bytes and nibbles are random (every bit of the packed 6-bit scales and minima set
    somewhere), with float16 ``d`` and ``dmin`` of a weight's size."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, supers, 144), dtype=np.uint8)
    blocks[..., 0:4] = rng.uniform(1e-4, 1e-2, size=(rows, supers, 2)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, supers * 144)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q4_K-random-bytes"])
def test_blocks_decode_to_the_values_gguf_dequantizes(kind: str) -> None:
    block_type = kind.split("-")[0]
    w = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32) * 0.05
    if kind == "Q4_K-random-bytes":
        raw = _random_q4_k_blocks(6, 2, seed=2)
    else:
        raw = quantize_q4_k(w) if kind == "Q4_K" else gguf.quants.quantize(w, GGMLQuantizationType[kind])
    want = dequantize(raw, GGMLQuantizationType[block_type]).reshape(6, 512)
    q, groups = gguf_blocks.decode(torch.from_numpy(raw), block_type)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and groups.shape == (6, 16, 2)
    got = q.float().view(6, 16, 32) * groups[..., :1] + groups[..., 1:]
    assert torch.equal(got.view(6, 512), torch.from_numpy(want))
    # the float load's values: one native pass (tests/kernels/test_fused_ops.py), and its twin
    assert torch.equal(gguf_blocks.values(torch.from_numpy(raw), block_type), torch.from_numpy(want))
    assert torch.equal(gguf_blocks._values(q, groups), torch.from_numpy(want))



def test_a_row_that_is_not_whole_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="not whole 144-byte blocks"):
        gguf_blocks.decode(torch.zeros(2, 150, dtype=torch.uint8), "Q4_K")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: BackendTokenizer, request) -> dict:  # noqa: ANN001
    """Tiny GGUFs (a llama, a Qwen3 mixture of experts, a Phi-3 with its q/k/v and gate/up fused in the file) whose
    decoder matrices are Q4_K, Q4_1, Q4_0, Q6_K, Q8_0, Q5_0, BF16 and TQ2_0, as llama.cpp's mixed files are, and gguf's
    own values of each matrix (Hugging Face's names and rows)."""
    out = {}
    for arch in ARCHS:
        tmp = tmp_path_factory.mktemp(arch)
        model = random_model(tiny_config(arch, tiny_tokenizer.get_vocab_size(), False, **SIZES))
        checkpoint = None
        if arch == "qwen3moe":  # llama.cpp's converter reads the experts as saved, one tensor each
            model.save_pretrained(tmp / "original")
            checkpoint = dict(iter_weights(tmp / "original"))
        path = tmp / f"{arch}.gguf"
        write_tiny_gguf(path, model, tiny_tokenizer, arch, checkpoint=checkpoint, types=MIXED)
        heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads} \
            if arch == "llama" else {}
        values = {}
        for tensor in GGUFReader(str(path)).tensors:
            hf_name = hf_tensor_name(tensor.name, arch)
            if hf_name and len(tensor.shape) >= 2:  # the decoder matrices, the embeddings and the LM head
                values.update({name: (tensor.tensor_type.name, torch.from_numpy(v.copy()))
                               for name, v in hf_arrays(tensor, hf_name, heads)})
        out[arch] = (path, values)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_the_conversion_keeps_the_4bit_blocks_of_the_decoder_matrices(mixed: dict, tmp_path: Path, arch: str) -> None:
    path, values = mixed[arch]
    convert_gguf_to_hf(path, tmp_path)
    with safe_open(str(tmp_path / gguf_blocks.BLOCKS_FILE), framework="pt") as handle:
        kinds = handle.metadata()
        assert set(handle.keys()) == {name for name, (kind, _) in values.items() if kind in gguf_blocks.KINDS}
    assert kinds == {name: kind for name, (kind, _) in values.items() if kind in gguf_blocks.KINDS}
    assert {kind for kind, _ in values.values()} >= {"Q4_K", "Q4_1", "Q4_0", "Q6_K"} | \
        {"llama": {"TQ2_0", "Q8_0", "Q5_0"}, "qwen3moe": {"TQ2_0", "BF16"}, "phi3": {"Q5_0"}}[arch]
    assert "TQ2_0" not in gguf_blocks.KINDS  # written in float32
    assert values["model.embed_tokens.weight"][0] == "Q6_K" and values["lm_head.weight"][0] == "Q4_1"  # kept, as values
    streamed = dict(iter_weights(tmp_path, groups=True))
    for name, (kind, want) in values.items():  # the 4-bit layers as q and groups, the others (LM head too) as values
        if kind in gguf_blocks.LAYOUTS and ".layers." in name:
            groups = streamed[name.removesuffix("weight") + "weight_groups"]
            got = streamed[name].float().view(want.shape[0], -1, 32) * groups[..., :1] + groups[..., 1:]
            assert torch.equal(got.view(want.shape), want), name
        else:
            assert torch.equal(streamed[name], want), name
    assert not any(name.endswith("mlp.gate.weight_groups") for name in streamed)


def test_a_ggufs_float_weights_are_its_blocks_values_with_no_float32_copy(mixed: dict, tmp_path: Path) -> None:
    """The conversion writes the kept matrices (4-bit, Q5_0, Q6_K, Q8_0) as blocks only, and the float load decodes
    them to gguf's own values, bit for bit, among the file's other tensors, each once."""
    path, values = mixed["llama"]
    convert_gguf_to_hf(path, tmp_path)
    kept = {name for name, (kind, _) in values.items() if kind in gguf_blocks.KINDS}
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert not kept & set(handle.keys()) and set(values) - kept <= set(handle.keys())
    names = [name for name, _ in iter_weights(tmp_path)]
    assert len(names) == len(set(names)) and set(names) >= set(values)
    streamed = dict(iter_weights(tmp_path))
    for name, (_, want) in values.items():
        assert streamed[name].dtype == torch.float32 and torch.equal(streamed[name], want), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_transient_stream_decodes_into_one_buffer_and_loads_the_same_model(mixed: dict, tmp_path: Path,
                                                                              dtype: torch.dtype) -> None:
    """``iter_weights(transient=True)``, the model loads': each matrix's values are gguf's, decoded into one buffer the
    stream reuses (valid until the next tensor is drawn), and the model loaded from it is the one a stream of new
    tensors gives, bit for bit."""
    from pagellm.model.llama import LlamaForCausalLM as PagedLlama

    path, values = mixed["llama"]
    convert_gguf_to_hf(path, tmp_path)
    homes, decoded = set(), 0
    for name, tensor in iter_weights(tmp_path, dtype=dtype, transient=True):
        if name in values and values[name][0] in set(gguf_blocks.KINDS) - set(gguf_blocks.FLOATS):
            assert torch.equal(tensor, values[name][1].to(dtype)), name  # as drawn: the next overwrites it
            homes.add(tensor.untyped_storage().data_ptr())
            decoded += 1
    assert decoded > 10 and len(homes) <= 2  # the buffer grows where a matrix is larger than the ones before
    loaded = []
    for transient in (True, False):
        model = PagedLlama(ArchConfig.from_hf(load_hf_config(tmp_path)), dtype)
        model.load_weights(iter_weights(tmp_path, dtype=dtype, transient=transient))
        loaded.append(model.state_dict())
    for name, tensor in loaded[0].items():
        assert torch.equal(tensor, loaded[1][name]), name
    with pytest.raises(ValueError, match=r"writes contiguous torch.bfloat16 \(2, 64\)"):
        fused.dequantize_gguf(torch.zeros(2, 36, dtype=torch.uint8), "Q4_0", torch.bfloat16,
                              torch.empty(2, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("shard_bytes", [None, 20_000], ids=["one-file", "sharded"])
def test_other_readers_get_the_4bit_matrices_float32_copies(mixed: dict, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, shard_bytes: int) -> None:
    """``hf_model_dir`` writes the blocks' float32 values once for transformers (in shards when they pass the shard
    size), which then loads every weight as pagellm's float load has it; pagellm's own load still reads each tensor
    once, its 4-bit matrices from the blocks."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    if shard_bytes:
        monkeypatch.setattr(gguf_convert, "MAX_SHARD_BYTES", shard_bytes)
    path, values = mixed["llama"]
    model_dir = tmp_path / "hf"
    convert_gguf_to_hf(path, model_dir)
    before = {groups: [(n, t.clone()) for n, t in iter_weights(model_dir, groups=groups)] for groups in (True, False)}
    assert hf_model_dir(model_dir) == model_dir
    copies = sorted(model_dir.glob(f"{FLOAT_COPIES}-*.safetensors"))
    assert len(copies) == 1 if shard_bytes is None else len(copies) > 1
    assert not (model_dir / "model.safetensors").exists()
    stamps = [p.stat().st_mtime_ns for p in copies]
    assert hf_model_dir(model_dir) == model_dir and [p.stat().st_mtime_ns for p in copies] == stamps  # once
    reference = dict(before[False])
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name
    for groups in (True, False):  # pagellm's own load: the same tensors, in the same order
        after = list(iter_weights(model_dir, groups=groups))
        assert [n for n, _ in after] == [n for n, _ in before[groups]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(after, before[groups]))


def _four_bit_kernels() -> list:
    w4a16 = pytest.mark.skipif(not gemm_w4a16.available(), reason="the W4A16 kernel needs AVX-512 BF16 and VNNI")
    w4a8 = pytest.mark.skipif(not gemm_w4a8.available(), reason="the 4-bit GEMM needs AVX-512 VNNI and a compiler")
    return [pytest.param("w4a16_int4", marks=w4a16), pytest.param("w4a8_int4", marks=w4a8)]


@pytest.mark.parametrize("quantization", _four_bit_kernels())
@pytest.mark.parametrize("arch", ARCHS)
def test_four_bit_kernels_take_the_files_own_blocks(mixed: dict, arch: str, quantization: str,
                                                    tmp_path: Path) -> None:
    """Each packed layer holds the file's values: Q4_0 and Q4_1 exactly, Q4_K within float16's rounding of its
    scales times its 6-bit sub-scales; a Q6_K matrix fused beside 4-bit ones (v beside Q4_K q and TQ2_0 k) is
    quantized at load from its values, as a float layer is."""
    path, values = mixed[arch]
    convert_gguf_to_hf(path, tmp_path)  # as resolve_model_dir would, without the user's cache
    llm = LLM(str(tmp_path), dtype="bfloat16", kv_cache_memory=1 << 24, quantization=quantization)
    model = llm.engine.core.executor.worker.runner.model
    checked = []
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}."
        fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "self_attn.o_proj": ("self_attn.o_proj",)}
        if arch == "llama":
            fused |= {"mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj": ("mlp.down_proj",)}
        elif arch == "phi3":  # fused in the file too: one Q4_K tensor each
            fused = {name: (name,) for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                "mlp.down_proj")}
        else:
            fused |= {f"mlp.experts.{e}.{ours}": tuple(f"mlp.experts.{e}.{p}" for p in parts) for e in range(4)
                      for ours, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))}
        for ours, parts in fused.items():
            _assert_holds(layer.get_submodule(ours).weight, [values[f"{prefix}{p}.weight"] for p in parts],
                          quantization)
            checked.append(ours)
    assert len(checked) == 2 * (2 + 4 * 2 if arch == "qwen3moe" else 4)
    out = llm.generate(["the quick brown fox"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def _assert_holds(weight: torch.nn.Parameter, parts: list[tuple[str, torch.Tensor]], quantization: str) -> None:
    assert gemm.weight_format(weight) == quantization
    n, k = gemm.packed_shape(weight)
    q, d, m = gemm_w4a8.unpack(weight.data, n, k)
    got = (q.float().view(n, -1, 32) * d.float()[..., None] + m.float()[..., None]).view(n, -1)[:, :k]
    row = 0
    for kind, want in parts:
        rows = slice(row, row + want.shape[0])
        row += want.shape[0]
        if kind not in gguf_blocks.LAYOUTS:  # Q6_K, Q8_0, Q5_0 (kept, decoded) and TQ2_0 (float32): quantized at load
            wq, wd, wm = gemm_w4a8.quantize(want.to(torch.bfloat16))
            assert torch.equal(q[rows], wq) and torch.equal(d[rows], wd) and torch.equal(m[rows], wm)
        elif kind == "Q4_K":  # each of d and m within float16's half ulp of the file's float32 product
            bound = 2.0**-11 * (15 * d[rows].float().abs() + m[rows].float().abs())
            err = (got[rows] - want).abs().view(want.shape[0], -1, 32)
            assert bool((err <= bound[..., None]).all()) and float(err.max()) > 0
        else:
            assert torch.equal(got[rows], want), kind
    assert row == n


@pytest.mark.parametrize("groups", [True, False], ids=["blocks", "float"])
@pytest.mark.parametrize("quantization", _four_bit_kernels())
def test_each_layer_is_packed_as_soon_as_all_of_it_has_loaded(mixed: dict, tmp_path: Path, quantization: str,
                                                              groups: bool) -> None:
    """The load quantizes a layer once its weight's matrices (and a 4-bit one's groups) have all come, not after the
    whole checkpoint, and the converted GGUF's tensors come one layer after another, its blocks among its float
    tensors (q/k/v: Q4_K q, TQ2_0 k, Q6_K v): when layer 1's first tensor comes, layer 0 is packed, from the file's
    blocks or, without ``groups``, from their float values."""
    path, _ = mixed["llama"]
    convert_gguf_to_hf(path, tmp_path)
    model = LlamaForCausalLM(ArchConfig.from_hf(load_hf_config(tmp_path)), torch.bfloat16)
    seen = []

    def stream():
        for name, tensor in iter_weights(tmp_path, groups=groups):
            if name.startswith("model.layers.1.") and not seen:
                layer = model.model.layers[0]
                seen.append({ours: gemm.weight_format(layer.get_submodule(ours).weight) for ours in
                             ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")})
            yield name, tensor

    model.load_weights(stream(), quantization)
    assert seen == [dict.fromkeys(("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"),
                                  quantization)]
    assert gemm.weight_format(model.model.layers[1].self_attn.qkv_proj.weight) == quantization


@pytest.mark.parametrize("quantization", _four_bit_kernels())
def test_an_interleaved_rope_models_4bit_rows_move_with_their_groups(tiny_tokenizer: BackendTokenizer,
                                                                   tmp_path: Path, quantization: str) -> None:
    """ERNIE 4.5 (and Cohere) reorder q and k's rows as they load (``InterleavedRopeForCausalLM``): a file's 4-bit
    blocks move row by row with their groups, so each packed q/k row holds the file's values of the row it became."""
    model = random_model(tiny_config("ernie4_5", tiny_tokenizer.get_vocab_size(), False, **SIZES))
    write_tiny_gguf(tmp_path / "ernie.gguf", model, tiny_tokenizer, "ernie4_5", types={"*": "Q4_0"})
    convert_gguf_to_hf(tmp_path / "ernie.gguf", tmp_path / "hf")
    values = dict(iter_weights(tmp_path / "hf"))  # the blocks' values, in the file's (the checkpoint's) row order
    llm = LLM(str(tmp_path / "hf"), dtype="bfloat16", kv_cache_memory=1 << 24, quantization=quantization)
    layer = llm.engine.core.executor.worker.runner.model.model.layers[0]
    head_dim = SIZES["head_dim"]
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])

    def reordered(name: str) -> torch.Tensor:
        rows = values[f"model.layers.0.self_attn.{name}.weight"]
        return rows.reshape(-1, head_dim, rows.shape[-1])[:, order].reshape(rows.shape)

    parts = [("Q4_0", reordered("q_proj")), ("Q4_0", reordered("k_proj")),
             ("Q4_0", values["model.layers.0.self_attn.v_proj.weight"])]
    _assert_holds(layer.self_attn.qkv_proj.weight, parts, quantization)
