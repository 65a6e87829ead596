"""Engine streams to HTTP: one engine stream per prompt merged into one queue (the fan-in),
and Server-Sent Events that always close it, however the response ends."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from jaxserve.entrypoints.openai import protocol as P
from jaxserve.entrypoints.openai.metrics import RequestObserver
from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.entrypoints.openai.responses import ClientGone


# ---- engine streams --------------------------------------------------------------------------
@dataclass
class FanInEvent:
    prompt_index: int
    output: RequestOutput | None = None  # None: this prompt's stream ended
    error: BaseException | None = None


@dataclass(eq=False)  # identity: fan-ins are kept in a set while in flight
class FanIn:
    """Runs one engine stream per prompt as tasks and merges their outputs into one queue.

    ``prime`` waits until every stream has produced its first event, so validation errors the
    engine raises before its first output still become a 4xx response. ``close`` cancels the
    tasks; cancelling an engine stream aborts its request and frees its pages.
    """

    engine: Any
    prompts: list
    params: Any
    request_id: str  # the response's id (the client's request_id when it sent one)
    priority: int
    observers: list[RequestObserver]
    # The engine's key: generated here, never taken from the client, so no client id can reach
    # (or collide with) another request's state.
    internal_id: str = field(default_factory=lambda: P.random_id("req"))
    lora_request: Any = None  # the adapter the request's model names (None: the base)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task] = field(default_factory=list)
    buffered: list[FanInEvent] = field(default_factory=list)
    last: dict[int, RequestOutput] = field(default_factory=dict)
    pending: int = 0
    on_close: Any = None  # called once when the fan-in is closed

    def engine_id(self, i: int) -> str:
        return f"{self.internal_id}-{i}"

    async def _produce(self, i: int, prompt) -> None:
        try:
            kw = {} if self.lora_request is None else {"lora_request": self.lora_request}
            gen = self.engine.generate(prompt, self.params, self.engine_id(i),
                                       priority=self.priority, **kw)
            async for out in gen:
                self.queue.put_nowait(FanInEvent(i, out))
            self.queue.put_nowait(FanInEvent(i))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self.queue.put_nowait(FanInEvent(i, error=e))

    async def prime(self) -> None:
        self.tasks = [asyncio.create_task(self._produce(i, p)) for i, p in enumerate(self.prompts)]
        self.pending = len(self.prompts)
        seen: set[int] = set()
        while len(seen) < len(self.prompts):
            ev = await self.queue.get()
            if ev.error is not None:
                self.close()
                raise ev.error
            seen.add(ev.prompt_index)
            self.buffered.append(ev)

    async def events(self) -> AsyncIterator[FanInEvent]:
        """Outputs in arrival order; raises the first error; ends when all streams ended."""
        while self.pending:
            ev = self.buffered.pop(0) if self.buffered else await self.queue.get()
            if ev.error is not None:
                raise ev.error
            if ev.output is None:
                self.pending -= 1
                out = self.last.get(ev.prompt_index)
                self.observers[ev.prompt_index].on_finish(
                    out, [c.finish_reason or "abort" for c in out.outputs] if out else ["abort"])
            else:
                self.last[ev.prompt_index] = ev.output
                self.observers[ev.prompt_index].on_output(ev.output)
            yield ev

    def stop(self, error: BaseException) -> None:
        """End this request from outside: its consumer gets ``error`` next."""
        self.queue.put_nowait(FanInEvent(0, error=error))

    def close(self) -> None:
        for t in self.tasks:
            if not t.done():
                t.cancel()
        if self.on_close is not None:
            self.on_close(self)
            self.on_close = None


async def until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(fanin: FanIn, request: Request) -> dict[int, RequestOutput]:
    """Drain a non-streaming request; a client that hangs up aborts it."""

    async def drain():
        async for _ in fanin.events():
            pass
        return fanin.last

    work = asyncio.create_task(drain())
    watch = asyncio.create_task(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientGone()
    finally:
        for t in (work, watch):
            t.cancel()
        fanin.close()


class SSEResponse(StreamingResponse):
    """An event stream whose body generator is always closed, however the response ends."""

    def __init__(self, body: AsyncIterator[str]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def shown_text(c: CompletionOutput, hold: int) -> str:
    """The part of a choice's text a stream may show: until the choice finishes, the last
    ``hold`` characters wait, since a later token may complete a stop string that starts there
    (and the stop string is never shown)."""
    if c.finish_reason is not None or not hold:
        return c.text
    return c.text[:max(0, len(c.text) - hold)]


def sse(model: P.OpenAIBaseModel | dict) -> str:
    data = model if isinstance(model, dict) else None
    text = json.dumps(data) if data is not None else model.model_dump_json()
    return f"data: {text}\n\n"


# ---- logprob formats -------------------------------------------------------------------------
