"""LoRA adapters (PEFT's format) applied per request, many adapters and the base model in one batch.

Contract:
- ``LoRARequest(lora_name, lora_int_id, lora_path)``, as vLLM names it, goes with a request
  (``LLM.generate(..., lora_request=...)``; it travels on ``SamplingParams.lora_request``); the engine must be
  started with ``enable_lora=True``. ``lora_int_id`` (>= 1) identifies the adapter: the same id must always mean the
  same directory.
- An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``
  among q/k/v/o/gate/up/down_proj, ``bias`` "none") and ``adapter_model.safetensors`` (``lora_A`` [r, in] and
  ``lora_B`` [out, r] per adapted projection of a decoder layer). ``check_adapter`` checks all of that, and each
  matrix's shape against the model, before a request is queued (a ValueError that names the problem); LoRA on the
  embeddings or the LM head, per-module ranks and biases are refused there.
- In a step, the tokens of every request with an adapter get ``scale * (x @ A.T) @ B.T`` added to each adapted
  projection's output (scale ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA), as PEFT computes it;
  other tokens are untouched. Such steps run the Python layers (the native decoder stack has no adapters). The
  prefix cache keys an adapted request's blocks by its adapter id (a cache salt), so KV computed under one adapter is
  never read under another or under none.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # vLLM's layer names


def target_projections(modules: Any) -> frozenset[str] | None:
    """vLLM's ``lora_target_modules`` (module suffixes: its packed ``qkv_proj`` and ``gate_up_proj``, or a
    projection's own name) as the projections adapters may touch; None: all (ValueError naming an unknown one)."""
    if modules is None:
        return None
    names: set[str] = set()
    for module in modules:
        if module not in PACKED and module not in PROJECTIONS:
            raise ValueError(f"lora_target_modules: {module!r} is not a decoder layer's module; use "
                             f"{', '.join([*PACKED, 'o_proj', 'down_proj'])} or one of {', '.join(PROJECTIONS)}")
        names.update(PACKED.get(module, (module,)))
    return frozenset(names)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")

    @property
    def cache_salt(self) -> str:
        return f"lora-{self.lora_int_id}"


def _config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {str(path)!r}: cannot read adapter_config.json ({exc})") from None
    if config.get("bias", "none") != "none" or config.get("rank_pattern") or config.get("alpha_pattern") or \
            config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {str(path)!r}: biases, per-module ranks and modules_to_save are not "
                         "supported; train it with bias='none' and one rank")
    return config


def _scale(config: dict[str, Any]) -> float:
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def expected_shapes(arch: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a decoder layer of ``arch`` (a ``model.arch.ArchConfig``) that an adapter may
    adapt: the attention's only in a mixture of experts (adapters on experts are not served)."""
    q, kv, hidden, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size, \
        arch.intermediate_size
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q)}
    if getattr(arch, "moe", None) is None:
        shapes.update({"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)})
    return shapes


def _tensors(path: Path, arch: Any, load: bool) -> dict[tuple[int, str, str], Any]:
    """(layer, projection, "A"|"B") → tensor (or only its shape, unless ``load``), checked against ``arch``."""
    from safetensors import safe_open

    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: no adapter_model.safetensors")
    shapes, found = expected_shapes(arch), {}
    with safe_open(str(file), "pt" if load else "numpy") as handle:  # numpy: the frontend's checks load no torch
        for key in handle.keys():
            match = _KEY.search(key)
            if match is None or match.group(2) not in shapes or int(match.group(1)) >= arch.num_layers:
                experts = " (a mixture of experts: adapters on its experts are not served)" \
                    if len(shapes) < len(PROJECTIONS) else ""
                raise ValueError(f"LoRA adapter {str(path)!r}: tensor {key!r} is not a LoRA matrix of a decoder "
                                 f"layer's {', '.join(shapes)}{experts}")
            layer, name, part = int(match.group(1)), match.group(2), match.group(3)
            found[(layer, name, part)] = handle.get_tensor(key) if load else tuple(handle.get_slice(key).get_shape())
    for layer, name in sorted({(layer, name) for layer, name, _ in found}):
        a, b = found.get((layer, name, "A")), found.get((layer, name, "B"))
        a_shape, b_shape = (tuple(t.shape) if load else t for t in (a, b)) if a is not None and b is not None \
            else (None, None)
        out, inp = shapes[name]
        if a_shape is None or b_shape is None or a_shape[1] != inp or b_shape[0] != out or a_shape[0] != b_shape[1]:
            raise ValueError(f"LoRA adapter {str(path)!r}: layer {layer} {name} has lora_A {a_shape} and lora_B "
                             f"{b_shape}; the model needs lora_A [r, {inp}] and lora_B [{out}, r]")
    return found


def check_adapter(request: LoRARequest, arch: Any, max_rank: int | None = None) -> None:
    """Raise ValueError unless ``request`` names an adapter this model can apply, of a rank no higher than
    ``max_rank`` (``max_lora_rank``; None: any); nothing is loaded."""
    path = Path(request.lora_path).expanduser()
    config = _config(path)
    rank = int(config.get("r", 0))
    if rank < 1:
        raise ValueError(f"LoRA adapter {str(path)!r}: adapter_config.json needs a rank r >= 1")
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"LoRA adapter {str(path)!r} has rank {rank}, above max_lora_rank {max_rank}; start the "
                         f"engine with max_lora_rank >= {rank} (--max-lora-rank)")
    _tensors(path, arch, load=False)


# The projections each fused layer of model/llama.py makes in one GEMM, in its output order: an adapter's A matrices
# of a group are stacked so that one product with x serves them all.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


# The groups whose layer is row-parallel under tensor parallelism: each rank holds a slice of the input, so its
# product with A is partial and is summed over the ranks before B (a rank-sized all-reduce).
ROW_PARALLEL = (("o_proj",), ("down_proj",))


@dataclass
class Adapter:
    # (layer, group) → (the group's adapted A matrices stacked and transposed, [in, sum of ranks]; per adapted
    # projection, its index in the group, its columns of the stacked product and its B matrix times the scale)
    groups: dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, list[tuple[int, slice, torch.Tensor]]]]

    @classmethod
    def load(cls, request: LoRARequest, arch: Any, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
             targets: frozenset[str] | None = None) -> Adapter:
        """The adapter for one tensor-parallel rank: B's rows of a column-parallel group (q/k/v, gate/up) and A's
        columns of a row-parallel one (o, down) cut as the layer is; only the ``targets`` projections (the
        engine's ``lora_target_modules``; None: all the adapter has)."""
        import torch

        path = Path(request.lora_path).expanduser()
        config = _config(path)
        scale, found = _scale(config), _tensors(path, arch, load=True)

        def cut(matrix: torch.Tensor, dim: int) -> torch.Tensor:
            width = matrix.shape[dim] // tp_size
            return matrix.narrow(dim, tp_rank * width, width)

        groups = {}
        for layer in range(arch.num_layers):
            for names in GROUPS:
                adapted = [(i, name) for i, name in enumerate(names)
                           if (layer, name, "A") in found and (targets is None or name in targets)]
                if not adapted:
                    continue
                row = names in ROW_PARALLEL
                parts, at = [], 0
                for i, name in adapted:
                    rank, b = found[(layer, name, "A")].shape[0], found[(layer, name, "B")]
                    parts.append((i, slice(at, at + rank), ((b if row else cut(b, 0)) * scale).to(dtype)))
                    at += rank
                a = torch.cat([found[(layer, name, "A")] for _, name in adapted])
                groups[(layer, names)] = ((cut(a, 1) if row else a).T.to(dtype).contiguous(), parts)
        return cls(groups)


class LoRABatch:
    """One step's adapters: for each, the flat token rows of its requests (a slice when they are one run of rows,
    as when one adapter serves the whole step; else an index tensor)."""

    def __init__(self, groups: list[tuple[Adapter, Any]], parallel: Any = None) -> None:
        self.groups = groups
        self.parallel = parallel  # a ParallelState with tensor-parallel ranks, or None

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, parts: tuple[tuple[str, int, int], ...]) -> None:
        """Add each adapter's ``scale * (x @ A.T) @ B.T`` to its rows of ``y``, for the projections ``parts``
        ((name, first output column, width), one of ``GROUPS`` in order) of the fused layer that made ``y``."""
        names = tuple(name for name, _, _ in parts)
        for adapter, rows in self.groups:
            stacked = adapter.groups.get((layer, names))
            if stacked is None:
                continue
            a_t, adapted = stacked
            low = x[rows] @ a_t  # [rows, sum of ranks]
            if self.parallel is not None and names in ROW_PARALLEL:  # x was this rank's slice: sum the ranks'
                low = self.parallel.all_reduce(low.contiguous())
            for i, ranks, b in adapted:
                _, start, width = parts[i]
                delta = low[:, ranks] @ b.T
                if isinstance(rows, slice):
                    y[rows, start:start + width] += delta
                else:
                    y[rows, start:start + width] = y[rows, start:start + width] + delta


class WorkerAdapters:
    """The worker's side: each adapter loaded once (by id: one id, one adapter) and kept while there is room, the
    live requests that run with one, and each step's ``LoRABatch``. With a ``capacity`` (``max_cpu_loras``) the
    least recently used adapters that no live request runs with are dropped once more are loaded than it allows
    (those in use stay, even past it)."""

    def __init__(self, arch: Any, dtype: torch.dtype, parallel: Any = None, capacity: int | None = None,
                 targets: frozenset[str] | None = None) -> None:
        self.arch, self.dtype = arch, dtype
        self.targets = targets  # the projections adapters may touch (lora_target_modules; None: all)
        self.parallel = parallel if parallel is not None and parallel.tp_size > 1 else None  # tensor-parallel ranks
        self.capacity = capacity
        self.loaded: OrderedDict[int, Adapter] = OrderedDict()  # least recently used first
        self.live: dict[str, LoRARequest] = {}  # request id → its adapter

    def track(self, req_id: str, request: LoRARequest | None) -> None:
        if request is not None:
            self.live[req_id] = request

    def release(self, req_id: str) -> None:
        self.live.pop(req_id, None)

    def batch(self, req_ids: list[str], query_start_loc: Any) -> LoRABatch | None:
        """The step's adapters and the flat token rows of each one's requests (None: no request has one)."""
        if not self.live:
            return None
        rows: dict[LoRARequest, list[int]] = {}
        for j, req_id in enumerate(req_ids):
            request = self.live.get(req_id)
            if request is not None:
                rows.setdefault(request, []).extend(range(query_start_loc[j], query_start_loc[j + 1]))
        if not rows:
            return None
        return LoRABatch([(self._adapter(request), _rows(r)) for request, r in rows.items()], self.parallel)

    def _adapter(self, request: LoRARequest) -> Adapter:
        adapter = self.loaded.get(request.lora_int_id)
        if adapter is not None:
            self.loaded.move_to_end(request.lora_int_id)
            return adapter
        rank, size = (self.parallel.tp_rank, self.parallel.tp_size) if self.parallel is not None else (0, 1)
        adapter = self.loaded[request.lora_int_id] = Adapter.load(request, self.arch, self.dtype, rank, size,
                                                                  self.targets)
        self._evict()
        return adapter

    def _evict(self) -> None:
        """Drop least recently used adapters no live request runs with, down to ``capacity`` if that is possible."""
        if self.capacity is None or len(self.loaded) <= self.capacity:
            return
        in_use = {request.lora_int_id for request in self.live.values()}
        for lora_id in [i for i in self.loaded if i not in in_use][:len(self.loaded) - self.capacity]:
            del self.loaded[lora_id]


def _rows(rows: list[int]) -> Any:
    """Token rows as a slice when they are one run (no gather, no scatter), else as an index tensor."""
    import torch

    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.int64)
