"""The gateway ranks a request once: the replica it tries is dispatched on that ranking.

``Policy.choose`` asks the router for a ranking of the healthy replicas (not dispatched); the
gateway then dispatches the replica it sends the request to on that ranking
(:meth:`Router.dispatch`) instead of ranking that replica again
(``route(keys, [replica], dispatch=True, top_k=1)``). Both must decide alike, request after
request: the same replica order, the same load charged, the same speculative entries (so the
same next turns), the same fetch hints, the same new-session counts. Two routers with the same
feeds are driven side by side, one each way, and compared at every step.

``--key-group N``: the KV-cache group the gateway's vLLM keys name.
"""

from __future__ import annotations

import hashlib

import pytest

from kvtier.client.engine.keys import Namespace
from kvtier.client.gateway.keys import KeyScheme
from kvtier.client.gateway.policy import Policy
from kvtier.client.routing.router import Router, RouterConfig, RouterError

FP = b"f" * 16
NAMES = ["a1", "a2", "b1", "c1"]


def key(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def cluster(spread: float) -> Router:
    """Three nodes (four workers); node A holds a shared prefix on a1's GPU and in its host
    tier, node B a second prefix in host only; every node can pull (a remote tier), so a
    worker elsewhere counts A's and B's host blocks as remote and gets fetch hints."""
    r = Router(RouterConfig(new_session_spread=spread, new_session_share=0.8))
    idx = r.index
    bw = {"host": 40.0, "disk": 2.0, "remote": 10.0}
    idx.set_node_info("A", {"a1": [FP], "a2": [FP]}, load_gbps=bw)
    idx.set_node_info("B", {"b1": [FP]}, load_gbps=bw)
    idx.set_node_info("C", {"c1": [FP]}, load_gbps=bw)
    shared = [key("sys", i) for i in range(24)]
    idx.stored("A", "gpu", "a1", FP, shared[:16])
    idx.stored("A", "host", "", FP, shared)
    idx.stored("B", "host", "", FP, [key("doc", i) for i in range(40)])
    return r


def requests() -> list[tuple[str, list[bytes]]]:
    """(session, keys): multi-turn sessions on the shared prefixes and on their own, turns
    interleaved, each turn its session's previous keys and more."""
    out = []
    for turn in range(4):
        for s in range(9):
            base = [key("sys", i) for i in range(24)] if s % 3 == 0 else \
                [key("doc", i) for i in range(40)] if s % 3 == 1 else []
            out.append((f"s{s}", base + [key("s", s, i) for i in range(8 * (turn + 1))]))
    return out


def state(r: Router) -> tuple:
    return (tuple((w, r.load(w)) for w in NAMES), tuple(sorted(r._sessions.items())))


@pytest.mark.parametrize("spread", [0.0, 0.25])
def test_dispatch_on_a_ranking_decides_as_ranking_the_replica_again(spread: float) -> None:
    again, once = cluster(spread), cluster(spread)
    live: list[tuple[int, int]] = []
    now = 1000.0
    for step, (_, keys) in enumerate(requests()):
        now += 0.5
        orders = []
        for r in (again, once):
            ranking = r.route(keys, NAMES, dispatch=False, top_k=len(NAMES), now=now)
            orders.append(([x.worker for x in ranking.ranked], [x.saved_blocks for x in ranking.ranked], ranking))
        assert orders[0][:2] == orders[1][:2], step
        # the first replica, or (a retry after a refusal) the second
        name = orders[0][0][step % 5 == 4]
        d_again = again.route(keys, [name], dispatch=True, top_k=1, now=now)
        d_once = once.dispatch(orders[1][2], name, keys, now=now)
        assert d_once.worker == d_again.worker == name
        assert d_once.fetch == d_again.fetch, step
        assert state(once) == state(again), step
        live.append((d_again.decision_id, d_once.decision_id))
        if step % 3 == 2:  # requests end out of order
            a, b = live.pop(len(live) // 2)
            assert again.finish(a) and once.finish(b)
    assert any(d.fetch for d in [once.dispatch(once.route(k, NAMES, dispatch=False, now=now), "c1", k, now=now)
                                 for _, k in requests()[:3]])  # the workload makes fetch hints


@pytest.mark.parametrize("sessions", [True, False])
def test_the_gateway_policy_ranks_once_and_dispatches_the_same_replicas(sessions: bool) -> None:
    """Through the gateway's policy (``kvtier``): the order chosen and the decisions after it
    are those of ranking the chosen replica again, whether the ranking is dispatched on its
    first replica in the same call (``choose(..., dispatch=True)``: no session held on another
    replica) or afterwards."""
    again, once, fused = cluster(0.0), cluster(0.0), cluster(0.0)
    pol_again, pol_once, pol_fused = Policy("kvtier", again), Policy("kvtier", once), Policy("kvtier", fused)
    n_fused = n_sticky = 0
    for step, (session, keys) in enumerate(requests()):
        session = session if sessions else None
        if step % 5 == 4:  # keys no replica holds: with a session, back to the session's replica
            keys = [key("fresh", step, i) for i in range(6)]
        c_again = pol_again.choose(NAMES, keys, session)
        c_once = pol_once.choose(NAMES, keys, session)
        c_fused = pol_fused.choose(NAMES, keys, session, dispatch=True)
        assert c_once.order == c_again.order == c_fused.order
        assert c_once.overlap == c_again.overlap == c_fused.overlap
        name = c_once.order[0]
        for pol in (pol_again, pol_once, pol_fused):
            pol.dispatched(name, keys, session)
        d_again = again.route(keys, [name], dispatch=True, top_k=1)
        d_once = once.dispatch(c_once.ranking, name, keys)
        d_fused = c_fused.ranking if c_fused.dispatched else fused.dispatch(c_fused.ranking, name, keys)
        n_fused += c_fused.dispatched
        n_sticky += name != c_fused.ranking.workers[0]
        assert not c_again.dispatched and not c_once.dispatched
        assert d_once.fetch == d_again.fetch == d_fused.fetch
        assert d_fused.worker == name and d_fused.decision_id
        assert state(once) == state(again) == state(fused)
    assert n_fused >= (len(requests()) if not sessions else 9)  # (a session's first turn holds nowhere)
    assert (n_sticky > 0) == sessions


def test_dispatch_refuses_a_worker_outside_the_ranking() -> None:
    r = cluster(0.0)
    keys = [key("x", i) for i in range(4)]
    ranking = r.route(keys, ["a1", "b1"], dispatch=False)
    with pytest.raises(RouterError, match="not in the ranking"):
        r.dispatch(ranking, "c1", keys)
    with pytest.raises(RouterError, match="keys"):
        r.dispatch(ranking, "a1", keys[:2])


def test_key_group_names_the_group_in_the_vllm_keys(tmp_path) -> None:
    """A gateway with ``--key-group 3`` keys blocks as kvtier's vLLM spec keys group 3's
    chunks (the offload key's 4 group bytes), not group 0's."""
    pytest.importorskip("transformers")
    from kvtier.client.gateway.server import Gateway, GatewayConfig, SettingsError, check_settings
    from testsupport.tiny_tokenizer import build_tokenizer

    tok = build_tokenizer(str(tmp_path / "tok"))
    toks = list(range(3, 3 + 16))
    ns = Namespace("tiny", "")
    gw = Gateway(GatewayConfig(replicas=("a=http://127.0.0.1:9",), model="tiny", tokenizer=tok, block_tokens=4,
                               policy="round-robin", key_group=3))
    h = KeyScheme("vllm", 4, ns).vllm_block_hashes(toks)
    want = [hashlib.blake2b(b + (3).to_bytes(4, "big") + bytes(4), digest_size=16, key=ns.digest()).digest()
            for b in h]
    assert gw.keys.keys(toks) == want
    assert want != KeyScheme("vllm", 4, ns).keys(toks)  # group 0's keys differ
    spec = pytest.importorskip("kvtier.client.vllm")  # (imports vLLM)
    assert want == [k for b in h for k in spec.KeyMap(ns, 1).chunk(b + (3).to_bytes(4, "big"))]
    with pytest.raises(SettingsError, match="key-group"):
        check_settings(GatewayConfig(replicas=("a=http://127.0.0.1:9",), model="tiny", tokenizer=tok, key_group=-1))
