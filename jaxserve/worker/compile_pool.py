"""Ahead-of-time compiles on a few threads, in a chosen order, with waiting by key.

XLA compiles release the GIL, so a small pool compiles several buckets at once. Jobs run in the
order they were submitted, except that a caller waiting for a job that has not started moves it
to the front: a step that needs a bucket not compiled yet waits for that compile, it never
compiles on its own.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Callable, Hashable

logger = logging.getLogger(__name__)

_LIVE: "weakref.WeakSet[CompilePool]" = weakref.WeakSet()

# Held while a job traces and lowers (``jit(...).lower(...)``): JAX's tracing and lowering are
# not safe from several threads at once (jax-ml/jax#32354; seen here as a KeyError on a jaxpr
# variable), while XLA's compile is, and the compile is where the time goes.
TRACE_LOCK = threading.RLock()


@atexit.register
def _stop_all() -> None:
    """At exit, drop queued compiles and wait for the running ones: the interpreter must not
    tear down while a worker thread is inside XLA (that aborts the process)."""
    for pool in list(_LIVE):
        pool.cancel()
        pool.join()


class CompilePool:
    """Runs ``jobs`` (``(key, fn)`` in order) on ``workers`` threads from :meth:`start`; the
    threads end when the queue is empty."""

    def __init__(self, jobs: list[tuple[Hashable, Callable[[], None]]], workers: int,
                 name: str = "jaxserve-compile",
                 on_done: Callable[[Hashable, float], None] | None = None):
        self._cv = threading.Condition()
        self._jobs = dict(jobs)
        if len(self._jobs) != len(jobs):
            raise ValueError("compile job keys must be unique")
        self._queue: list[Hashable] = [k for k, _ in jobs]
        self._done: set[Hashable] = set()
        self._errors: dict[Hashable, BaseException] = {}
        self._seconds: dict[Hashable, float] = {}
        self._on_done = on_done
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(max(1, min(workers, len(jobs))))]

    def start(self) -> "CompilePool":
        _LIVE.add(self)
        for t in self._threads:
            t.start()
        return self

    def cancel(self) -> None:
        """Drop the jobs not started; their waiters get an error."""
        with self._cv:
            for key in self._queue:
                self._errors[key] = RuntimeError("cancelled")
                self._done.add(key)
            self._queue.clear()
            self._cv.notify_all()

    def join(self, timeout: float | None = None) -> None:
        for t in self._threads:
            if t.is_alive():
                t.join(timeout)

    def _work(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    return
                key = self._queue.pop(0)
            t0 = time.perf_counter()
            try:
                self._jobs[key]()
            except BaseException as e:  # noqa: BLE001 - a waiter re-raises it
                logger.exception("compile job %r failed", key)
                err = e
            else:
                err = None
            dt = time.perf_counter() - t0
            if err is None and self._on_done is not None:
                try:
                    self._on_done(key, dt)
                except Exception:  # noqa: BLE001 - progress reporting never fails a compile
                    logger.exception("compile progress callback failed")
            with self._cv:
                self._seconds[key] = dt
                if err is not None:
                    self._errors[key] = err
                self._done.add(key)
                self._cv.notify_all()

    def is_done(self, key: Hashable) -> bool:
        with self._cv:
            return key in self._done and key not in self._errors

    def seconds(self, key: Hashable) -> float | None:
        with self._cv:
            return self._seconds.get(key)

    def wait(self, key: Hashable) -> None:
        """Block until ``key`` is compiled (moving it to the front if it has not started)."""
        with self._cv:
            if key not in self._jobs:
                raise KeyError(f"no compile job {key!r}")
            if key in self._queue and self._queue[0] != key:
                self._queue.remove(key)
                self._queue.insert(0, key)
            while key not in self._done:
                self._cv.wait()
            if key in self._errors:
                raise RuntimeError(f"compile job {key!r} failed") from self._errors[key]

    def wait_all(self) -> None:
        with self._cv:
            while len(self._done) < len(self._jobs):
                self._cv.wait()
            if self._errors:
                key, err = next(iter(self._errors.items()))
                raise RuntimeError(f"compile job {key!r} failed") from err
