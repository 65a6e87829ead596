"""Helpers for tests that run a server: a free port, waiting for ``/health`` of a ``jaxserve
serve`` subprocess while failing early (with the log tails) when a process dies, and uvicorn
with ``jaxserve serve``'s settings in a thread (``ServerThread``) for in-process apps."""
from __future__ import annotations

import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


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


class ServerThread:
    """uvicorn with ``jaxserve serve``'s settings (``uvicorn_config``; ``config_kw`` e.g. a
    shorter ``header_timeout``) on a free port of 127.0.0.1, in a thread."""

    def __init__(self, app, **config_kw):
        import uvicorn

        from jaxserve.entrypoints.openai.app import uvicorn_config

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, log_level="warning", **config_kw))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
