"""Clients' cache hints, read in the conventions they already use, as the retentions the gateway
asks the chosen replica's kvtierd for (``Node.Retain``).

* **OpenAI** ``prompt_cache_retention``: ``"24h"`` keeps the prompt's full blocks for 24 hours
  (86,400 s); ``"in_memory"`` (or ``"in-memory"``), the default, asks for nothing: the host
  tier's usual eviction is the in-memory cache. ``prompt_cache_key`` is the request's affinity
  key (the session, when no session header names one) and names its conversation.
* **Anthropic-style** ``cache_control`` breakpoints on messages or on their content parts,
  ``{"type": "ephemeral", "ttl": "5m" | "1h"}`` (default 5 minutes): the prefix up to the end of
  the message carrying the breakpoint (its full blocks in the rendered prompt) is kept that
  long. Several breakpoints each keep their own prefix; a shorter prefix kept longer by a later
  breakpoint is kept the longer TTL (the daemon keeps the later expiry of a key retained twice).
* **Dynamo** ``nvext.cache_control`` ``{"type": "ephemeral", "ttl": "30s" | "5m" | "1h" ...}``
  (default 5 minutes): the whole prompt's full blocks, that long. ``nvext.agent_hints.priority``
  (an integer) is the retention's priority (the daemon releases a tenant's lower priorities
  first when its budget needs room); without a TTL hint it asks for nothing.

A TTL is a number of seconds, or a string ``N`` followed by ``s``, ``m`` or ``h``; anything
longer than 24 hours is kept 24 hours, and a malformed hint is ignored (the replica ignores
these fields too: vLLM's OpenAI server takes unknown request fields and extra keys in messages
and parts without complaint). The request body is forwarded unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_TTL_S = 86400.0
"""The longest retention the daemon keeps (24 h)."""
DEFAULT_TTL_S = 300.0
"""``cache_control`` without a ``ttl``: Anthropic's and Dynamo's default, 5 minutes."""
RETENTION_24H = 86400.0
_TTL = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*")
_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
_INT32 = (-(1 << 31), (1 << 31) - 1)


def parse_ttl(value: Any, default: float = DEFAULT_TTL_S) -> float | None:
    """Seconds of a TTL (``"30s"``, ``"5m"``, ``"1h"``, a number of seconds; None: ``default``),
    at most 24 h; None when it is not one."""
    if value is None:
        return default
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        s = float(value)
    elif isinstance(value, str) and (m := _TTL.fullmatch(value)):
        s = float(m.group(1)) * _UNIT[m.group(2)]
    else:
        return None
    return min(s, MAX_TTL_S) if s > 0 and s == s else None


def _cache_control_ttl(cc: Any) -> float | None:
    """The TTL of a ``cache_control`` object (type ``ephemeral``), None when it is not one."""
    if not isinstance(cc, Mapping) or cc.get("type", "ephemeral") != "ephemeral":
        return None
    return parse_ttl(cc.get("ttl"))


@dataclass(frozen=True)
class Hints:
    """What a request asks to keep: ``whole_ttl`` for every full block of its prompt (0: none),
    ``breakpoints`` (message index, TTL) for the prefixes up to those messages' ends."""

    whole_ttl: float = 0.0
    breakpoints: tuple[tuple[int, float], ...] = ()
    priority: int = 0


def read_hints(body: Mapping[str, Any]) -> Hints | None:
    """The cache hints of a request body, None when it has none."""
    whole = 0.0
    if body.get("prompt_cache_retention") == "24h":
        whole = RETENTION_24H
    nvext = body.get("nvext")
    priority = 0
    if isinstance(nvext, Mapping):
        if "cache_control" in nvext:
            whole = max(whole, _cache_control_ttl(nvext["cache_control"]) or 0.0)
        agent = nvext.get("agent_hints")
        p = agent.get("priority") if isinstance(agent, Mapping) else None
        if isinstance(p, int) and not isinstance(p, bool):
            priority = min(max(p, _INT32[0]), _INT32[1])
    messages = body.get("messages")
    points = tuple((i, ttl) for i, m in enumerate(messages if isinstance(messages, list) else ())
                   if not (type(m) is dict and "cache_control" not in m and type(m.get("content")) is str)
                   and (ttl := _message_ttl(m)) is not None)  # (the first test: a plain message, no hint)
    if not whole and not points:
        return None
    return Hints(whole, points, priority)


def _message_ttl(m: Any) -> float | None:
    """The longest TTL of the ``cache_control`` on a message or its content parts, None: none."""
    if not isinstance(m, Mapping):
        return None
    ttl = _cache_control_ttl(m["cache_control"]) if "cache_control" in m else None
    content = m.get("content")
    for part in content if isinstance(content, list) else ():
        if isinstance(part, Mapping) and "cache_control" in part:
            t = _cache_control_ttl(part["cache_control"])
            if t is not None:
                ttl = max(ttl or 0.0, t)
    return ttl


def retains(hints: Hints, n_keys: int, breakpoint_keys: Sequence[int]) -> list[tuple[int, float]]:
    """(leading keys, TTL) to retain: the whole prompt's and each breakpoint's (``breakpoint_keys``:
    the keys up to each breakpoint, in ``hints.breakpoints`` order), without those another one
    covers (as long a prefix, kept at least as long)."""
    wanted = [(n_keys, hints.whole_ttl)] if hints.whole_ttl else []
    wanted += [(min(n, n_keys), ttl) for n, (_, ttl) in zip(breakpoint_keys, hints.breakpoints, strict=True)]
    out: list[tuple[int, float]] = []
    for n, ttl in sorted((w for w in wanted if w[0] > 0), key=lambda w: (-w[0], -w[1])):
        if all(ttl > t for _, t in out):  # (out: longer prefixes) kept longer than any of them
            out.append((n, ttl))
    return out


def breakpoint_tokens(tokenizer: Any, body: Mapping[str, Any], text: str, ends: Any, index: int) -> int:
    """Tokens of the rendered prompt ``text`` up to the end of message ``index``: the template
    rendered over the messages up to it (no generation prompt), the characters it shares with
    ``text``, and the tokens that end within them (``ends``: each token's end offset in
    ``text``; None: the shared text tokenized alone)."""
    import numpy as np  # noqa: PLC0415

    from kvtier.client.gateway.incremental import common_prefix_len  # noqa: PLC0415

    head, add_special = tokenizer.chat_text({**body, "messages": body["messages"][:index + 1],
                                             "add_generation_prompt": False, "continue_final_message": False})
    c = common_prefix_len(head, text)
    if ends is not None:
        return int(np.searchsorted(ends, c, side="right"))
    return len(tokenizer.encode(text[:c], add_special))
