"""The built-in model's GGUF stores its decoder layers in Q4_1 (llama.cpp's 4 bits in groups of 32 with a float16
scale and minimum each), the very format of ``--quantization w4a8_int4``. A GGUF is dequantized when it is converted
and loaded in bfloat16; quantizing those weights back gives exactly the file's own 4-bit values, scales and minima
(its weights were bfloat16 before llama.cpp quantized them, so each group's minimum and maximum survive the round
trip). So ``pagellm serve --quantization w4a8_int4`` serves the weights llama.cpp serves from the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from pagellm.model.gguf_tensors import hf_arrays, hf_tensor_name, unpermute_rotary_rows
from pagellm.model.loader import default_model_path
from pagellm.ops import gemm_w4a8

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
