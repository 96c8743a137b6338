"""The EAGLE head: one Llama decoder layer that predicts the target's next final hidden state from the current
one and the token sampled from it, with the file format ``pagellm train-draft --method eagle`` writes.

The math, for the pair ``(h_{t-1}, x_t)`` at position t (the target's final-norm hidden state before token
``x_t``, and that token)::

    f_t  = fc([embed(x_t); h_{t-1}])          # 2H → H, with bias
    y_t  = DecoderLayer(f_{≤t})               # one Llama layer, causal over the pairs of its context
    h'_t = final_norm(y_t)                    # the target's own final RMSNorm: a prediction of h_t
    q    = softmax(lm_head_draft(h'_t))       # the next token's draft distribution

The layer is split so drafting can cache its keys and values: ``project`` maps pairs to (residual, q, k, v) --
a pair's k/v depend on that pair alone, so they never change once computed -- and ``finish`` turns the attention
output into the layer's output (drafting, without autograd, takes the fused bfloat16 element-wise ops; training
keeps the plain twins). ``forward`` (training, and the twin drafting is tested against) runs both over
consecutive segments with causal attention inside each (``segment_attention``).

**Draft vocabulary.** ``draft_vocab`` (saved with the head, token ids by descending frequency in the target's own
generations) selects the LM-head rows drafting scores: ~8k of 49k rows make each draft depth's LM head ~6x
cheaper, and a draft distribution that is exactly zero outside the subset is still a distribution, so rejection
sampling stays lossless. A file without it drafts over the whole vocabulary.

Files are safetensors: the layer's tensors (bfloat16 when shipped), ``draft_vocab`` (int32), and metadata with
the training window (how many true pairs of context the proposer keeps) and the command that trained it. ``load`` rejects files that do not fit the target with a ValueError naming the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from pagellm.model.arch import ArchConfig
from pagellm.model.layers.activation import SiluAndMul
from pagellm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, pack_weights
from pagellm.model.layers.norm import RMSNorm
from pagellm.model.layers.rotary import RotaryEmbedding
from pagellm.ops import gemm
from pagellm.ops.fused import silu_and_mul
from pagellm.ops.gemm import linear

# The head shipped for the built-in model, used when an eagle config names no file (source checkouts).
DEFAULT_HEAD = Path(__file__).resolve().parents[2] / "artifacts" / "smollm2-135m-eagle.safetensors"
_FIX = "train one for this target with `pagellm train-draft --method eagle --model TARGET --out FILE`"


class EagleHead(nn.Module):
    """fc(concat(embed, hidden)) → one Llama decoder layer; shapes from the target's ``ArchConfig``."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype = torch.float32,
                 draft_vocab: torch.Tensor | None = None, window: int = 64) -> None:
        super().__init__()
        self.cfg = cfg
        self.window = window  # true pairs of context it was trained on (and drafts with)
        hidden, self.num_heads, self.num_kv_heads, self.head_dim = (cfg.hidden_size, cfg.num_heads,
                                                                    cfg.num_kv_heads, cfg.head_dim)
        self.fc = nn.Linear(2 * hidden, hidden, bias=True, dtype=dtype)
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.qkv_proj = QKVParallelLinear(hidden, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.attention_bias, dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, hidden, False, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.gate_up_proj = ColumnParallelLinear(hidden, [cfg.intermediate_size] * 2, False, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, hidden, False, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.rope_theta, cfg.rope_scaling, dtype)
        # token ids the draft LM head scores (None: all); not a parameter, saved beside the weights
        self.draft_vocab = None if draft_vocab is None else draft_vocab.to(torch.int64)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            p.requires_grad_(True)  # pagellm's layers create frozen (loaded) parameters; the head is trainable
            if name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                nn.init.normal_(p, std=0.02)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pairs [N, H] → (residual x [N, H], q [N, heads, D], k and v [N, kv_heads, D]), RoPE applied."""
        fused = _inference()
        x = linear(torch.cat([embeds, hidden], dim=-1), self.fc.weight, self.fc.bias)
        h, residual = self.input_layernorm(x) if fused else self.input_layernorm.forward_torch(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(h).split([q_size, kv_size, kv_size], dim=-1)
        rotary = self.rotary if fused else self.rotary.forward_torch
        q, k = rotary(positions, q.reshape(-1, self.num_heads, self.head_dim),
                      k.reshape(-1, self.num_kv_heads, self.head_dim))
        return residual, q, k, v.reshape(-1, self.num_kv_heads, self.head_dim)

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Attention output [N, heads, D] → the layer's output (the residual stream, before the final norm)."""
        fused = _inference()
        h = self.o_proj(attended.reshape(attended.shape[0], -1))
        norm = self.post_attention_layernorm
        h, residual = norm(h, residual) if fused else norm.forward_torch(h, residual)
        gate_up = self.gate_up_proj(h)
        act = silu_and_mul(gate_up) if fused else None  # None: not bfloat16 rows, or training
        return self.down_proj(act if act is not None else SiluAndMul.forward_torch(gate_up)) + residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                segments: Sequence[int]) -> torch.Tensor:
        """Rows [N, H] of (token embedding, hidden state) at ``positions`` [N], laid out as consecutive
        ``segments``, each attending causally within itself only. Returns the layer's output."""
        residual, q, k, v = self.project(embeds, hidden, positions)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return self.finish(residual, segment_attention(q, k, v, segments, self.head_dim ** -0.5))

    def save(self, path: str | Path, extra: dict[str, str] | None = None,
             dtype: torch.dtype | None = None) -> None:
        """Write the head (its tensors cast to ``dtype`` when given) and its draft vocabulary."""
        meta = {"method": "eagle", "hidden_size": str(self.cfg.hidden_size), "num_heads": str(self.num_heads),
                "num_kv_heads": str(self.num_kv_heads), "intermediate_size": str(self.cfg.intermediate_size),
                "window": str(self.window)}
        tensors = {name: t.detach().to(dtype or t.dtype).contiguous() for name, t in self.state_dict().items()}
        if self.draft_vocab is not None:
            tensors["draft_vocab"] = self.draft_vocab.to(torch.int32).contiguous()
        save_file(tensors, str(path), metadata={**meta, **(extra or {})})

    @classmethod
    def load(cls, path: str | Path | None, cfg: ArchConfig, dtype: torch.dtype) -> EagleHead:
        if path is None or not Path(path).is_file():
            raise ValueError(f"EAGLE head file {str(path)!r} does not exist; {_FIX}")
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            window = int((f.metadata() or {}).get("window", 64))
        vocab = tensors.pop("draft_vocab", None)
        head = cls(cfg, dtype, vocab, window)
        expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
        found = {name: tuple(t.shape) for name, t in tensors.items()}
        if found != expected:
            wrong = sorted(n for n in expected.keys() | found.keys() if expected.get(n) != found.get(n))
            raise ValueError(f"{path} is not an EAGLE head for this target (hidden {cfg.hidden_size}, "
                             f"{cfg.num_heads}/{cfg.num_kv_heads} heads); mismatched tensors {wrong[:4]}; {_FIX}")
        if vocab is not None and (vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= cfg.vocab_size):
            raise ValueError(f"{path}: its draft vocabulary does not fit this target's {cfg.vocab_size} tokens; "
                             f"{_FIX}")
        head.load_state_dict({name: t.to(dtype) for name, t in tensors.items()})
        pack_weights(head)  # bfloat16: its layers take the packed GEMM like the target's
        gemm.pack_parameter(head.fc.weight)  # a plain nn.Linear (trainable), run through ``linear`` too
        return head.eval()


def _inference() -> bool:
    """Drafting (no autograd) takes the fused bfloat16 element-wise ops (``ops/fused.py``, which fall back to the
    plain twins for other dtypes); training, which needs gradients, always runs the plain-PyTorch twins."""
    return not torch.is_grad_enabled()


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[int],
                      scale: float) -> torch.Tensor:
    """Causal attention within each segment of consecutive rows ([N, heads, D] each): the segments are padded
    to one length and batched, so memory grows with segments x length², not with N²."""
    lengths = torch.tensor(list(segments))
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    offset = torch.arange(len(seg)) - (lengths.cumsum(0) - lengths)[seg]
    width = int(lengths.max())

    def padded(t: torch.Tensor) -> torch.Tensor:  # [S, heads, width, D]
        out = t.new_zeros(len(lengths), width, *t.shape[1:])
        out[seg, offset] = t
        return out.transpose(1, 2)

    idx = torch.arange(width)
    allowed = (idx[:, None] >= idx[None, :]) & (idx[None, None, :] < lengths[:, None, None])  # [S, width, width]
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=allowed[:, None], scale=scale)
    return out.transpose(1, 2)[seg, offset]


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Each query row attends to the cached rows its mask allows: q [F, heads, D]; keys/values [M, kv_heads, D];
    mask [F, M] bool (at least one True per row). Returns [F, heads, D]. The query heads of one kv head are
    batched as rows of one attention call, so neither the keys are gathered per query nor repeated per group."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    qg = q.reshape(rows, kv_heads, groups, dim).transpose(0, 1).reshape(kv_heads, rows * groups, dim)
    allowed = mask.repeat_interleave(groups, dim=0)                       # [F * groups, M], rows as in qg
    # 4-D [1, kv_heads, rows, D] operands: the fused CPU kernel serves them (3-D ones take the slower math path)
    out = F.scaled_dot_product_attention(qg[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                         attn_mask=allowed, scale=scale)[0]  # [kv_heads, F * groups, D]
    return out.reshape(kv_heads, rows, groups, dim).transpose(0, 1).reshape(rows, heads, dim)
