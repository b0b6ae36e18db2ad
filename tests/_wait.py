"""Polling helpers shared by tests that watch a live process (or a running loop) reach a state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_for(pred: Callable[[], object], timeout: float = 15.0, what: str = "condition") -> object:
    """``pred()``'s first truthy answer, polled every 20 ms; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


async def until(cond: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Yield to the running loop until ``cond()``; fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)
