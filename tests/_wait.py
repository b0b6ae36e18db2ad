"""Polling helper shared by tests that watch a live process reach a state."""

from __future__ import annotations

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
