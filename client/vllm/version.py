"""The vLLM versions :mod:`kvtier.client.vllm` is written and tested against (no vLLM import)."""

from __future__ import annotations

import os
import re

SUPPORTED_VLLM = ((0, 32), (0, 34))
"""vLLM versions this package is written and tested against: at least the first, below the second."""

_VERSION_OVERRIDE_ENV = "KVTIER_VLLM_ANY_VERSION"


def _parse_version(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    if m is None:
        raise ImportError(f"kvtier.client.vllm: cannot read the vLLM version {text!r}")
    return int(m.group(1)), int(m.group(2))


def check_vllm_version(version: str) -> None:
    """Raise ImportError unless ``version`` is in :data:`SUPPORTED_VLLM` (or the override is set)."""
    lo, hi = SUPPORTED_VLLM
    if lo <= _parse_version(version) < hi or os.environ.get(_VERSION_OVERRIDE_ENV) == "1":
        return
    raise ImportError(
        f"kvtier.client.vllm supports vLLM >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]} (its KV offloading API is "
        f"experimental and changes between minor versions); this is vLLM {version}. Install a supported "
        f"vLLM (pip install -e '.[vllm]' in a kvtier checkout), or set {_VERSION_OVERRIDE_ENV}=1 to try anyway.")
