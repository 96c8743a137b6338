"""The KV connector's configuration (``EngineConfig.kv_transfer_config``; the connector is ``connector.py``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

KV_CONNECTORS = ("SharedStorageConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill and decode: KV blocks handed between engines (``disagg/connector.py``), vLLM's
    ``--kv-transfer-config`` JSON: ``{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"shared_storage_path": "/path"}}``. A producer saves its prompts' full blocks; a
    consumer loads the stored blocks that prefix a new request's prompt instead of computing them."""

    kv_connector: str | None = None
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector is None:
            return
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector {self.kv_connector!r} is not available; use one of "
                             f"{', '.join(KV_CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        path = self.kv_connector_extra_config.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ValueError("SharedStorageConnector needs kv_connector_extra_config.shared_storage_path, the folder "
                             "the engines share")
        unknown = set(self.kv_connector_extra_config) - {"shared_storage_path", "max_storage_bytes"}
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}; use shared_storage_path "
                             "and max_storage_bytes")
        self.max_storage_bytes  # noqa: B018 (checked now, not at the first save)

    @property
    def max_storage_bytes(self) -> int | None:
        """The store's size limit (a producer prunes the least recently used blocks past it), or None."""
        from pagellm.config import parse_size

        value = self.kv_connector_extra_config.get("max_storage_bytes")
        return None if value is None else parse_size(value, "max_storage_bytes")

    def check_engine(self, prefix_caching: bool, world_size: int, lora: bool,
                     speculative_method: str | None) -> None:
        """What the connector cannot hand over is refused, naming the way out."""
        if self.kv_connector is None:
            return
        if not prefix_caching:
            raise ValueError("kv_transfer_config needs enable_prefix_caching (stored blocks are found by the prefix "
                             "cache's block hashes)")
        if world_size > 1 or lora or speculative_method not in (None, "ngram"):
            raise ValueError("kv_transfer_config runs with tensor_parallel_size and pipeline_parallel_size 1, "
                             "without LoRA and without draft-model speculation (their KV is not handed over)")

    @property
    def saves(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: KVTransferConfig | dict | str | None) -> KVTransferConfig:
        if value is None or isinstance(value, KVTransferConfig):
            return value or cls()
        spec = value
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_transfer_config is not valid JSON ({exc})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {spec!r}")
        unknown = set(spec) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {sorted(unknown)}; use kv_connector, kv_role and "
                             "kv_connector_extra_config")
        return cls(**spec)
