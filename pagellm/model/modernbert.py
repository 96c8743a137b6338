"""ModernBERT embedding models (``ModernBertModel``: nomic's modernbert-embed, gte-modernbert) in plain PyTorch,
computed as transformers' ``ModernBertModel`` computes its token states, then pooled as ``model/bert.py``'s encoders
are (their sentence-transformers Pooling and Dense modules).

Contract: the flat step of ``EncoderEmbeddingModel`` (each prompt whole in one step, no KV cache), with ModernBERT's
layers: token embeddings and a LayerNorm; each layer a pre-LayerNorm (none before the first layer's attention)
attention over one fused ``Wqkv``, rotary positions (each prompt from 0; the global layers' base and the local
layers' own, ``rope_parameters``; ``layers/rotary.RotaryEmbedding``, its tables in the model's dtype as transformers
casts them), bidirectional within the prompt, or, in the local layers (``layer_types``), within
``local_attention // 2`` tokens either way; then a gated MLP (``Wi`` split in two, the activation of the first half
times the second, ``Wo``); a final LayerNorm. Norms, attention and MLP biases as the config says (none by default).
Checkpoints name the tensors as ``ModernBertModel`` does, or with a ``model.`` prefix.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.runs import Runs
from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model.arch import ArchConfig
from pagellm.model.bert import EncoderEmbeddingModel
from pagellm.model.layers.linear import ReplicatedLinear
from pagellm.model.layers.rotary import RotaryEmbedding
from pagellm.model.vit import act, activation

def _norm(cfg: ArchConfig, enc: dict, dtype: torch.dtype) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, bias=bool(enc.get("norm_bias")), dtype=dtype)


class _Layer(nn.Module):
    def __init__(self, cfg: ArchConfig, enc: dict, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        width, heads = cfg.hidden_size, cfg.num_heads
        self.heads, self.local = heads, enc["layer_types"][index] == "sliding_attention"
        self.window = int(enc.get("local_attention") or 128) // 2
        kind = "sliding_attention" if self.local else "full_attention"
        self.theta = float(enc["rope_parameters"][kind]["rope_theta"])
        self.attn_norm = nn.Identity() if index == 0 else _norm(cfg, enc, dtype)
        self.attn = nn.Module()
        self.attn.Wqkv = ReplicatedLinear(width, 3 * width, dtype, bias=bool(enc.get("attention_bias")))
        self.attn.Wo = ReplicatedLinear(width, width, dtype, bias=bool(enc.get("attention_bias")))
        self.mlp_norm = _norm(cfg, enc, dtype)
        self.mlp = nn.Module()
        self.mlp.Wi = ReplicatedLinear(width, 2 * cfg.intermediate_size, dtype, bias=bool(enc.get("mlp_bias")))
        self.mlp.Wo = ReplicatedLinear(cfg.intermediate_size, width, dtype, bias=bool(enc.get("mlp_bias")))
        self.kind = activation(enc.get("hidden_activation") or "gelu")

    def forward(self, x: torch.Tensor, runs: Runs, positions: torch.Tensor,
                rotary: dict[float, RotaryEmbedding]) -> torch.Tensor:
        """``rotary``: the encoder's rotary embeddings by rope base (the fused native pass in bfloat16)."""
        qkv = self.attn.Wqkv(self.attn_norm(x)).view(len(x), 3, self.heads, -1)
        q, k = rotary[self.theta](positions, qkv[:, 0], qkv[:, 1])
        attended = runs.attend(q, k, qkv[:, 2].contiguous(), window=self.window if self.local else None)
        x = x + self.attn.Wo(attended)
        gate_in, gate = self.mlp.Wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp.Wo(act(gate_in, self.kind) * gate)


class _Encoder(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__()
        enc = cfg.encoder or {}
        self.parallel = parallel
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embeddings.norm = _norm(cfg, enc, dtype)
        self.layers = nn.ModuleList(_Layer(cfg, enc, i, dtype) for i in range(cfg.num_layers))
        self.final_norm = _norm(cfg, enc, dtype)
        # one rotary embedding a rope base (cos and sin tables in the model's dtype, as transformers casts them)
        self.rotary = {theta: RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta, None, dtype)
                       for theta in {layer.theta for layer in self.layers}}

    @property
    def norm(self) -> nn.LayerNorm:  # the runner reads the model's dtype here
        return self.final_norm


class ModernBertEmbeddingModel(EncoderEmbeddingModel):
    ENCODER = _Encoder

    def encode(self, input_ids: torch.Tensor, runs: Runs) -> torch.Tensor:
        x = self.model.embeddings.norm(self.model.embeddings.tok_embeddings(input_ids))
        positions = torch.from_numpy(runs.positions)
        for layer in self.model.layers:
            x = layer(x, runs, positions, self.model.rotary)
        return self.model.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.model.embeddings.tok_embeddings.weight.T

    def _own(self, name: str) -> str | None:
        return None if name.startswith(("head.", "decoder.")) else super()._own(name)  # the masked-LM head


class ModernBertClassifier(ModernBertEmbeddingModel):
    """A ModernBERT cross-encoder (``ModernBertForSequenceClassification``: gte-reranker-modernbert): the first
    token's final state, or the prompt's mean (``classifier_pooling``), through ``head`` (``dense``, the classifier
    activation, ``norm``) and ``classifier``; ``pool`` gives its class logits (float32), as transformers' ``logits``."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        super().__init__(cfg, dtype, parallel)
        enc = cfg.encoder or {}
        self.kind, self.mean = activation(enc.get("classifier_activation") or "gelu"), \
            enc.get("classifier_pooling") == "mean"
        self.head = nn.Module()
        self.head.dense = ReplicatedLinear(cfg.hidden_size, cfg.hidden_size, dtype,
                                           bias=bool(enc.get("classifier_bias")))
        self.head.norm = _norm(cfg, enc, dtype)
        self.classifier = ReplicatedLinear(cfg.hidden_size, cfg.num_labels, dtype, bias=True)

    def pool(self, rows: torch.Tensor) -> torch.Tensor:
        pooled = rows.mean(0) if self.mean else rows[0]
        return self.classifier(self.head.norm(act(self.head.dense(pooled), self.kind))).float()

    def _own(self, name: str) -> str | None:
        return name if name.startswith(("head.", "classifier.")) else super()._own(name)
