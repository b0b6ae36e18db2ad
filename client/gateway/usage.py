"""A response's output token count, read from its bytes as the gateway streams them back
(for ``--record-trace``'s ``output_length``).

* Not streaming (``application/json``): the body's ``usage.completion_tokens`` (OpenAI's and
  vLLM's answers carry it). The body is kept only up to :data:`MAX_BODY_BYTES`.
* Streaming (``text/event-stream``): a chunk's ``usage.completion_tokens`` when the server
  sends one (the client asked ``stream_options: {"include_usage": true}``; the last such
  value wins), else the number of chunks that carry output (a choice with non-empty
  ``delta.content``, ``delta.reasoning_content``, ``delta.tool_calls`` or ``text``): vLLM
  sends one token a chunk, so that is its output tokens; a server that batches tokens per
  chunk is undercounted.
* Anything else (an error status, another content type, a compressed body): unknown (None).
"""

from __future__ import annotations

import json
from typing import Any

MAX_BODY_BYTES = 4 << 20
"""A non-streaming answer larger than this is not parsed (unknown output)."""
MAX_EVENT_BYTES = 1 << 20
"""An SSE event larger than this is skipped (not counted)."""


class OutputCounter:
    """Feed it every byte of one answer (:meth:`start` first, per attempt); :meth:`tokens`."""

    def __init__(self) -> None:
        self.start("", 0)

    def start(self, content_type: str, status: int) -> None:
        ct = content_type.split(";")[0].strip().lower()
        self._mode = "" if status != 200 else ("sse" if ct == "text/event-stream" else
                                               "json" if ct == "application/json" else "")
        self._buf = bytearray()
        self._skip = False
        self.usage: int | None = None
        self.chunks = 0

    def feed(self, data: bytes) -> None:
        if not self._mode or not data:
            return
        if self._mode == "json":
            if not self._skip:
                self._buf += data
                if len(self._buf) > MAX_BODY_BYTES:
                    self._skip, self._buf = True, bytearray()
            return
        self._buf += data
        while True:
            i = self._buf.find(b"\n\n")
            j = self._buf.find(b"\r\n\r\n")
            if i < 0 and j < 0:
                break
            if j >= 0 and (i < 0 or j < i):
                event, cut = bytes(self._buf[:j]), j + 4
            else:
                event, cut = bytes(self._buf[:i]), i + 2
            del self._buf[:cut]
            self._event(event)
        if len(self._buf) > MAX_EVENT_BYTES:
            self._buf = bytearray()

    def _event(self, event: bytes) -> None:
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload or payload == b"[DONE]":
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            if isinstance(obj, dict):
                self._chunk(obj)

    def _chunk(self, obj: dict[str, Any]) -> None:
        u = _completion_tokens(obj)
        if u is not None:
            self.usage = u
        for c in obj.get("choices") or ():
            if isinstance(c, dict) and _has_output(c):
                self.chunks += 1
                break

    def tokens(self) -> int | None:
        """The answer's output tokens, or None when they cannot be told."""
        if self._mode == "json":
            if self._skip or not self._buf:
                return None
            try:
                obj = json.loads(self._buf)
            except ValueError:
                return None
            return _completion_tokens(obj) if isinstance(obj, dict) else None
        if self._mode == "sse":
            return self.usage if self.usage is not None else self.chunks
        return None


def _completion_tokens(obj: dict[str, Any]) -> int | None:
    u = obj.get("usage")
    if isinstance(u, dict):
        n = u.get("completion_tokens")
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
            return n
    return None


def _has_output(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    d = choice.get("delta")
    return isinstance(d, dict) and bool(d.get("content") or d.get("reasoning_content") or d.get("tool_calls"))


class _NullCounter:
    """Counts nothing (not recording)."""

    def start(self, content_type: str, status: int) -> None:
        pass

    def feed(self, data: bytes) -> None:
        pass


NULL_COUNTER: Any = _NullCounter()
