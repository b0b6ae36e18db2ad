"""SGLang served live with kvtier as its HiCache L3 storage, on a GPU (scripts/gpu-check.sh).

A tiny random-weight Llama (testsupport/tiny_model.py, built here: nothing is downloaded) is
served twice by ``python -m sglang.launch_server``: once as SGLang alone, once with its
hierarchical cache on and kvtier's backend as the storage (``--hicache-storage-backend
dynamic``) on a kvtierd started here. Checks:

* greedy outputs of every prompt are identical with and without kvtier;
* the pages were backed up to kvtierd (its layouts hold blocks);
* after ``/flush_cache`` (SGLang's device and host caches emptied) the same prompts give the
  same outputs again with their prefixes served from kvtier: SGLang reports cached tokens that
  only the L3 storage could have held, and kvtierd's read counters grew.

Writes a JSON summary to ``--out``; exits 1 when a check fails. Needs SGLang with its CUDA
kernels (``sglang``, ``sgl_kernel``), kvtier and a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = 16
PROMPTS = 4
PROMPT_TOKENS = 12 * PAGE
NEW_TOKENS = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip().startswith(b"{") else {"raw": raw.decode(errors="replace")}


class Server:
    """``python -m sglang.launch_server`` on a free port; its log in ``log_path``."""

    def __init__(self, model: str, log_path: str, extra: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--page-size", str(PAGE), "--mem-fraction-static", "0.3",
               "--disable-cuda-graph", "--random-seed", "0", *extra]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang exited ({self.proc.returncode}); see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"sglang not ready within {timeout:.0f} s; see {self.log_path}")

    def generate(self, ids: list[int]) -> dict:
        out = _post(f"{self.url}/generate", {"input_ids": ids, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
        return {"text": out["text"], "cached_tokens": int(out.get("meta_info", {}).get("cached_tokens", 0))}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _daemon_state(sock: str) -> dict:
    from kvtier.client.engine.sidecar import Sidecar

    with Sidecar(sock) as sc:
        st = sc.stats()
    return {"blocks": sum(lay["host_blocks"] + lay["disk_blocks"] for lay in st["layouts"]),
            "counters": st["counters"]}


def _with_kvtier(model: str, prompts: list[list[int]], alone: list[str], work: str, timeout: float,
                 result: dict) -> None:
    """Serve with kvtier as L3 storage: the same outputs, pages in kvtierd, and after a flush of
    SGLang's own caches the prefixes read back from kvtierd (``result["checks"]`` filled in)."""
    from kvtier.client.tools.local_daemon import DaemonProcess

    checks = result["checks"]
    daemon = DaemonProcess(work, host_capacity="512MiB").start()
    extra = {"backend_name": "kvtier", "module_path": "kvtier.client.sglang", "class_name": "KvtierHiCacheStorage",
             "interface_v1": 1, "kvtier_socket": daemon.socket, "prefetch_threshold": PAGE}
    srv = Server(model, os.path.join(work, "sglang-kvtier.log"), [
        "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-write-policy", "write_through",
        "--hicache-mem-layout", "page_first", "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(extra)])
    try:
        srv.wait_ready(timeout)
        first = [srv.generate(p) for p in prompts]
        checks["identical_first_pass"] = [f["text"] for f in first] == alone
        want = len(prompts) * (PROMPT_TOKENS // PAGE)
        deadline = time.monotonic() + 60
        while _daemon_state(daemon.socket)["blocks"] < want and time.monotonic() < deadline:
            time.sleep(0.5)  # the backup to L3 runs behind the requests
        before = _daemon_state(daemon.socket)
        checks["backed_up_to_kvtier"] = before["blocks"] >= want
        result["kvtier_blocks"] = before["blocks"]
        flushed = False
        for _ in range(30):  # refused (400) while requests are in flight; L3 storage is not flushed
            try:
                _post(f"{srv.url}/flush_cache")
                flushed = True
                break
            except urllib.error.HTTPError:
                time.sleep(1.0)
        checks["flushed"] = flushed
        second = [srv.generate(p) for p in prompts]
        after = _daemon_state(daemon.socket)
        checks["identical_after_flush"] = [s["text"] for s in second] == alone
        result["cached_tokens_after_flush"] = [s["cached_tokens"] for s in second]
        checks["served_from_kvtier"] = all(s["cached_tokens"] >= PROMPT_TOKENS // 2 for s in second)
        result["daemon_counters_delta"] = {k: v - before["counters"].get(k, 0) for k, v in after["counters"].items()
                                           if v != before["counters"].get(k, 0)}
    finally:
        srv.stop()
        daemon.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="JSON summary here")
    ap.add_argument("--workdir", default="", help="model, daemon and logs here (default: a new temporary directory)")
    ap.add_argument("--start-timeout", type=float, default=240.0)
    args = ap.parse_args()
    sys.path.append(ROOT)  # testsupport/ (after the kvtier package in use: the checkout's kvtier/ must not shadow it)
    from testsupport.tiny_model import build_tiny_llama

    work = args.workdir or tempfile.mkdtemp(prefix="kvtier-sglang-")
    model = build_tiny_llama(os.path.join(work, "tiny-llama"))
    prompts = [[3 + (p * 131 + i * 7) % 1000 for i in range(PROMPT_TOKENS)] for p in range(PROMPTS)]
    result: dict = {"page_size": PAGE, "prompt_tokens": PROMPT_TOKENS, "prompts": PROMPTS, "checks": {}, "work": work}
    base = Server(model, os.path.join(work, "sglang-alone.log"), [])
    try:
        base.wait_ready(args.start_timeout)
        alone = [base.generate(p)["text"] for p in prompts]
    finally:
        base.stop()
    _with_kvtier(model, prompts, alone, work, args.start_timeout, result)
    result["ok"] = all(result["checks"].values())
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
