"""The ``kvtier_*`` keys of vLLM's ``kv_connector_extra_config`` (the package docstring lists them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.client.engine import adapter
from kvtier.client.engine.adapter import NOT_NEGATIVE, POSITIVE, setting

COPY_MODES = ("auto", "daemon", "process")
EXTRA_CONFIG = "kv_connector_extra_config"


@dataclass(frozen=True)
class KvtierSettings:
    """The ``kvtier_*`` keys of ``kv_connector_extra_config``, parsed by the adapters' one parser
    (:func:`kvtier.client.engine.adapter.parse_extra`): unknown ``kvtier_*`` keys are refused."""

    socket: str | None = None
    model: str | None = None
    tenant: str = ""
    timeout_s: float = adapter.timeout_setting("vllm")
    register_timeout_s: float = setting(600.0, bound=POSITIVE)
    retry_s: float = adapter.retry_setting("vllm")
    settle_s: float = setting(60.0, bound=NOT_NEGATIVE)
    copy: str = setting("auto", choices=COPY_MODES)
    events_max_keys: int = 65536
    events_scan: int = 1024

    @classmethod
    def from_extra(cls, extra: Any) -> KvtierSettings:
        return adapter.parse_extra(cls, extra, EXTRA_CONFIG)
