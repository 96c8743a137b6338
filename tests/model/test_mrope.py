"""M-RoPE (``layers/rotary.MRotaryEmbedding``, Qwen2-VL's and Qwen3-VL's): [3, T] positions rotate each section of a
head's frequencies by its own position, as transformers' ``Qwen2VLRotaryEmbedding`` (consecutive sections) and
``Qwen3VLTextRotaryEmbedding`` (interleaved) and ``apply_rotary_pos_emb`` do, in float32 and (the fused kernel's
per-token tables) bfloat16; [T] positions, or three that agree, are the plain embedding's."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from pagellm.model.layers.rotary import MRotaryEmbedding, RotaryEmbedding

HEAD, SECTIONS, BASE = 16, (2, 3, 3), 10000.0


def _expected(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rope = {"rope_type": "default", "rope_theta": BASE, "mrope_section": list(SECTIONS)}
    if interleaved:
        embedding = Qwen3VLTextRotaryEmbedding(transformers.Qwen3VLTextConfig(
            hidden_size=64, num_attention_heads=4, head_dim=HEAD, rope_parameters=rope))
    else:
        embedding = Qwen2VLRotaryEmbedding(transformers.Qwen2VLTextConfig(hidden_size=64, num_attention_heads=4,
                                                                          rope_parameters=rope))
    cos, sin = embedding(q.float(), positions[:, None])
    q_out, k_out = apply_rotary_pos_emb(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], cos, sin)
    return q_out[0].transpose(0, 1), k_out[0].transpose(0, 1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_three_positions_are_transformers(dtype: torch.dtype, interleaved: bool) -> None:
    torch.manual_seed(0)
    positions = torch.randint(0, 60, (3, 7))
    q, k = torch.randn(7, 4, HEAD), torch.randn(7, 2, HEAD)
    rotary = MRotaryEmbedding(HEAD, 64, BASE, SECTIONS, dtype, interleaved)
    got = rotary(positions, q.to(dtype), k.to(dtype))
    expected = _expected(positions, q, k, interleaved)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for out, ref in zip(got, expected):
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    plain = RotaryEmbedding(HEAD, 64, BASE, None, dtype)(positions[0], q.to(dtype), k.to(dtype))
    assert not torch.allclose(got[0].float(), plain[0].float(), atol=tol)  # the sections' own positions count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_positions_that_agree_are_the_plain_embedding(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    flat = torch.arange(5, 12)
    q, k = torch.randn(7, 4, HEAD, dtype=dtype), torch.randn(7, 2, HEAD, dtype=dtype)
    rotary, plain = MRotaryEmbedding(HEAD, 64, BASE, SECTIONS, dtype), RotaryEmbedding(HEAD, 64, BASE, None, dtype)
    for got in (rotary(flat, q, k), rotary(flat.expand(3, -1).contiguous(), q, k)):
        for out, ref in zip(got, plain(flat, q, k)):
            torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_sections_must_cover_half_the_head() -> None:
    with pytest.raises(ValueError, match=r"mrope_section \[2, 3, 2\] must be three counts adding up to half the head"):
        MRotaryEmbedding(HEAD, 64, BASE, (2, 3, 2), torch.float32)
