"""What a request needs before it may be scheduled, prepared on workers beside the engine loop.

Reading an adapter (file reads, parsing, checks, host conversion) and compiling a grammar can
take long, and how long is the client's choice. Neither runs on the engine loop: ``submit``
hands the work to a small thread pool and returns at once; the loop calls ``poll`` each turn,
which only picks up finished work (an adapter goes into the host cache, a compiled grammar is
already in the grammar cache) and then runs the request's ``then`` (it adds the request to the
scheduler, now a cheap call, or answers an adapter load). Until then the request is in no
queue of the scheduler and holds no batch slot.

Each preparation has a deadline: ``--structured-outputs-compile-timeout`` for a grammar,
``ADAPTER_LOAD_TIMEOUT_S`` for an adapter; past it the request fails with a 400 naming the
limit (the worker's result, when it comes, is dropped). ``cancel`` (an abort, a client that
left) takes the request out at once. Work that needs nothing (adapter in the host cache, grammar
compiled) skips the pool: ``submit`` returns False and the caller adds the request itself.

Host only (no jax).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from jaxserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

ADAPTER_LOAD_TIMEOUT_S = 60.0  # reading and checking one adapter (sizes are bounded too)
WORKERS = 2


@dataclass
class _Entry:
    future: concurrent.futures.Future
    deadline: float
    limit: str  # what the deadline is, for the error
    then: Callable[[BaseException | None], None]
    lora_request: object = None


class Preparer:
    """The preparation workers of one engine (its ``lora_manager`` and ``structured``)."""

    def __init__(self, engine, compile_timeout_s: float, workers: int = WORKERS):
        self.engine = engine
        self.compile_timeout_s = float(compile_timeout_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="jaxserve-prepare")
        self._pending: OrderedDict[str, _Entry] = OrderedDict()
        self.num_timeouts = 0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def needs(self, params=None, lora_request=None) -> tuple[bool, bool]:
        """(an adapter to read, a grammar to compile) for a request."""
        lm = getattr(self.engine, "lora_manager", None)
        lora = (lora_request is not None and lm is not None
                and not lm.is_loaded(lora_request))
        spec = getattr(params, "structured_outputs", None)
        grammar = spec is not None and not self.engine.structured.is_prepared(spec)
        return lora, grammar

    def submit(self, key: str, then: Callable[[BaseException | None], None], *, params=None,
               lora_request=None, after: str | None = None) -> bool:
        """Prepare what a request needs, then call ``then(None)`` (or ``then(error)``) on the
        loop's thread from ``poll``. False: nothing to prepare (``then`` is not called).
        ``after``: a key whose preparation this one follows (an n > 1 sibling's first child)."""
        lora, grammar = self.needs(params, lora_request)
        first = self._pending.get(after) if after is not None else None
        if not (lora or grammar or first is not None):
            return False
        if lora or grammar:
            spec = params.structured_outputs if grammar else None
            future = self._pool.submit(self._work, lora_request if lora else None, spec)
        else:  # nothing of its own: it waits for its sibling's
            future = first.future
        timeout = ((self.compile_timeout_s if grammar else 0.0)
                   + (ADAPTER_LOAD_TIMEOUT_S if lora else 0.0)) or (
            first.deadline - time.monotonic() if first is not None else 0.0)
        limit = (f"--structured-outputs-compile-timeout ({self.compile_timeout_s:g} s)"
                 if grammar else f"the adapter load limit ({ADAPTER_LOAD_TIMEOUT_S:g} s)")
        if first is not None and not (lora or grammar):
            limit = first.limit
        self._pending[key] = _Entry(future, time.monotonic() + timeout, limit, then,
                                    lora_request if lora else None)
        return True

    def _work(self, lora_request, spec):
        adapter = None
        if lora_request is not None:
            adapter = self.engine.lora_manager.read(lora_request)
        if spec is not None:
            self.engine.structured.prepare(spec)
        return adapter

    def cancel(self, key: str) -> bool:
        """Drop a request's preparation (no ``then``); False if it had none pending."""
        entry = self._pending.pop(key, None)
        if entry is None:
            return False
        if not any(e.future is entry.future for e in self._pending.values()):
            entry.future.cancel()  # not started yet: it never runs
        return True

    def poll(self) -> int:
        """Finish every preparation that is done or past its deadline, in arrival order;
        -> how many finished."""
        if not self._pending:
            return 0
        now = time.monotonic()
        done = [(k, e) for k, e in self._pending.items()
                if e.future.done() or now > e.deadline]
        for key, entry in done:
            self._pending.pop(key, None)
            err: BaseException | None = None
            if not entry.future.done():
                self.num_timeouts += 1
                param = ("structured_outputs" if "compile" in entry.limit else "lora_request")
                err = InvalidRequestError(
                    f"{param}: the request's preparation did not finish within {entry.limit}; "
                    "simplify the grammar or adapter", param=param)
                if not any(e.future is entry.future for e in self._pending.values()):
                    entry.future.cancel()
            elif entry.future.cancelled():
                err = InvalidRequestError("the request was cancelled")
            else:
                err = entry.future.exception()
                if err is not None and not isinstance(err, InvalidRequestError):
                    logger.warning("preparing request %s failed: %r", key, err)
                    err = InvalidRequestError("the request's adapter or grammar could not be "
                                              "prepared (see the server log)")
                elif err is None and entry.lora_request is not None:
                    self.engine.lora_manager.store(entry.lora_request, entry.future.result())
            try:
                entry.then(err)
            except Exception:  # noqa: BLE001 - one request's failure is its own
                logger.exception("finishing the preparation of %s failed", key)
        return len(done)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
