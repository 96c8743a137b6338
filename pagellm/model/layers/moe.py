"""The mixture-of-experts MLP of Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE and gpt-oss.

A router (a replicated ``[experts, hidden]`` matrix) scores every expert for each token; the token goes through its
``top_k`` experts, SwiGLU MLPs each, and its output is their outputs weighted by the router's softmax probabilities
(renormalised over the chosen ones where the model says so). Qwen2-MoE adds a shared expert that every token takes,
scaled by a sigmoid gate of its own. gpt-oss's router and experts have biases, its softmax is over the chosen
logits, and its experts gate with a clamped SwiGLU (``activation.ClampedSwiGLU``; the native call takes all three).

Tokens are grouped by expert (one stable sort of the flat choices), so each expert runs one GEMM pair over the
tokens that chose it, and experts no token chose cost nothing. Contributions are summed into the output in
ascending expert order, as transformers sums them, so float32 results match its to the bit where the hidden states
do. With packed bfloat16 (or int8) experts the router, the routing and the experts are one native call
(``ops/moe.py``, which the native decoder stack makes too): given a routing its experts are bit for bit the Python
loop's, and its routing is torch's up to the softmax's last bits; ``PAGELLM_NATIVE_DECODER=0`` keeps torch's
routing and the Python loop, its twin. Under tensor parallelism each expert is split like a dense MLP (gate/up by
rows, down by columns), or with expert parallelism (``enable_expert_parallel``) each rank holds a run of whole
experts (``ParallelState.expert_range``) and computes only the pairs routed to them (torch's routing, then the
native experts); either way the partial outputs (and the shared expert's, always split) are summed on each rank and
all-reduced once per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm import envs
from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model.arch import MoEConfig
from pagellm.model.layers.activation import ClampedSwiGLU, SiluAndMul
from pagellm.model.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagellm.ops import gemm
from pagellm.ops import moe as moe_kernel


class Expert(nn.Module):
    """One expert, down(act(gate(x), up(x))): SwiGLU, or gpt-oss's clamped SwiGLU with biases (``moe``); its output
    is this rank's partial sum (not all-reduced), so the down projection's bias joins it on rank 0 alone."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, parallel: ParallelState,
                 moe: MoEConfig | None = None) -> None:
        super().__init__()
        bias = moe is not None and moe.bias
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate] * 2, bias, dtype, parallel)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, dtype, parallel, reduce=False)
        self.act_fn: nn.Module = SiluAndMul() if moe is None or moe.swiglu_limit is None else \
            ClampedSwiGLU(moe.swiglu_limit, moe.swiglu_alpha)
        self.down_bias = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False) if bias else None
        self.bias_here = parallel.tp_rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act_fn(self.gate_up_proj(x)))
        return out + self.down_bias if self.down_bias is not None and self.bias_here else out


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          softmax_top_k: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts (int64 [tokens, top_k]) and their weights (float32): the softmax
    probabilities of the router's logits, divided by their sum over the chosen experts when ``renormalize``; with
    ``softmax_top_k`` (gpt-oss's), the softmax of the chosen logits alone (the same weights, as gpt-oss rounds them)."""
    if softmax_top_k:
        values, experts = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=torch.float32), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoeBlock(nn.Module):
    """The experts' MLP of one decoder layer, with its router and, where the model has one, its shared expert."""

    def __init__(self, moe: MoEConfig, hidden: int, dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.moe = moe
        self.parallel = parallel
        self.gate = ReplicatedLinear(hidden, moe.num_experts, dtype, moe.bias)
        self.expert_range = parallel.expert_range(moe.num_experts)  # this rank's experts (numbered globally)
        whole = parallel.expert_parallel  # whole experts on this rank, or every expert's slice
        self.experts = nn.ModuleList(Expert(hidden, moe.intermediate_size, dtype, SINGLE if whole else parallel, moe)
                                     for _ in self.expert_range)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = Expert(hidden, moe.shared_intermediate_size, dtype, parallel)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = self._native_for(x)
        if native is not None and native.routes:  # router, routing, experts and shared expert in one native call
            return self.parallel.all_reduce(native.forward(x))
        weights, experts = route(self.gate(x), self.moe.top_k, self.moe.renormalize, self.moe.softmax_top_k)
        if self.moe.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        out = self.routed(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.parallel.all_reduce(out)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Σ over each token's chosen experts of weight × expert(token), this rank's partial sums: one native call
        for packed bfloat16 (or int8) experts (``ops/moe.py``), else ``routed_torch``, its twin."""
        top_k = experts.shape[-1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, choice) pairs grouped by expert
        rows, scales = order // top_k, weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.moe.num_experts)
        if len(self.experts) < self.moe.num_experts:  # expert parallelism: the pairs of this rank's experts
            first, last = self.expert_range.start, self.expert_range.stop
            start, stop = int(counts[:first].sum()), int(counts[:last].sum())
            rows, scales, counts = rows[start:stop], scales[start:stop], counts[first:last]
        native = self._native_for(x)
        if native is not None:
            return native(x, rows, scales.float(), counts)
        return self.routed_torch(x, rows, scales.unsqueeze(-1), counts.tolist())

    def routed_torch(self, x: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor,
                     counts: list[int]) -> torch.Tensor:
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                chosen = rows[start:start + count]
                y = expert(x[chosen]) * scales[start:start + count]
                out.index_add_(0, chosen, y.to(out.dtype))
                start += count
        return out

    def _native_for(self, x: torch.Tensor) -> moe_kernel.Experts | None:
        """The native call for hidden states ``x``: bfloat16 ones, unless ``PAGELLM_NATIVE_DECODER=0``."""
        return self.native_experts() if x.dtype == torch.bfloat16 and envs.native_decoder() else None

    def native_experts(self) -> moe_kernel.Experts | None:
        """The experts bound to the native call, made on first use (after loading packed them), or ``None`` where
        it does not run: weights left plain (float32, no kernel here) or act-order (their inputs gathered per
        expert: the Python loop's ``gemm.linear``), or a library that does not build. With every
        expert on this rank and a packed router it routes too (``routes``; the native decoder stack calls it)."""
        native = self.__dict__.get("_native_experts", _UNBUILT)
        if native is _UNBUILT:
            weights = [w for e in self.experts for w in (e.gate_up_proj.weight, e.down_proj.weight)]
            shared = None
            if self.shared_expert is not None and self.shared_expert_gate is not None:
                shared = (self.shared_expert.gate_up_proj.weight, self.shared_expert.down_proj.weight,
                          self.shared_expert_gate.weight)
            formats = {gemm.weight_format(w) for w in (*weights, *(shared[:2] if shared else ()))}
            native = None
            in_order = all(gemm.input_order(w) is None for w in (*weights, *(shared[:2] if shared else ())))
            if moe_kernel.available() and len(formats) == 1 and None not in formats and in_order:
                whole = len(self.experts) == self.moe.num_experts and gemm.weight_format(self.gate.weight) == "bf16" \
                    and (shared is None or gemm.weight_format(shared[2]) == "bf16")
                native = moe_kernel.Experts(weights[0::2], weights[1::2], self.gate.weight if whole else None,
                                            self.moe.top_k, self.moe.renormalize, self.moe.weights_in_model_dtype,
                                            shared if whole else None, self._biases())
            self.__dict__["_native_experts"] = native
        return native  # type: ignore[return-value]

    def _biases(self) -> moe_kernel.Biases | None:
        """gpt-oss's biases, clamp and routing for the native call (``None`` for the other mixtures)."""
        if not self.moe.bias and self.moe.swiglu_limit is None:
            return None
        return moe_kernel.Biases(
            self.gate.bias, [e.gate_up_proj.bias for e in self.experts],
            [e.down_bias if e.bias_here else None for e in self.experts], self.moe.swiglu_limit or 0.0,
            self.moe.swiglu_alpha, self.moe.softmax_top_k)


_UNBUILT = object()
