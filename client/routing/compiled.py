"""The router's compiled extension (``client/routing/_route.c``, built by ``pip install``), if it
was built from these sources.

Its functions' arguments change with the Python that calls them, so a build left from older
sources (a checkout updated without ``pip install -e .`` again) would fail mid-fold with a
TypeError. The extension states the interface it was built for (``ABI``); one that states
another, or none, is not used: the numpy path gives the same answers, more slowly, and a
warning says to rebuild.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

ROUTE_ABI = 4
"""The interface of ``_route.c`` these sources call (its ``ABI`` constant); raised with every
change of a function's arguments there."""

_warned = False


def load_route() -> ModuleType | None:
    """``kvtier.client.routing._route`` when it is built and of :data:`ROUTE_ABI`, else None."""
    global _warned
    try:
        _route = importlib.import_module("kvtier.client.routing._route")
    except ImportError:  # built by `pip install` where a C compiler and Python's headers exist
        return None
    abi = getattr(_route, "ABI", None)
    if abi == ROUTE_ABI:
        return _route
    if not _warned:
        _warned = True
        logging.getLogger("kvtier.router").warning(
            f"kvtier.client.routing._route was built from other sources (interface {abi}, these need "
            f"{ROUTE_ABI}): rebuild it with `pip install -e .`; the router uses its numpy path meanwhile")
    return None


PAIRS_ABI = 1
"""The interface of ``_pairs.c`` these sources call (its ``ABI`` constant)."""


def load_pairs() -> ModuleType | None:
    """``kvtier.client.routing._pairs`` when it is built and of :data:`PAIRS_ABI`, else None
    (the pairs index layout then refuses to start: it has no numpy path)."""
    try:
        _pairs = importlib.import_module("kvtier.client.routing._pairs")
    except ImportError:
        return None
    return _pairs if getattr(_pairs, "ABI", None) == PAIRS_ABI else None
