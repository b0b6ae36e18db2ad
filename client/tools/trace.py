"""``kvtier trace``: make and inspect request traces for ``kvtier replay`` and ``kvtier measure``.

    kvtier trace from-chat LOG.jsonl --tokenizer DIR --block-tokens N [-o OUT]
    kvtier trace stats TRACE.jsonl [--json]

``from-chat`` turns OpenAI-format chat logs into a trace (traces/README.md's format), with no
serving stack: one request a line, a JSON object with

* ``messages`` (OpenAI chat messages; ``content`` a string or a list of ``{"type": "text",
  "text": ...}`` parts) and optionally ``tools`` (OpenAI tool definitions), either at the top
  level or under ``request`` (a logged request body; the fields below may be in either, the
  top level's win);
* ``timestamp``: milliseconds (any origin) or an ISO 8601 string; or ``created`` (seconds, as
  in OpenAI responses);
* optionally ``session_id`` (or ``conversation_id``): written as the trace's ``session_id``;
* optionally ``output_length``, else ``usage.completion_tokens`` (top level or under
  ``response``): the trace's ``output_length`` (0 when neither is given).

Tokens: the tokenizer in DIR (a Hugging Face tokenizer directory: ``tokenizer.json``,
``tokenizer_config.json``), read locally, never downloaded. With a chat template (the
tokenizer config's ``chat_template``, or ``chat_template.jinja`` beside it) each request is
rendered as an engine renders it (``apply_chat_template`` with ``add_generation_prompt``, the
tools passed as ``tools``) and tokenized without adding special tokens, as vLLM's chat endpoint
does. Without one, the *plain rendering*: ``tools: <the tools as JSON>\\n`` when there are
tools, then ``<role>: <content>\\n`` per message, then ``assistant:``, tokenized with the
tokenizer's special tokens. ``transformers`` does the rendering when installed; otherwise the
``tokenizers`` library and ``jinja2`` do.

Hash ids: the tokens' full blocks of ``--block-tokens`` are chained like kvtier keys
(:func:`kvtier.client.engine.keys.block_keys`: a block's key covers it and everything
before it), and each distinct key becomes a small integer, first seen first. So two requests
have equal ids exactly as far as they share whole blocks of tokens from the start. The
partial last block gets no id (engines cache whole blocks only); ``input_length`` counts every
token. Records are written in timestamp order, timestamps in ms from the first request.

``stats`` prints a trace's requests, blocks, distinct blocks and *ideal prefix hit rate*: the
share of blocks whose id an earlier request already had (one cache of unbounded size, every
request sent to it: what no deployment can beat).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from kvtier.client.engine.keys import Namespace, block_keys

TRACE_NAMESPACE = Namespace("kvtier-trace")
"""Keys of a trace made from logs never meet a deployment's (its ids are renumbered anyway)."""


# -- tokenizing --------------------------------------------------------------------------------

def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def plain_rendering(messages: Sequence[dict], tools: Sequence[dict] | None) -> str:
    """The rendering of a request for a tokenizer without a chat template (module docstring)."""
    parts = []
    if tools:
        parts.append(f"tools: {json.dumps(list(tools), sort_keys=True)}\n")
    for m in messages:
        parts.append(f"{m.get('role', 'user')}: {_text(m.get('content'))}\n")
    parts.append("assistant:")
    return "".join(parts)


class ChatTokenizer:
    """A local tokenizer that turns a chat request into the token ids an engine would see."""

    def __init__(self, path: str, use_transformers: bool | None = None) -> None:
        """``use_transformers``: render and tokenize with ``transformers`` (None: when installed)
        or with ``tokenizers`` and ``jinja2`` (False)."""
        if not os.path.isdir(path):
            raise ValueError(f"--tokenizer {path}: not a directory (a Hugging Face tokenizer directory with "
                             f"tokenizer.json)")
        self.path = path
        self.template = self._template_file()
        try:
            if use_transformers is False:
                raise ImportError("not asked for")
            from transformers import AutoTokenizer  # noqa: PLC0415 - optional, heavy
        except ImportError:
            if use_transformers:
                raise
            self._hf = None
            self._init_plain()
        else:
            self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
            if self.template is None:
                self.template = getattr(self._hf, "chat_template", None) or None
            elif not getattr(self._hf, "chat_template", None):
                self._hf.chat_template = self.template

    def _template_file(self) -> str | None:
        cfg = os.path.join(self.path, "tokenizer_config.json")
        if os.path.exists(cfg):
            with open(cfg) as fh:
                t = json.load(fh).get("chat_template")
            if isinstance(t, list):  # named templates: the default one
                t = next((x.get("template") for x in t if x.get("name") == "default"), None)
            if isinstance(t, str) and t:
                return t
        jinja = os.path.join(self.path, "chat_template.jinja")
        if os.path.exists(jinja):
            with open(jinja) as fh:
                return fh.read()
        return None

    def _init_plain(self) -> None:
        from tokenizers import Tokenizer  # noqa: PLC0415

        tj = os.path.join(self.path, "tokenizer.json")
        if not os.path.exists(tj):
            raise ValueError(f"--tokenizer {self.path}: no tokenizer.json (and transformers is not installed)")
        self._tok = Tokenizer.from_file(tj)
        cfg_path = os.path.join(self.path, "tokenizer_config.json")
        self._special: dict[str, Any] = {}
        if os.path.exists(cfg_path):
            with open(cfg_path) as fh:
                cfg = json.load(fh)
            for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
                v = cfg.get(k)
                self._special[k] = v.get("content") if isinstance(v, dict) else v
        self._jinja = None
        if self.template is not None:
            import jinja2  # noqa: PLC0415
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

            def raise_exception(msg: str) -> None:
                raise jinja2.exceptions.TemplateError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = raise_exception
            self._jinja = env.from_string(self.template)

    def encode(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """The token ids of one chat request (module docstring)."""
        if self.template is not None:
            if self._hf is not None:
                kw = {"tools": list(tools)} if tools else {}
                text = self._hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True, **kw)
                return list(self._hf.encode(text, add_special_tokens=False))
            assert self._jinja is not None
            text = self._jinja.render(messages=list(messages), tools=list(tools) if tools else None,
                                      add_generation_prompt=True, **self._special)
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        text = plain_rendering(messages, tools)
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=True))
        return list(self._tok.encode(text, add_special_tokens=True).ids)


# -- chat logs into a trace ----------------------------------------------------------------------

def _timestamp_ms(rec: dict, where: str) -> float:
    ts = rec.get("timestamp")
    if ts is None and rec.get("created") is not None:
        return float(rec["created"]) * 1000.0
    if isinstance(ts, bool) or ts is None:
        raise ValueError(f"{where}: no timestamp (ms, or ISO 8601) nor created (s)")
    if isinstance(ts, (int, float)):
        return float(ts)
    if isinstance(ts, str):
        try:
            t = dt.datetime.fromisoformat(ts.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"{where}: timestamp {ts!r} is neither ms nor ISO 8601") from None
        if t.tzinfo is None:
            t = t.replace(tzinfo=dt.timezone.utc)
        return t.timestamp() * 1000.0
    raise ValueError(f"{where}: timestamp {ts!r} is neither ms nor ISO 8601")


def _output_length(rec: dict) -> int:
    if rec.get("output_length") is not None:
        return int(rec["output_length"])
    for holder in (rec, rec.get("response") or {}):
        usage = holder.get("usage") if isinstance(holder, dict) else None
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            return int(usage["completion_tokens"])
    return 0


def parse_chat_line(line: str, where: str) -> tuple[float, list[dict], list[dict] | None, str | None, int]:
    """(timestamp ms, messages, tools, session id, output length) of one log line."""
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: not a JSON object")
    body = rec.get("request") if isinstance(rec.get("request"), dict) else rec
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"{where}: no messages (a non-empty list of {{role, content}} objects)")
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"{where}: tools must be a list")
    meta = {**body, **rec} if body is not rec else rec   # fields outside the request body win
    sess = meta.get("session_id", meta.get("conversation_id"))
    return _timestamp_ms(meta, where), messages, tools, None if sess is None else str(sess), _output_length(meta)


def chat_to_trace(lines: Iterable[str], tokenizer: ChatTokenizer, block_tokens: int,
                  source: str = "log") -> list[dict]:
    """Trace records (time-ordered, ids renumbered from 0) of the chat requests in ``lines``."""
    if block_tokens < 1:
        raise ValueError("--block-tokens must be >= 1")
    raw = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        ts, messages, tools, sess, out = parse_chat_line(line, f"{source}:{n}")
        tokens = tokenizer.encode(messages, tools)
        raw.append((ts, n, tokens, sess, out))
    raw.sort(key=lambda r: (r[0], r[1]))
    ids: dict[bytes, int] = {}
    t0 = raw[0][0] if raw else 0.0
    records = []
    for ts, _, tokens, sess, out in raw:
        keys = block_keys(tokens, block_tokens, TRACE_NAMESPACE) if len(tokens) >= block_tokens else []
        rec: dict[str, Any] = {"timestamp": round(ts - t0, 3), "input_length": len(tokens), "output_length": out,
                               "hash_ids": [ids.setdefault(k, len(ids)) for k in keys]}
        if sess is not None:
            rec["session_id"] = sess
        records.append(rec)
    return records


def ideal_hit_rate(hash_id_lists: Iterable[Sequence[int]]) -> tuple[float, int, int]:
    """(ideal prefix hit rate, blocks, distinct blocks): the share of blocks an earlier request
    already had, with one unbounded cache that sees every request."""
    seen: set[int] = set()
    hits = total = 0
    for ids in hash_id_lists:
        for h in ids:
            total += 1
            hits += h in seen
        seen.update(ids)
    return (hits / total if total else 0.0), total, len(seen)


def trace_stats(path: str) -> dict[str, Any]:
    """``kvtier trace stats`` of one trace file."""
    from kvtier.client.tools.replay import load_trace  # noqa: PLC0415

    reqs = load_trace(path)
    rate, blocks, distinct = ideal_hit_rate(r.keys for r in reqs)
    span = (reqs[-1].arrival_s - reqs[0].arrival_s) if reqs else 0.0
    sessions = {r.session for r in reqs if r.session is not None}
    tokens = sum(r.input_tokens for r in reqs)
    return {"trace": path, "requests": len(reqs), "sessions": len(sessions), "span_s": span, "input_tokens": tokens,
            "blocks": blocks, "distinct_blocks": distinct, "ideal_prefix_hit_rate": rate}


# -- command line --------------------------------------------------------------------------------

def build_parser(prog: str = "kvtier trace") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Make and inspect request traces for kvtier replay.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    fc = sub.add_parser("from-chat", help="OpenAI-format chat logs (JSONL) -> a trace, with a local tokenizer",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fc.add_argument("log", help="JSONL: one chat request a line (messages, optional tools, timestamp, optional "
                                "session_id)")
    fc.add_argument("--tokenizer", required=True, metavar="DIR", help="local Hugging Face tokenizer directory")
    fc.add_argument("--block-tokens", type=int, required=True, metavar="N",
                    help="tokens per block: your engines' block size (vLLM --block-size)")
    fc.add_argument("-o", "--output", metavar="OUT", help="trace file to write (default: stdout)")
    st = sub.add_parser("stats", help="requests, blocks and the ideal prefix hit rate of a trace")
    st.add_argument("trace")
    st.add_argument("--json", action="store_true", help="one JSON object")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "stats":
            s = trace_stats(args.trace)
            print(json.dumps(s) if args.json else
                  f"{s['trace']}: {s['requests']} requests ({s['sessions']} sessions) over {s['span_s']:.1f} s, "
                  f"{s['blocks']} blocks ({s['distinct_blocks']} distinct); ideal prefix hit rate "
                  f"{s['ideal_prefix_hit_rate']:.4f}")
            return 0
        tok = ChatTokenizer(args.tokenizer)
        with open(args.log) as fh:
            records = chat_to_trace(fh, tok, args.block_tokens, args.log)
    except OSError as e:
        print(f"kvtier trace: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"kvtier trace: {e}", file=sys.stderr)
        return 2
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    rate, blocks, distinct = ideal_hit_rate(r["hash_ids"] for r in records)
    print(f"kvtier trace: {len(records)} requests, {blocks} blocks of {args.block_tokens} tokens ({distinct} "
          f"distinct), ideal prefix hit rate {rate:.4f}; template: "
          f"{'the tokenizer' + chr(39) + 's chat template' if tok.template else 'plain rendering'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
