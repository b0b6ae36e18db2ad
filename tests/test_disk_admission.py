"""Disk admission: every host victim goes to disk while the disk's write queue has
room; the seen-often filter applies only beyond it (TierPolicy.demotions, the daemon's and the
replay's rule)."""

from __future__ import annotations

from kvtier.tiers.policy import DISK, TierPolicy


def _policy(room: int | None, cap: int | None = None) -> TierPolicy:
    p = TierPolicy(0, 4, 100, demote_min_seen=2)
    p.put(["a", "b", "c", "d"])   # seen once each
    p.get(["b", "d"])             # b and d seen twice
    p.disk_write_room, p.disk_write_cap = room, cap
    return p


def test_without_room_only_seen_often_victims_are_demoted() -> None:
    assert _policy(None).demotions(["a", "b", "c", "d"]) == ["b", "d"]   # no room: only the seen-often ones
    assert _policy(0).demotions(["a", "b", "c", "d"]) == ["b", "d"]


def test_with_room_every_victim_is_demoted() -> None:
    assert _policy(4).demotions(["a", "b", "c", "d"]) == ["a", "b", "c", "d"]


def test_beyond_the_room_seen_often_first_then_the_least_recent_others() -> None:
    assert _policy(3).demotions(["a", "b", "c", "d"]) == ["a", "b", "d"]
    assert _policy(3, cap=1).demotions(["a", "b", "c", "d"]) == ["b"]   # capped: seen-often first


def test_an_eviction_demotes_by_the_room() -> None:
    p = _policy(4)
    p.put(["e", "f"])  # evicts a and c (least recent), seen once: demoted while the queue has room
    assert {"a", "c"} <= set(p.tiers[DISK])
