"""Linear layers that own their sharding and their weight loading.

Column-parallel layers split output features across tensor-parallel ranks, row-parallel layers split input
features and all-reduce their outputs. Each parameter carries a ``weight_loader(param, loaded, shard_id)`` that
copies this rank's slice of a checkpoint tensor into place, so model files never slice weights themselves.
Merged layers (QKV, gate+up) fuse several checkpoint tensors into one matrix: one GEMM instead of several.

After loading, ``pack_weights(model)`` re-lays every bfloat16 weight that runs through ``ops.gemm.linear``
(these layers and the LM head) in the packed layout of the native GEMM, in place: the model keeps one copy of
each weight, and loaders refuse to write into a packed model. float32 weights stay plain (``F.linear``). With a
``quantization`` (``ModelConfig.quantization``), these layers' weights are quantized and packed for the int8 kernel
(``ops.gemm_w8a8``) or the 4-bit ones (``ops.gemm_w4a8``, ``ops.gemm_w4a16``) instead, each as soon as all of it
has loaded (``loaded_whole``), so the load never holds the whole model in bfloat16; the LM head stays bfloat16.
A 4-bit checkpoint's act-order layer comes with the order its packed inputs take (``input_order``, the same for the
matrices fused into one layer), which the packed weight keeps (``gemm.input_order``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pagellm.distributed.groups import SINGLE, ParallelState
from pagellm.model.weight_only import GroupsDoNotFit
from pagellm.ops import fused, gemm, gemm_w4a8, gemm_w8a8
from pagellm.ops.gemm import linear

_GROUP = gemm_w4a8.GROUP


def _param(shape: tuple[int, ...], dtype: torch.dtype, loader) -> nn.Parameter:  # noqa: ANN001
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def _loadable(param: nn.Parameter) -> torch.Tensor:
    """The parameter's data to copy a checkpoint tensor into; a packed weight takes no more loads."""
    if gemm.packed_shape(param) is not None:
        raise ValueError("this weight is already packed for the native GEMM (weights are packed once, after "
                         "loading); load the checkpoint into a newly built model")
    return param.data


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """``src`` into ``dst``, converted to its dtype in the same pass (a float16 matrix into bfloat16 natively)."""
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor for {what} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    if not fused.copy_float16(dst, src):
        dst.copy_(src)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's rows (output features) split across ranks; outputs stay sharded."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool, dtype: torch.dtype,
                 parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.shard_sizes = [parallel.shard(size, "output features") for size in out_sizes]
        self.offsets = [sum(self.shard_sizes[:i]) for i in range(len(out_sizes))]
        out = sum(self.shard_sizes)
        self.weight = _param((out, in_features), dtype, self._load)
        self.bias = _param((out,), dtype, self._load) if bias else None
        self.arrived: dict[int, bool] = {}  # the weight's matrices loaded: were they a checkpoint's 4-bit integers?

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        size = self.shard_sizes[shard_id]
        rank_slice = loaded.narrow(0, self.parallel.tp_rank * size, size)
        _copy(_loadable(param).narrow(0, self.offsets[shard_id], size), rank_slice, "column shard")
        if param is self.weight:
            self.arrived[shard_id] = loaded.dtype == torch.uint8

    def pack_weight(self) -> bool:
        return gemm.pack_parameter(self.weight)

    def expect_scales(self) -> None:
        """The checkpoint is quantized: take its per-output-channel ``weight_scale`` [N, 1] beside the int8 weight
        (sharded as the weight's rows are)."""
        self.weight_scale = _scale_param(self.weight.shape[0], lambda p, t, shard=0: self._load(p, t, shard))

    def expect_groups(self) -> None:
        """The checkpoint keeps 4-bit weights (``model/weight_only.py``): take each 32 inputs' ``(d, m)``
        [N, K / 32, 2] beside the weight's integers (sharded as the weight's rows are), and an act-order layer's
        ``input_order`` (every rank's, one for all the fused matrices)."""
        self.weight_groups = _groups_param(self.weight.shape, lambda p, t, shard=0: self._load(p, t, shard))
        self.input_order = _order_param(self.weight.shape[1], _load_order)

    def quantize_weight(self, method: str) -> bool:
        return _quantize(self, method, len(self.shard_sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one matrix; checkpoint shards ``"q"``, ``"k"``, ``"v"``."""

    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype, parallel: ParallelState = SINGLE) -> None:
        kv = num_kv_heads * head_dim
        super().__init__(hidden, [num_heads * head_dim, kv, kv], bias, dtype, parallel)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str = 0) -> None:
        super()._load(param, loaded, self.SHARDS[shard_id] if isinstance(shard_id, str) else shard_id)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shardᵀ) + b with W's columns (input features) split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 parallel: ParallelState = SINGLE, reduce: bool = True) -> None:
        super().__init__()
        self.parallel = parallel
        self.reduce = reduce  # False: the caller sums several partial outputs and all-reduces them once (experts)
        if bias and not reduce:
            raise ValueError("a row-parallel layer with a bias reduces its own output (the bias is added once)")
        self.in_shard = parallel.shard(in_features, "input features")
        self.weight = _param((out_features, self.in_shard), dtype, self._load)
        self.bias = _param((out_features,), dtype, self._load_bias) if bias else None
        self.arrived: dict[int, bool] = {}

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        rank_slice = loaded.narrow(1, self.parallel.tp_rank * self.in_shard, self.in_shard)
        _copy(_loadable(param), rank_slice, "row shard")
        self.arrived[0] = loaded.dtype == torch.uint8

    def _load_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        _copy(_loadable(param), loaded, "bias")

    def pack_weight(self) -> bool:
        return gemm.pack_parameter(self.weight)

    def expect_scales(self) -> None:
        """The checkpoint is quantized: take its ``weight_scale`` [N, 1] (one per output channel: every rank's)."""
        self.weight_scale = _scale_param(self.weight.shape[0], lambda p, t, shard=0: self._load_bias(p, t))

    def expect_groups(self) -> None:
        """The checkpoint keeps 4-bit weights: take each 32 inputs' ``(d, m)`` [N, K / 32, 2] (this rank's inputs'
        groups), and an act-order layer's ``input_order`` (on one rank only: the ranks' inputs are not its runs)."""
        self.weight_groups = _groups_param(self.weight.shape, self._load_groups)
        self.input_order = _order_param(self.in_shard, self._load_order)

    def _load_order(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        if self.parallel.tp_size > 1:
            raise GroupsDoNotFit("an act-order 4-bit layer's groups take inputs from every tensor-parallel rank's "
                                 "slice; serve this checkpoint on one rank to keep its 4-bit weights")
        _load_order(param, loaded, shard_id)

    def _load_groups(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        size = param.shape[1]
        if self.in_shard % _GROUP:
            raise GroupsDoNotFit(f"this rank's {self.in_shard} input features are not whole groups of {_GROUP}; "
                                 "serve this 4-bit checkpoint without --quantization or with fewer tensor-parallel "
                                 "ranks")
        _copy(param.data, loaded.narrow(1, self.parallel.tp_rank * size, size), "row shard's groups")
        param.loaded.add(shard_id)  # type: ignore[attr-defined]

    def quantize_weight(self, method: str) -> bool:
        return _quantize(self, method, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        y = self.parallel.all_reduce(y) if self.reduce else y
        return y + self.bias if self.bias is not None else y


class ReplicatedLinear(nn.Module):
    """y = x Wᵀ with the whole of W on every rank: small matrices whose output every rank needs whole, such as a
    mixture-of-experts router. Packed for the native GEMM in bfloat16, never quantized."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param((out_features, in_features), dtype, self._load)
        self.bias = _param((out_features,), dtype, self._load) if bias else None  # gpt-oss's router's

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        _copy(_loadable(param), loaded, "replicated weight")

    def pack_weight(self) -> bool:
        return gemm.pack_parameter(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _scale_param(rows: int, load) -> nn.Parameter:  # noqa: ANN001
    """A float32 [rows] scale Parameter whose loader flattens the checkpoint's [rows, 1] and records each shard it
    loads (``loaded``: q/k/v or gate/up of a fused layer)."""
    def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str = 0) -> None:
        load(param, loaded.reshape(-1), shard_id)
        param.loaded.add(shard_id)  # type: ignore[attr-defined]

    param = _param((rows,), torch.float32, loader)
    param.loaded = set()  # type: ignore[attr-defined]
    return param


def _groups_param(weight_shape: torch.Size, load) -> nn.Parameter:  # noqa: ANN001
    """A float32 [N, K / 32, 2] Parameter for a 4-bit checkpoint's groups whose loader records each shard it loads."""
    def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str = 0) -> None:
        load(param, loaded, shard_id)
        param.loaded.add(shard_id)  # type: ignore[attr-defined]

    n, k = weight_shape
    param = _param((n, -(-k // _GROUP), 2), torch.float32, loader)
    param.loaded = set()  # type: ignore[attr-defined]
    return param


def _order_param(inputs: int, load) -> nn.Parameter:  # noqa: ANN001
    """An int64 [K] Parameter for an act-order layer's ``input_order``, whose loader records each shard it loads."""
    param = _param((inputs,), torch.int64, load)
    param.loaded = set()  # type: ignore[attr-defined]
    return param


def _load_order(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str = 0) -> None:
    """One matrix's ``input_order``: the first sets the layer's; each other fused matrix must take the same."""
    if param.loaded and not torch.equal(param.data, loaded):
        raise GroupsDoNotFit("the matrices fused into one layer (q/k/v or gate/up) take their inputs in different "
                             "orders (act-order); their 4-bit weights cannot share one pass")
    _copy(param.data, loaded, "input order")
    param.loaded.add(shard_id)  # type: ignore[attr-defined]


def _quantize(layer: nn.Module, method: str, shards: int) -> bool:
    """Quantize and pack ``layer.weight`` for ``method``, or pack the int8 weight and scales a quantized checkpoint
    gave it (``expect_scales``; all ``shards`` of a fused layer, or none: a layer such a checkpoint left in float,
    its ``ignore`` list, is packed bfloat16). Returns whether the weight was packed."""
    if method not in gemm.QUANTIZED:
        raise ValueError(f"quantization={method!r} is not supported; use one of {', '.join(gemm.QUANTIZED)}")
    if layer.weight.dtype != torch.bfloat16:
        raise ValueError(f"quantization={method} runs on bfloat16 models; set dtype bfloat16 (this model is "
                         f"{layer.weight.dtype})")
    if hasattr(layer, "weight_groups"):
        return _pack_groups(layer, method, shards)
    scale = getattr(layer, "weight_scale", None)
    if scale is None:
        gemm.QUANTIZED[method].quantize_parameter(layer.weight)
        return True
    if method != gemm_w8a8.FORMAT:
        raise ValueError(f"this checkpoint's layers are {gemm_w8a8.FORMAT} already (compressed-tensors); serve it "
                         f"without quantization={method}")
    del layer.weight_scale  # packed into the weight, or not needed
    if not scale.loaded:
        return gemm.pack_parameter(layer.weight)
    if len(scale.loaded) != shards:
        raise ValueError(f"the checkpoint quantizes {len(scale.loaded)} of the {shards} matrices fused into one "
                         "layer (q/k/v or gate/up); pagellm serves them all quantized or all in float")
    gemm_w8a8.quantize_parameter(layer.weight, (layer.weight.data.to(torch.int8), scale.data))
    return True


def _pack_groups(layer: nn.Module, method: str, shards: int) -> bool:
    """Pack the 4-bit integers and groups a weight-only checkpoint gave the layer (``expect_groups``)."""
    groups, order = layer.weight_groups, layer.input_order
    del layer.weight_groups, layer.input_order
    if method not in gemm.FOUR_BIT:
        raise ValueError(f"this checkpoint's 4-bit groups pack only for {' or '.join(gemm.FOUR_BIT)}, not {method}")
    kernel = gemm.QUANTIZED[method]
    if not groups.loaded:  # a layer the checkpoint left in float (or a float model): quantized here
        kernel.quantize_parameter(layer.weight)
        return True
    if order.loaded and order.loaded != groups.loaded:
        raise GroupsDoNotFit("the 4-bit matrices fused into one layer (q/k/v or gate/up) are not all act-order; "
                             "their inputs would need two orders in one pass")
    d, m = groups[..., 0].half(), groups[..., 1].half()  # the weight holds the integers (exact in bfloat16)
    if len(groups.loaded) != shards:  # fused matrices some of which came in float (a GGUF's Q6_K v beside Q4_K q, k)
        for rows in _float_rows(layer, groups.loaded):
            w = layer.weight.data[rows] if not order.loaded else layer.weight.data[rows][:, order.data]
            q, d[rows], m[rows] = gemm_w4a8.quantize(w)
            layer.weight.data[rows] = q[:, :layer.weight.shape[1]].to(torch.bfloat16)
    kernel.quantize_parameter(layer.weight, (d, m))
    if order.loaded:
        layer.weight.input_order = order.data  # type: ignore[attr-defined]
    return True


def _float_rows(layer: ColumnParallelLinear, loaded: set[int | str]) -> list[slice]:
    """The rows of a fused layer's matrices that came without groups."""
    ids = {getattr(layer, "SHARDS", {}).get(shard, shard) for shard in loaded}
    return [slice(offset, offset + size) for i, (offset, size) in enumerate(zip(layer.offsets, layer.shard_sizes))
            if i not in ids]


def loaded_whole(layer: nn.Module) -> bool:
    """Whether every matrix of a layer's weight has come, each of a checkpoint's 4-bit ones with its groups, and no
    int8 checkpoint's scales are due, so that it can be quantized now, before the rest of the checkpoint comes: a
    quantized model's load then holds one layer in bfloat16 at a time, not all of them."""
    if len(layer.arrived) != len(getattr(layer, "shard_sizes", (0,))) or hasattr(layer, "weight_scale") or \
            gemm.packed_shape(layer.weight) is not None:
        return False
    groups = getattr(layer, "weight_groups", None)
    got = {getattr(layer, "SHARDS", {}).get(shard, shard) for shard in groups.loaded} if groups is not None else ()
    return all(shard in got for shard, four_bit in layer.arrived.items() if four_bit)


def pack_weights(model: nn.Module, quantization: str | None = None) -> int:
    """Pack the weight of every layer with a ``pack_weight`` hook (see the module docstring), once, after loading,
    or with a ``quantization`` quantize those with a ``quantize_weight`` hook (the ones the load has not quantized
    already, ``loaded_whole``); returns how many were packed or quantized (0 in float32 or where the native kernel
    does not run)."""
    packed = 0
    for module in model.modules():
        quantize = getattr(module, "quantize_weight", None) if quantization else None
        hook = getattr(module, "pack_weight", None)
        if quantize is not None:
            packed += gemm.packed_shape(module.weight) is not None or quantize(quantization)
        elif hook is not None:
            packed += bool(hook())
    return packed
