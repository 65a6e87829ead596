"""Per-request output streams fed from another thread (the engine thread or the core reader).

``AsyncLLM`` and ``EngineCoreClient`` hand outputs to waiting ``generate`` calls the same way:
each request owns an asyncio queue on its caller's loop; the feeding thread puts outputs, then
``FINISHED`` or an exception, with ``call_soon_threadsafe``; ``generate`` reads it through
``RequestStreams.follow``, which closes it and says whether an abort is due.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

from jaxserve.errors import InvalidRequestError

FINISHED = object()  # the end of a stream


class RequestStreams:
    def __init__(self):
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    def open(self, request_id: str) -> asyncio.Queue:
        """A new stream on the running loop; a request id already streaming is an error."""
        if request_id in self._streams:
            raise InvalidRequestError(f"request_id {request_id!r} is already running",
                                      param="request_id")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def put(self, request_id: str, item) -> None:
        """Thread-safe: an output, ``FINISHED`` or an exception for the stream's reader."""
        entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            self._streams.pop(request_id, None)

    def fail_all(self, error: BaseException) -> None:
        for rid in list(self._streams):
            self.put(rid, error)

    async def follow(self, request_id: str, q: asyncio.Queue, accepted: Awaitable,
                     on_end: Callable[[bool], None]) -> AsyncIterator:
        """The outputs of an opened stream, once ``accepted`` (the add's acknowledgement)
        resolves, to its end. Always closes the stream, then calls ``on_end(finished)``:
        ``finished`` is False when the reader stopped first, so the request is still running
        and is due an abort. Read it under ``contextlib.aclosing`` so that runs on time."""
        finished = False  # True once there is nothing to abort: ended, rejected, engine dead
        try:
            try:
                await accepted
                while (out := await next_output(q)) is not None:
                    yield out
                finished = True
            except (GeneratorExit, asyncio.CancelledError):
                raise
            except Exception:
                finished = True
                raise
        finally:
            self.close(request_id)
            on_end(finished)


async def next_output(q: asyncio.Queue):
    """The next output of a stream, None at its end; an exception put on it is raised."""
    item = await q.get()
    if item is FINISHED:
        return None
    if isinstance(item, BaseException):
        raise item
    return item
