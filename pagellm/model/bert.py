"""Encoder-only embedding models in plain PyTorch: BERT (bge, e5, gte, all-MiniLM), RoBERTa and XLM-RoBERTa (bge-m3,
multilingual-e5), computed as transformers' ``BertModel`` / ``XLMRobertaModel`` compute their token states, then
pooled as their sentence-transformers configs say (``model/encoder_config.py``: CLS, mean or last token).

Contract: ``EncoderEmbeddingModel`` takes the runner's flat step like a decoder (``forward(input_ids, positions)``,
each request's tokens ``query_start_loc[r]:query_start_loc[r + 1]`` of the step's attention inputs), but every
request's whole prompt is in its one step (the engine core turns chunked prefill and prefix caching off for these
models: a token's state depends on every token of its prompt) and its tokens attend to one another both ways, so it
keeps no KV cache (``attention_layers()`` is empty): on the ``cpu_paged`` backend each layer's attention is one call
of the C++ kernel over the step's own K/V, in place, every token seeing its prompt's end; on ``torch_ref`` (its twin)
one SDPA call a prompt, over its own rows. Embeddings are word + absolute position (RoBERTa's from its padding id +
1, its pad tokens at the padding id, as transformers numbers them) + token type (0; with two types, 1 after a row's
first separator, as a pair's tokenizer types it), then LayerNorm; each layer is post-LayerNorm attention with biases
and a GELU MLP, its matrices through the packed bfloat16 GEMM in bfloat16. ``pool(rows)`` takes a request's final
states and gives its embedding; ``pools_whole_prompt`` tells the runner to hand it all of them. ``compute_logits``
(the engine samples one throwaway token for a pooling request) reads the word embeddings. Checkpoints name the
tensors as ``BertModel`` does, or with a ``bert.`` / ``roberta.`` / ``model.`` prefix; the masked-LM heads are not
loaded, nor the pooler but by a BERT cross-encoder (``EncoderClassifier``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from torch import nn

from pagellm.attention.base import current_forward_context
from pagellm.attention.runs import Runs, kernel_pays
from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model.arch import ArchConfig
from pagellm.model.layers.linear import ReplicatedLinear, pack_weights
from pagellm.model.vit import act, activation

_SKIPPED = re.compile(r"^(pooler\.|cls\.|lm_head\.|embeddings\.position_ids$)")
_PREFIX = re.compile(r"^(bert\.|roberta\.|model\.)")


class _Embeddings(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        enc = cfg.encoder or {}
        self.offset = int(enc.get("pad_token_id") or 0) + 1 if enc.get("model_type") in ("roberta", "xlm-roberta") \
            else 0
        positions = cfg.max_position_embeddings + self.offset
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(positions, cfg.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(int(enc.get("type_vocab_size") or 2), cfg.hidden_size, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.pad = int(enc.get("pad_token_id") or 0)
        # with two token types: the separator after which a pair's second text (type 1) begins
        self.sep = enc.get("sep_token_id") if self.token_type_embeddings.num_embeddings > 1 else None

    def forward(self, ids: torch.Tensor, runs: Runs) -> torch.Tensor:
        """The embeddings of the step's prompts (``runs``: each one's tokens, positions from 0)."""
        positions = torch.from_numpy(runs.positions)
        if self.offset:  # RoBERTa: non-pad tokens counted from the padding id + 1; pad tokens at the padding id
            real = (ids != self.pad).long()
            positions = _row_cumsum(real, runs) * real + self.pad
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        if self.sep is None:
            x = x + self.token_type_embeddings.weight[0]
        else:  # type 1 after a row's first separator, as the tokenizer's pair template types a pair's tokens
            is_sep = (ids == self.sep).long()
            x = x + self.token_type_embeddings(((_row_cumsum(is_sep, runs) - is_sep) > 0).long())
        return self.LayerNorm(x)


class _Layer(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        width, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.heads = cfg.num_heads
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.self, name, ReplicatedLinear(width, width, dtype, bias=True))
        self.attention.output = nn.Module()
        self.attention.output.dense = ReplicatedLinear(width, width, dtype, bias=True)
        self.attention.output.LayerNorm = nn.LayerNorm(width, eps=eps, dtype=dtype)
        self.intermediate = nn.Module()
        self.intermediate.dense = ReplicatedLinear(width, cfg.intermediate_size, dtype, bias=True)
        self.output = nn.Module()
        self.output.dense = ReplicatedLinear(cfg.intermediate_size, width, dtype, bias=True)
        self.output.LayerNorm = nn.LayerNorm(width, eps=eps, dtype=dtype)
        self.kind = activation((cfg.encoder or {}).get("hidden_act") or "gelu")

    def forward(self, x: torch.Tensor, step: Runs) -> torch.Tensor:
        q, k, v = (proj(x).view(len(x), self.heads, -1)
                   for proj in (self.attention.self.query, self.attention.self.key, self.attention.self.value))
        x = self.attention.output.LayerNorm(x + self.attention.output.dense(step.attend(q, k, v)))
        inner = act(self.intermediate.dense(x), self.kind)
        return self.output.LayerNorm(x + self.output.dense(inner))


class _Encoder(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.embeddings = _Embeddings(cfg, dtype)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_Layer(cfg, dtype) for _ in range(cfg.num_layers))

    @property
    def norm(self) -> nn.LayerNorm:  # the runner reads the model's dtype here
        return self.embeddings.LayerNorm


class EncoderEmbeddingModel(nn.Module):
    pools_whole_prompt = True
    ENCODER: type[nn.Module] = _Encoder  # the token encoder (ModernBERT's its own)

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        if parallel.tp_size > 1 or parallel.pp_size > 1:
            raise ValueError(f"{cfg.architecture} runs on one worker; drop tensor_parallel_size and "
                             "pipeline_parallel_size")
        self.cfg, self.pooling = cfg, (cfg.encoder or {}).get("pooling", "CLS")  # the worker's resolve_arch sets it
        self.model = self.ENCODER(cfg, dtype, parallel)
        # sentence-transformers Dense layers after the pooling, in float32 (their weights in their own folders)
        self.dense_specs = (cfg.encoder or {}).get("dense") or []
        self.dense = nn.ModuleList(nn.Linear(d["in"], d["out"], bias=d["bias"], dtype=torch.float32)
                                   for d in self.dense_specs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None,
                embeds: object = None) -> torch.Tensor:
        if embeds is not None:
            raise ValueError(f"{self.cfg.architecture} takes token ids, not embeddings")
        context = current_forward_context()
        common = context.metadata.common
        if not np.array_equal(common.seq_lens, np.diff(common.query_start_loc)):
            raise ValueError("an encoder-only model computes each prompt in one step (chunked prefill off)")
        native = context.backend.name == "cpu_paged" and kernel_pays(self.model.norm.weight.dtype, self.cfg.head_dim)
        return self.encode(input_ids, Runs(common.query_start_loc, native))

    def encode(self, input_ids: torch.Tensor, runs: Runs) -> torch.Tensor:
        """The final token states of the step's prompts (``runs``: each one's tokens)."""
        x = self.model.embeddings(input_ids, runs)
        for layer in self.model.encoder.layer:
            x = layer(x, runs)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.model.embeddings.word_embeddings.weight.T

    def pool(self, rows: torch.Tensor) -> torch.Tensor:
        """One request's embedding (float32) from its prompt's final states."""
        rows = rows.float()
        pooled = rows.mean(0) if self.pooling == "MEAN" else rows[0] if self.pooling == "CLS" else rows[-1]
        for spec, layer in zip(self.dense_specs, self.dense):
            pooled = layer(pooled)
            pooled = torch.tanh(pooled) if spec["activation"] == "Tanh" else pooled
        return pooled

    def attention_layers(self) -> list:
        return []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], quantization: str | None = None) -> None:
        if quantization:
            raise ValueError(f"{self.cfg.architecture} runs unquantized; drop --quantization")
        params = dict(self.named_parameters())
        missing = {name for name in params if not name.startswith("dense.")}
        self._load_dense()
        for name, tensor in weights:
            own = self._own(_PREFIX.sub("", name))
            if own is None:
                continue
            if own not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.cfg.architecture}")
            params[own].data.copy_(tensor.to(params[own].dtype))
            missing.discard(own)
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {', '.join(sorted(missing)[:8])}")
        pack_weights(self)  # bfloat16 matrices for the native GEMM (float32 ones stay plain)

    def _load_dense(self) -> None:
        """The Dense layers' weights from their folders (``linear.weight``, ``linear.bias``)."""
        from safetensors.torch import load_file

        for spec, layer in zip(self.dense_specs, self.dense):
            folder = Path(spec["path"])
            state = load_file(folder / "model.safetensors") if (folder / "model.safetensors").is_file() else \
                torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
            layer.load_state_dict({key.removeprefix("linear."): value.float() for key, value in state.items()})

    def _own(self, name: str) -> str | None:
        """Our parameter's name for a checkpoint tensor (its ``bert.``-like prefix gone), None for one not loaded."""
        return None if _SKIPPED.match(name) else f"model.{name}"

    def load_dummy_weights(self, quantization: str | None = None, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        for param in self.parameters():
            param.data.copy_(torch.rand(param.shape, generator=gen).mul_(2e-3).sub_(1e-3))
        pack_weights(self)  # bfloat16 matrices for the native GEMM (float32 ones stay plain)


class EncoderClassifier(EncoderEmbeddingModel):
    """A cross-encoder (``*ForSequenceClassification``): the first token's final state through BERT's pooler
    (``bert.pooler.dense``, tanh) and ``classifier``, or RoBERTa's ``classifier.dense`` (tanh) and
    ``classifier.out_proj``; ``pool`` gives its class logits (float32), as transformers' ``logits``."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        super().__init__(cfg, dtype, parallel)
        width, labels = cfg.hidden_size, cfg.num_labels
        self.roberta = (cfg.encoder or {}).get("model_type") in ("roberta", "xlm-roberta")
        if self.roberta:
            self.head = nn.Module()
            self.head.dense = ReplicatedLinear(width, width, dtype, bias=True)
            self.head.out_proj = ReplicatedLinear(width, labels, dtype, bias=True)
        else:
            self.model.pooler = nn.Module()
            self.model.pooler.dense = ReplicatedLinear(width, width, dtype, bias=True)
            self.head = ReplicatedLinear(width, labels, dtype, bias=True)

    def pool(self, rows: torch.Tensor) -> torch.Tensor:
        if self.roberta:
            return self.head.out_proj(torch.tanh(self.head.dense(rows[0]))).float()
        return self.head(torch.tanh(self.model.pooler.dense(rows[0]))).float()

    def _own(self, name: str) -> str | None:
        if name.startswith("classifier."):  # RoBERTa's head.dense / head.out_proj, BERT's head itself
            return "head." + name.removeprefix("classifier.")
        if name.startswith("pooler.") and not self.roberta:
            return f"model.{name}"
        return super()._own(name)


def _row_cumsum(values: torch.Tensor, runs: Runs) -> torch.Tensor:
    """The running sum of ``values`` within each of the step's prompts (``runs``)."""
    total = values.cumsum(0)
    before = torch.cat([total.new_zeros(1), total])[torch.from_numpy(runs.starts)]
    return total - before.repeat_interleave(torch.from_numpy(runs.lens))
