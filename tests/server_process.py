"""Helpers for tests that run ``jaxserve serve`` in a subprocess: a free port, and waiting for
``/health`` while failing early (with the log tails) when a process dies."""
from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, procs: list[subprocess.Popen], logs: list[Path], timeout: float,
                 poll: float = 0.25) -> None:
    """Poll ``GET /health`` until 200; assert every process stays alive meanwhile."""
    def tails() -> str:
        return "\n".join(Path(p).read_text()[-3000:] for p in logs)

    deadline = time.time() + timeout
    while True:
        assert all(p.poll() is None for p in procs), tails()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, f"no healthy server on port {port} in {timeout} s\n{tails()}"
        time.sleep(poll)
