"""Ctrl-C during a threaded copy: every copy thread has stopped before the caller goes on."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvtier.client.engine import copyin


def test_a_second_ctrl_c_still_waits_for_the_copy_threads(monkeypatch) -> None:
    """The caller's own copy is interrupted (the first Ctrl-C) while two threads copy slow
    blocks; a second Ctrl-C arrives while it waits for them. ``_shared`` must raise only once
    no thread is copying any more (the put then gives its slots back; a thread still copying
    would write into a slot another put got)."""
    monkeypatch.setattr(copyin, "COPY_THREADS", 3)
    monkeypatch.setattr(copyin, "_pool", None)  # a pool of COPY_THREADS - 1 = 2 threads
    main = threading.main_thread()
    busy: list[int] = []
    lock = threading.Lock()

    def one(i: int) -> int:
        if threading.current_thread() is main:
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()  # the second Ctrl-C
            raise KeyboardInterrupt  # the first
        with lock:
            busy.append(1)
        time.sleep(0.5)  # a slow block
        with lock:
            busy.pop()
        return i

    ready = threading.Barrier(3)

    def first(i: int) -> int:  # the threads take a block each before the caller takes its own
        if threading.current_thread() is not main:
            ready.wait(5)
            return one(i)
        ready.wait(5)
        time.sleep(0.05)
        return one(i)

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        copyin._shared(3, copyin.PARALLEL_MIN_BYTES, first)
    assert busy == [], "a copy thread was still copying when the put gave up"
    assert time.monotonic() - t0 >= 0.5
    copyin._executor().shutdown(wait=True)
    monkeypatch.setattr(copyin, "_pool", None)
