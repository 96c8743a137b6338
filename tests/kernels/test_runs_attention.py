"""Attention within runs of tokens (``attention/runs.py``: an encoder's prompts, a vision tower's tiles): the C++
kernel over the tokens' own K/V and its SDPA twin (one call a run, or one for runs of one length) agree with dense
float64 attention in which each token sees its whole run and nothing else, on the flash tiles (head size 64,
bfloat16) and the walks; ``native_attention`` points a model's vision attention at one or the other."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.attention.runs import Runs, native_attention
from pagellm.model.vit import EncoderLayer

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qsl: np.ndarray,
           window: int | None = None) -> torch.Tensor:
    out = []
    for start, end in zip(qsl[:-1].tolist(), qsl[1:].tolist()):
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), k[start:end].double()) * q.shape[-1] ** -0.5
        if window is not None:
            offsets = torch.arange(end - start)
            scores = scores.masked_fill((offsets[:, None] - offsets[None, :]).abs() > window, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[start:end].double()).reshape(end - start, -1))
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,size", [(12, 64), (4, 16)])
@pytest.mark.parametrize("lens", [[37, 5, 64, 1, 20], [16, 16, 16]])
def test_the_kernel_and_its_twin_attend_within_runs(dtype: torch.dtype, heads: int, size: int, lens: list[int],
                                                    window: int | None) -> None:
    """Each token sees its whole run, or with a ``window`` the keys at most that far from it either way."""
    gen = torch.Generator().manual_seed(len(lens) + heads)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    q, k, v = (torch.randn(int(qsl[-1]), heads, size, generator=gen).to(dtype) for _ in range(3))
    expected = _dense(q, k, v, qsl, window)
    native, twin = (Runs(qsl, flag).attend(q, k, v, window=window) for flag in (True, False))
    assert twin.shape == native.shape == (int(qsl[-1]), heads * size)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(native.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(twin.double(), expected, atol=tol, rtol=tol)
    assert (Runs(qsl, False).same == 16) == (lens == [16, 16, 16])


def test_native_attention_points_a_towers_layers_at_the_kernel() -> None:
    """A tower layer gives the same tiles' states (float32) through either path, once pointed at it."""
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
    layer, gen = EncoderLayer(cfg, torch.float32), torch.Generator().manual_seed(0)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    x = torch.randn(3, 20, 64, generator=gen)
    assert not layer.self_attn.native_attention
    twin = layer(x, None)
    native_attention(layer, "cpu_paged")
    assert layer.self_attn.native_attention
    torch.testing.assert_close(layer(x, None), twin, atol=2e-5, rtol=2e-5)
    native_attention(layer, "torch_ref")
    assert not layer.self_attn.native_attention
