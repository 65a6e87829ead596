"""Per-request output streams fed from another thread (the engine thread or the core reader).

``AsyncLLM`` and ``EngineCoreClient`` hand outputs to waiting ``generate`` calls the same way:
each request owns an asyncio queue on its caller's loop; the feeding thread puts outputs, then
``FINISHED`` or an exception, with ``call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
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


async def next_output(q: asyncio.Queue):
    """The next output of a stream, None at its end; an exception put on it is raised."""
    item = await q.get()
    if item is FINISHED:
        return None
    if isinstance(item, BaseException):
        raise item
    return item
