"""The gateway's incremental prompts (:mod:`kvtier.client.gateway.incremental`): on every turn of
multi-turn conversations, the block keys and token counts computed from the conversation's
stored last turn are byte-identical to the ones computed from scratch.

Conversations: synthetic ones (a system prompt, tools, assistant tool calls and tool results,
reasoning that the template drops from earlier turns once a new user message arrives, edits
to earlier messages, dropped turns, a changed system prompt, an assistant prefill), and ones
built from the coding-agent sessions of ``../shared/traces/agentic_sessions.jsonl`` (each
block id becomes text of its own; a request's history is what it shares with the session's
previous request, so the trace's own rewrites of earlier context are edits here too).

Tokenizers, all built here from nothing downloaded: the word-level test tokenizer, a
byte-level BPE with ChatML special tokens (offsets trimmed of their leading spaces), and a
SentencePiece-style BPE (Metaspace, a space marker prepended to the text) whose template has no
special tokens, so restarts cut between ordinary tokens.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.client.engine.keys import Namespace
from kvtier.client.gateway import incremental
from kvtier.client.gateway.incremental import PromptCache, common_prefix_len
from kvtier.client.gateway.keys import KeyScheme
from kvtier.client.gateway.tokenize import PromptTokenizer

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from testsupport.tiny_tokenizer import build_tokenizer  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "agentic_sessions.jsonl"

SYLLABLES = ["ka", "lo", "mi", "tra", "sen", "vor", "qu", "ex", "in", "on", "de", "ra", "stu", "fel", "an",
             "or", "ix", "ble", "pro", "get", "set", "_id", "Json", "Http"]
ODD = ["é", "中文", "🙂", "naïve", "\t", "  ", "\n\n", "...", "(", ")", "{", "}", ":", "->", "0x1F", "42"]


def word(rng: random.Random) -> str:
    if rng.random() < 0.08:
        return rng.choice(ODD)
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))


def text(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        out.append(word(rng))
        out.append(rng.choice([" ", " ", " ", " ", ", ", ". ", "\n", "  "]))
    return "".join(out).strip()


# -- tokenizers ------------------------------------------------------------------------------------

CHATML = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are helpful.{% endif %}

# Tools
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m['role'] == 'system' and loop.first %}
{%- elif m['role'] == 'assistant' %}<|im_start|>assistant
{% set c = m['content'] or '' %}{% if loop.index0 < ns.last_user and '</think>' in c %}\
{{ c.split('</think>')[-1].lstrip() }}{% else %}{{ c }}{% endif %}
{%- for tc in m['tool_calls'] or [] %}
<tool_call>{"name": "{{ tc['function']['name'] }}", "arguments": {{ tc['function']['arguments'] }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif m['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ m['content'] }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA2 = """\
{%- for m in messages %}
{%- if m['role'] == 'system' %}<<SYS>>
{{ m['content'] }}
<</SYS>>

{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]
{%- elif m['role'] == 'tool' %}[TOOL] {{ m['content'] }} [/TOOL]
{%- else %} {{ m['content'] }}
{% endif %}
{%- endfor %}"""


def _corpus(n: int = 3000) -> Iterator[str]:
    rng = random.Random(1)
    for _ in range(n):
        yield text(rng, 30)
    yield json.dumps(TOOLS)


def _save(tok, path: str, template: str, **special) -> str:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.chat_template = template
    fast.save_pretrained(path)
    return path


def byte_bpe(path: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=1500, special_tokens=specials,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                          show_progress=False))
    return _save(tok, path, CHATML, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def metaspace_bpe(path: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = sorted(set("".join(_corpus(300))) | set("".join(ODD)) | set("[]/<>SYINTOL"))
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=1500, special_tokens=["<unk>", "<s>", "</s>"],
                                                          initial_alphabet=alphabet, show_progress=False))
    return _save(tok, path, LLAMA2, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def word_level(path: str) -> str:
    return build_tokenizer(path)


TOKENIZERS = {"byte-bpe-chatml": byte_bpe, "metaspace-bpe": metaspace_bpe, "word-level": word_level}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, PromptTokenizer]:
    return {name: PromptTokenizer(build(str(tmp_path_factory.mktemp(name)))) for name, build in TOKENIZERS.items()}


# -- conversations ---------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}} for n in ("read", "grep")]


def words_text(rng: random.Random, n: int) -> str:
    """Text the word-level tokenizer knows (tok3 .. tok1023)."""
    return " ".join(f"tok{rng.randrange(3, 1000)}" for _ in range(n))


def synthetic(seed: int, turns: int, wordy: bool) -> Iterator[dict]:
    """One conversation's requests, turn by turn: tools, tool calls and results, reasoning the
    template drops later, and edits of earlier messages."""
    rng = random.Random(seed)
    say = (lambda n: words_text(rng, n)) if wordy else (lambda n: text(rng, n))
    msgs: list[dict] = [{"role": "system", "content": say(40)}, {"role": "user", "content": say(60)}]
    tools = None if wordy or seed % 3 == 0 else TOOLS
    for turn in range(turns):
        body = {"model": "tiny", "messages": [dict(m) for m in msgs], "max_tokens": 8}
        if tools:
            body["tools"] = tools
        if not wordy and turn == turns - 1 and seed % 2:  # an assistant prefill
            body["messages"].append({"role": "assistant", "content": say(5)})
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        yield body
        think = "" if wordy else f"<think>{say(12)}</think>\n"
        if tools and rng.random() < 0.5:
            msgs.append({"role": "assistant", "content": think + say(6), "tool_calls": [
                {"id": f"c{turn}", "type": "function",
                 "function": {"name": "read", "arguments": json.dumps({"path": say(2)})}}]})
            msgs.append({"role": "tool", "tool_call_id": f"c{turn}", "content": say(rng.randint(20, 120))})
        else:
            msgs.append({"role": "assistant", "content": think + say(rng.randint(5, 40))})
            msgs.append({"role": "user", "content": say(rng.randint(5, 80))})
        edit = rng.random()
        if turn % 4 == 3 and edit < 0.4:  # an earlier message edited in the middle
            i = rng.randrange(1, len(msgs) - 1)
            c = msgs[i]["content"]
            cut = rng.randrange(len(c) // 3, len(c) - 1) if len(c) > 3 else 0
            msgs[i] = {**msgs[i], "content": c[:cut] + " " + say(3) + c[cut:]}
        elif turn % 4 == 3 and edit < 0.6:  # the last exchange dropped (a regenerated answer)
            del msgs[-2:]
            msgs.append({"role": "user", "content": say(10)})
        elif turn % 4 == 3 and edit < 0.7:  # a changed system prompt
            msgs[0] = {"role": "system", "content": say(41)}


def _trace(n_sessions: int, max_turns: int) -> dict[str, list[list[int]]]:
    """The first ``n_sessions`` sessions' first ``max_turns`` requests (their first 48 blocks)."""
    sessions: dict[str, list[list[int]]] = {}
    with open(TRACE) as f:
        for line in f:
            r = json.loads(line)
            s = sessions.setdefault(r["session_id"], [])
            if len(s) < max_turns:
                s.append(r["hash_ids"][:48])
            if len(sessions) >= n_sessions and all(len(v) >= max_turns for v in sessions.values()):
                break
    return dict(list(sessions.items())[:n_sessions])


def _kept(msgs: list[tuple[dict, list[int]]], shared: int, block) -> tuple[list, int]:
    """The messages within the first ``shared`` blocks; the one the run ends in is cut there."""
    kept, used = [], 0
    for m, blocks in msgs:
        if used + len(blocks) <= shared:
            kept.append((m, blocks))
            used += len(blocks)
            continue
        if shared > used:
            part = blocks[:shared - used]
            kept.append(({**m, "content": " ".join(block(h) for h in part)}, part))
            used = shared
        break
    return kept, used


def trace_sessions(n_sessions: int, max_turns: int, words_per_block: int, wordy: bool) -> Iterator[list[dict]]:
    """Conversations of agentic_sessions.jsonl: each request's messages carry its blocks' text;
    the blocks it shares with the session's previous request are that request's messages (the
    one the shared run ends in cut there: an edit), the rest new assistant, tool and user turns."""

    def block(h: int) -> str:
        rng = random.Random(h)
        return words_text(rng, words_per_block) if wordy else text(rng, words_per_block)

    for sid, reqs in _trace(n_sessions, max_turns).items():
        msgs: list[tuple[dict, list[int]]] = []  # (message, its blocks)
        prev: list[int] = []
        bodies = []
        for turn, ids in enumerate(reqs):
            shared = 0
            while shared < min(len(ids), len(prev)) and ids[shared] == prev[shared]:
                shared += 1
            msgs, used = _kept(msgs, shared, block)
            new = ids[used:]
            if not msgs:
                head, new = new[:2], new[2:]
                msgs.append(({"role": "system", "content": " ".join(block(h) for h in head)}, head))
            roles = ["assistant", "tool" if turn % 2 else "user"] if msgs[-1][0]["role"] != "assistant" else ["user"]
            while new:
                role = roles[0] if len(roles) == 1 else roles.pop(0)
                cut = max(1, len(new) // 2) if role == "assistant" else len(new)
                take, new = new[:cut], new[cut:]
                m = {"role": role, "content": " ".join(block(h) for h in take)}
                if role == "tool":
                    m["tool_call_id"] = f"{sid}-{turn}"
                msgs.append((m, take))
            if msgs[-1][0]["role"] == "assistant":
                msgs.append(({"role": "user", "content": block(turn)}, []))
            body = {"model": "tiny", "messages": [dict(m) for m, _ in msgs], "max_tokens": 8}
            if not wordy and zlib.crc32(sid.encode()) & 1:
                body["tools"] = TOOLS
            bodies.append(body)
            prev = ids
        yield bodies


# -- the comparison ----------------------------------------------------------------------------------


def compare(tok: PromptTokenizer, scheme: KeyScheme, conversations, cache: PromptCache | None = None,
            scope=lambda body: "", client=lambda body: "") -> PromptCache:
    """Every request of every conversation: the incremental keys and token count equal the
    ones computed from scratch (the gateway's tokenizer and key scheme, nothing stored)."""
    cache = PromptCache(tok, scheme, 64 << 20) if cache is None else cache
    for conv in conversations:
        for turn, body in enumerate(conv):
            ids = tok.chat(body)
            keys, n = cache.chat(body, scope(body), client=client(body))
            assert n == len(ids), (turn, n, len(ids))
            assert keys == scheme.keys(ids), f"turn {turn}: keys differ from the ones computed from scratch"
    return cache


SCHEMES = [("vllm", 16, 1), ("vllm", 4, 4), ("tokens", 16, 1)]


@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
@pytest.mark.parametrize("scheme,bt,chunk", SCHEMES)
def test_synthetic_conversations_key_as_from_scratch(tokenizers, tok_name, scheme, bt, chunk) -> None:
    tok = tokenizers[tok_name]
    ks = KeyScheme(scheme, bt, Namespace("tiny", "salt"), chunk_blocks=chunk)
    convs = [list(synthetic(seed, 12, wordy=tok_name == "word-level")) for seed in range(8)]
    cache = compare(tok, ks, convs)
    assert cache.counts["hit"] >= 0.6 * sum(len(c) for c in convs), cache.counts  # the incremental path ran


@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
def test_agentic_trace_sessions_key_as_from_scratch(tokenizers, tok_name) -> None:
    if not TRACE.exists():
        pytest.skip(f"{TRACE} is not there")
    tok = tokenizers[tok_name]
    ks = KeyScheme("vllm", 16, Namespace("tiny", "salt"))
    convs = list(trace_sessions(10, 25, 6, wordy=tok_name == "word-level"))
    assert sum(len(c) for c in convs) >= 100
    cache = compare(tok, ks, convs)
    assert cache.counts["hit"] >= 0.5 * sum(len(c) for c in convs), cache.counts


def test_the_comparison_catches_stale_state(tokenizers, monkeypatch) -> None:
    """A cache that trusted its conversation key (took the stored text as still valid, as a key
    of the opening messages alone would) reuses stale keys after an edit: the comparison above
    fails on it."""
    tok = tokenizers["byte-bpe-chatml"]
    ks = KeyScheme("vllm", 16, Namespace("tiny", "salt"))
    monkeypatch.setattr(incremental, "common_prefix_len", lambda a, b: min(len(a), len(b)))
    convs = [list(synthetic(seed, 12, wordy=False)) for seed in range(8)]
    with pytest.raises(AssertionError):
        compare(tok, ks, convs)


def test_shared_openings_and_interleaved_conversations(tokenizers) -> None:
    """Conversations that open alike but then differ (one opening, many branches) and turns of
    several conversations interleaved: every request still keys as from scratch, and requests
    of another client scope never find each other's entries."""
    tok = tokenizers["byte-bpe-chatml"]
    ks = KeyScheme("vllm", 16, Namespace("tiny", "salt"))
    convs = [list(synthetic(100 + s, 8, wordy=False)) for s in range(4)]
    for c in convs[1:]:  # the same opening for all four
        for body in c:
            body["messages"][:2] = convs[0][0]["messages"][:2]
    interleaved = [[body for turn in zip(*convs, strict=True) for body in turn]]
    cache = compare(tok, ks, interleaved)
    assert cache.counts["hit"] > 0
    assert len(cache) == 1  # one opening: one entry, replaced by each branch (text checked every time)
    compare(tok, ks, interleaved, cache, scope=lambda body: f"client-{id(body) % 3}")


def encoded_chars(cache: PromptCache, monkeypatch) -> list[int]:
    """The number of characters each of ``cache``'s tokenizer calls is given, as they run."""
    chars: list[int] = []
    enc = cache._encode
    monkeypatch.setattr(cache, "_encode", lambda t, at=0: (chars.append(len(t) - at), enc(t, at))[1])
    return chars


def test_an_earlier_turn_arriving_late_leaves_the_later_turns_entry(tokenizers, monkeypatch) -> None:
    """Turns of one conversation sent at once arrive out of order: an earlier turn, whose text
    the stored one extends, keys as from scratch from the stored entry and leaves it in place,
    so the next turn tokenizes only what is new since the latest turn (as many characters as
    in order); a turn that is not a prefix of the stored text (an edit) replaces it."""
    tok = tokenizers["byte-bpe-chatml"]
    ks = KeyScheme("vllm", 16, Namespace("tiny", "salt"))
    rng = random.Random(11)
    msgs: list[dict] = [{"role": "system", "content": text(rng, 30)}]
    turns = []
    for _ in range(5):
        msgs = [*msgs, {"role": "user", "content": text(rng, 50)}]
        turns.append({"model": "tiny", "messages": msgs})
        msgs = [*msgs, {"role": "assistant", "content": text(rng, 20)}]
    texts = [tok.chat_text(b)[0] for b in turns]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))

    def encoded(order: list[int]) -> tuple[list[int], PromptCache]:
        cache = PromptCache(tok, ks, 64 << 20)
        chars = encoded_chars(cache, monkeypatch)
        compare(tok, ks, [[turns[i] for i in order]], cache)
        return chars, cache

    in_order, _ = encoded([0, 1, 2, 3])
    late, cache = encoded([0, 2, 1, 3])
    assert late[-1] == in_order[-1]  # turn 3 from turn 2's entry, not turn 1's
    (entry,) = cache._d.values()
    assert entry.text == texts[3]
    repeated, cache = encoded([0, 1, 2, 3, 4, 1, 2, 3])
    (entry,) = cache._d.values()
    assert entry.text == texts[4] and max(repeated[5:]) < len(texts[1]) // 4
    edited = {**turns[2], "messages": [*turns[2]["messages"][:-1], {"role": "user", "content": "changed"}]}
    compare(tok, ks, [[edited]], cache)
    (entry,) = cache._d.values()
    assert entry.text == tok.chat_text(edited)[0]


@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
def test_new_conversations_start_from_one_that_opened_alike(tokenizers, tok_name, monkeypatch) -> None:
    """Sessions of one agent (each its own session id) share a long system prompt and tools:
    the first request of each session after the first tokenizes only what follows the shared
    opening (its keys as from scratch), counted ``shared``; another client never starts from
    them, and a conversation whose opening differs tokenizes in full."""
    tok = tokenizers[tok_name]
    ks = KeyScheme("vllm", 16, Namespace("tiny", "salt"))
    wordy = tok_name == "word-level"
    rng = random.Random(21)
    say = (lambda n: words_text(rng, n)) if wordy else (lambda n: text(rng, n))
    system = say(400)
    sessions = [[{"model": "tiny", "messages": [{"role": "system", "content": system},
                                                {"role": "user", "content": say(30)}]}] for _ in range(4)]
    cache = PromptCache(tok, ks, 64 << 20)
    chars = encoded_chars(cache, monkeypatch)
    sid = {id(c[0]): f"session-{i}" for i, c in enumerate(sessions)}
    compare(tok, ks, sessions, cache, scope=lambda body: sid[id(body)])
    first, later = chars[0], chars[1:]
    assert len(later) == 3 and max(later) < first // 4, chars
    assert cache.counts["shared"] == 3 and cache.counts["scratch"] == 1, cache.counts
    chars.clear()
    compare(tok, ks, sessions[:1], cache, scope=lambda body: "another-client",
            client=lambda body: "another-client")
    assert chars[0] >= first and cache.counts["scratch"] == 2  # (not from the first client's)
    other = [{"model": "tiny", "messages": [{"role": "system", "content": say(400)},
                                            {"role": "user", "content": say(30)}]}]
    chars.clear()
    compare(tok, ks, [other], cache)
    assert cache.counts["scratch"] == 3 and cache.counts["shared"] == 3


def test_memory_is_bounded_and_evicts_least_recent(tokenizers) -> None:
    tok = tokenizers["byte-bpe-chatml"]
    ks = KeyScheme("vllm", 16, Namespace("tiny", "salt"))
    convs = [list(synthetic(200 + s, 4, wordy=False)) for s in range(20)]
    one = PromptCache(tok, ks, 1 << 30)
    compare(tok, ks, convs[:1], one)
    budget = 3 * one.bytes
    cache = PromptCache(tok, ks, budget)
    compare(tok, ks, convs, cache)
    assert 0 < cache.bytes <= budget and 1 <= len(cache) <= 4
    off = PromptCache(tok, ks, 0)
    compare(tok, ks, convs[:2], off)
    assert len(off) == 0 and off.counts["hit"] == 0


def test_common_prefix_len() -> None:
    rng = random.Random(3)
    for _ in range(300):
        a = "".join(rng.choice("ab中") for _ in range(rng.randrange(0, 40)))
        b = a[:rng.randrange(0, len(a) + 1)] + "".join(rng.choice("ab中") for _ in range(rng.randrange(0, 5)))
        want = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == want == common_prefix_len(b, a)


def test_keyless_policies_do_not_tokenize(tokenizers, tmp_path) -> None:
    """round-robin and session order replicas without keys: their requests are checked (a bad
    one is still a 400) but never rendered, tokenized or hashed."""
    from kvtier.client.gateway.server import Gateway, GatewayConfig

    tok_dir = str(tmp_path / "tok")
    build_tokenizer(tok_dir)
    for policy in ("round-robin", "session", "kvtier"):
        cfg = GatewayConfig(replicas=("a=http://127.0.0.1:9",), model="tiny", tokenizer=tok_dir, block_tokens=4,
                            policy=policy)
        gw = Gateway(cfg)
        try:
            req = type("Req", (), {"headers": {}})()
            body = {"model": "tiny", "messages": [{"role": "user", "content": "tok3 tok4 tok5 tok6 tok7"}]}
            err, keys, _, n = gw._decide("chat", json.dumps(body).encode(), req)
            assert err is None
            assert (keys, n, sum(gw.prompts.counts.values())) == (([], 0, 0) if policy != "kvtier" else
                                                                  (keys, 5, 1)) and (policy != "kvtier" or keys)
            bad = {**body, "chat_template_kwargs": {"chat_template": "x"}}
            err, *_ = gw._decide("chat", json.dumps(bad).encode(), req)
            assert err is not None and err.status == 400
        finally:
            gw._pool.shutdown(wait=False)
            if gw.router is not None:
                gw.router.close()

