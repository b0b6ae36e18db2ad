"""Test and benchmark support that is not part of kvtier's wheel: a tiny Llama and a local
tokenizer (:mod:`testsupport.tiny_model`, :mod:`testsupport.tiny_tokenizer`) and a vLLM engine
runner (:mod:`testsupport.vllm_engine`). The real daemon in a subprocess, which ``kvtier demo``
uses too, is shipped: :mod:`kvtier.client.tools.local_daemon`.

Importable from a checkout: pytest puts the checkout's root on ``sys.path`` (pyproject's
``pythonpath``), the benchmarks insert it themselves, and a subprocess started with
``python -m testsupport...`` gets it from :func:`subprocess_env`.
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout this package is in."""


def subprocess_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the checkout's root first on
    ``PYTHONPATH``, so ``python -m testsupport.<module>`` finds this package."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env
