"""Refusals: a request the daemon will not carry out, as a domain error.

:class:`StoreError` carries a :class:`Code` and a message a person can act on. The codes are
named after the gRPC status codes the service layer answers with (``kvtier.daemon.services``
maps them); the domain modules never deal with the wire. A refused request changes nothing.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence

from kvtier.tiers.layout import MAX_LAYOUTS, MAX_SLOT_SIZES
from kvtier.tiers.vocab import KEY_MAX, KEY_MIN, key_problem

MAX_NAME_CHARS = 256
"""The most characters of a name a client sends (client_name, worker_id, subscriber)."""


class Code(enum.Enum):
    """Why a request is refused; each name is the gRPC status code it is answered with."""

    INVALID_ARGUMENT = enum.auto()     # malformed: change the request
    FAILED_PRECONDITION = enum.auto()  # not now / not here: register, open a session, add a disk tier
    RESOURCE_EXHAUSTED = enum.auto()   # capacity
    NOT_FOUND = enum.auto()            # names something that is not there (any more)
    CANCELLED = enum.auto()            # the caller's session ended while the request ran
    PERMISSION_DENIED = enum.auto()    # names something another caller or tenant owns
    UNAUTHENTICATED = enum.auto()      # no valid credential
    DEADLINE_EXCEEDED = enum.auto()    # a grant, lease or wait outlived its deadline
    INTERNAL = enum.auto()             # a bug: logged with its traceback


class StoreError(Exception):
    """A request the daemon refuses; ``code`` says how it is answered."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_keys(keys: Sequence[bytes], limit: int, *, unique: bool) -> None:
    """Refuse (INVALID_ARGUMENT) a batch of more than ``limit`` keys, a key of a bad length, or
    (``unique``) a key named twice."""
    if len(keys) > limit:
        raise StoreError(Code.INVALID_ARGUMENT,
                         f"{len(keys)} keys in one request; the limit is {limit} (--max-batch-keys): split the batch")
    lengths = set(map(len, keys)) if keys and set(map(type, keys)) == {bytes} else None
    if lengths is None or min(lengths) < KEY_MIN or max(lengths) > KEY_MAX:  # (C loops first: the hot path)
        for i, k in enumerate(keys):
            why = key_problem(k)
            if why is not None:
                raise StoreError(Code.INVALID_ARGUMENT,
                                 f"key {i} is {why}" if why[0].isdigit() else f"key {i}: {why}")
    if unique and len(set(keys)) != len(keys):
        dup = next(k for k, n in Counter(keys).items() if n > 1)
        raise StoreError(Code.INVALID_ARGUMENT, f"key {dup.hex()} appears more than once in one batch; send each key once")


def check_ids(ids: Sequence[object], limit: int, what: str, more: Sequence[object] = ()) -> None:
    """Refuse (INVALID_ARGUMENT) a request naming more than ``limit`` ids (``ids`` and ``more``
    together: a commit's grants and aborts), or one id twice."""
    n = len(ids) + len(more)
    if n > limit:
        raise StoreError(Code.INVALID_ARGUMENT,
                         f"{n} {what} ids in one request; the limit is {limit} (--max-batch-keys): split the batch")
    if len(set(ids).union(more)) != n:
        raise StoreError(Code.INVALID_ARGUMENT, f"a {what} id appears twice in one request; name each once")


def check_name(value: str, what: str, limit: int = MAX_NAME_CHARS) -> None:
    """Refuse (INVALID_ARGUMENT) a name longer than ``limit`` characters."""
    if len(value) > limit:
        raise StoreError(Code.INVALID_ARGUMENT,
                         f"{what} is {len(value)} characters; the limit is {limit}")


def check_layout_room(layouts: int, slot_sizes: int, new_slot_size: bool, tenant_layouts: int = 0,
                      tenant_slot_sizes: int = 0, layouts_share: int = 0, slot_sizes_share: int = 0) -> None:
    """Refuse (RESOURCE_EXHAUSTED) a new layout beyond :data:`~kvtier.tiers.layout.MAX_LAYOUTS`,
    or one that needs a new slot size (a new pool file and fd) beyond
    :data:`~kvtier.tiers.layout.MAX_SLOT_SIZES`; and, so that no tenant takes them all, one
    beyond its tenant's share of either (``tenant_layouts`` and ``tenant_slot_sizes`` are the
    registering tenant's; a share of 0: none of its own)."""
    if layouts >= MAX_LAYOUTS:
        raise StoreError(Code.RESOURCE_EXHAUSTED,
                         f"{layouts} layouts are registered; the limit is {MAX_LAYOUTS} layouts per daemon")
    if layouts_share and tenant_layouts >= layouts_share:
        raise StoreError(Code.RESOURCE_EXHAUSTED,
                         f"this tenant has registered {tenant_layouts} layouts; the limit is {layouts_share} layouts "
                         f"per tenant (--max-layouts-per-tenant)")
    if new_slot_size and slot_sizes >= MAX_SLOT_SIZES:
        raise StoreError(Code.RESOURCE_EXHAUSTED,
                         f"{slot_sizes} slot sizes are in use; the limit is {MAX_SLOT_SIZES} slot sizes (pool "
                         f"files) per daemon: this layout's block size needs a new one")
    if new_slot_size and slot_sizes_share and tenant_slot_sizes >= slot_sizes_share:
        raise StoreError(Code.RESOURCE_EXHAUSTED,
                         f"this tenant's layouts use {tenant_slot_sizes} slot sizes; the limit is {slot_sizes_share} "
                         f"slot sizes (pool files) per tenant (--max-slot-sizes-per-tenant): this layout's block "
                         f"size needs a new one")
