"""Waiting for a live daemon's background demotions: a put returns before the disk
writes of the host victims it evicted within the disk's write queue's room are done."""

from __future__ import annotations

from _wait import wait_for


def demotions_over(sc) -> dict:
    """The daemon's counters once every demotion it staged is over (written, dropped or failed):
    ``demotions_staged == demotions_staged_over``; AssertionError after 10 s."""
    def over() -> dict | None:
        c = sc.stats()["counters"]
        return c if c.get("demotions_staged", 0) == c.get("demotions_staged_over", 0) else None
    return wait_for(over, 10.0, "the daemon's background demotions to finish")
