"""AsyncLLM: the engine loop on its own thread, one asyncio stream per request.

The device step blocks, so it must not run on the event loop. Requests and aborts are handed
to the loop thread through a queue; outputs come back with ``call_soon_threadsafe``. If the loop
dies, every stream gets ``EngineDeadError`` and ``check_health`` raises, so the server answers
503 instead of hanging.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from typing import AsyncIterator

from jaxserve.config import EngineConfig
from jaxserve.engine.builder import build_engine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.preparation import Preparer
from jaxserve.errors import EngineDeadError
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.streams import FINISHED, RequestStreams

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None,
                 background_warmup: bool = False):
        self.engine = engine or build_engine(config, background_warmup=background_warmup)
        self.config = config = self.engine.config  # resolved: the default model named
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.max_model_len = self.engine.max_model_len
        self.default_sampling = self.engine.default_sampling
        self.served_model_name = config.served_model_name or config.model or "jaxserve"
        self.chat_template = None
        self._commands: queue.Queue = queue.Queue()
        self._streams = RequestStreams()
        self._dead: BaseException | None = None
        self._stopping = threading.Event()
        self._stats = self.engine.stats()
        # adapters and grammars are prepared beside the loop (jaxserve.engine.preparation)
        self._preparer = Preparer(self.engine, config.structured_outputs_compile_timeout)
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ---- engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                block = not self.engine.has_unfinished_requests()
                self._drain(block)
                self._preparer.poll()
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._streams.put(out.request_id, out)
                        if out.finished:
                            self._streams.put(out.request_id, FINISHED)
                self._stats = self._engine_stats()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine, visibly
            logger.exception("engine loop died")
            self._dead = e
            self._streams.fail_all(EngineDeadError(f"engine loop died: {e!r}"))

    def _drain(self, block: bool) -> None:
        try:
            wait = 0.005 if self._preparer.num_pending else 0.05
            cmd = self._commands.get(timeout=wait) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, args, fut = cmd
            # A caller cancelled before its command ran is gone: the command is dropped (its
            # stream's abort follows in the queue and finds nothing).
            if fut is None or fut.set_running_or_notify_cancel():
                self._run(kind, args, fut)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _engine_stats(self) -> dict:
        s = self.engine.stats()
        n = self._preparer.num_pending  # a request waiting for its adapter or grammar waits
        return dict(s, num_waiting=s.get("num_waiting", 0) + n, num_preparing=n)

    def _run(self, kind: str, args, fut) -> None:
        """One command on the engine thread; an add or adapter load whose adapter or grammar
        is not ready waits on the preparer (answered from its ``poll``)."""
        def run(err: BaseException | None = None) -> None:
            try:
                if err is not None:
                    raise err
                result = None
                if kind == "add":
                    self.engine.add_request(*args[:3], priority=args[3], lora_request=args[4])
                elif kind == "abort":
                    self._preparer.cancel(args[0])
                    self.engine.abort_request(args[0])
                elif kind == "reset":
                    result = self.engine.reset_prefix_cache()
                elif kind == "add_lora":
                    result = self.engine.add_lora(args[0])
                elif kind == "remove_lora":
                    result = self.engine.remove_lora(args[0])
                elif kind == "utility":
                    from jaxserve.engine.core_process import call_utility

                    result = call_utility(self.engine, *args[0])
                if fut is not None:
                    fut.set_result(result)
            except Exception as e:  # noqa: BLE001 - bad input goes back to its caller
                if fut is not None:
                    fut.set_exception(e)

        if kind == "add":
            if self._preparer.submit(args[0], run, params=args[2], lora_request=args[4]):
                return
        elif kind == "add_lora":
            if self._preparer.submit(f"lora-{id(fut)}", run, lora_request=args[0]):
                return
        run()

    # ---- public API --------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None,
                       request_id: str, *, priority: int = 0, lora_request=None
                       ) -> AsyncIterator[RequestOutput]:
        self.check_health()
        q = self._streams.open(request_id)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", (request_id, prompt, sampling_params, priority,
                                    lora_request), fut))

        def end(finished: bool) -> None:
            if not finished:
                self._commands.put(("abort", (request_id,), None))

        async with contextlib.aclosing(self._streams.follow(
                request_id, q, asyncio.wrap_future(fut), end)) as outputs:
            async for out in outputs:
                yield out

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", (request_id,), None))
        self._streams.put(request_id, FINISHED)

    async def reset_prefix_cache(self) -> bool:
        """Runs on the engine thread between steps; False while pages are in use."""
        self.check_health()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("reset", (), fut))
        return await asyncio.wrap_future(fut)

    async def add_lora(self, lora_request) -> bool:
        """Load and check an adapter on the engine thread (raises naming it)."""
        return await self._command("add_lora", lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._command("remove_lora", lora_int_id)

    async def call_utility(self, method: str, **kwargs):
        """One of the engine's research controls (sleep, wake_up, is_sleeping,
        update_weights) on the engine thread, between steps."""
        return await self._command("utility", (method, kwargs))

    async def _command(self, kind: str, arg):
        self.check_health()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((kind, (arg,), fut))
        return await asyncio.wrap_future(fut)

    def check_health(self) -> None:
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop is not running ({self._dead!r})")

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def startup_progress(self) -> tuple[bool, int, int]:
        return self.engine.startup_progress()

    def stats(self) -> dict:
        return dict(self._stats)

    async def shutdown(self) -> None:
        self._stopping.set()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._thread.join, 5.0)
        self._preparer.shutdown()
        runner = getattr(self.engine, "runner", None)
        if runner is not None:  # buckets still compiling: no thread outlives the engine
            await loop.run_in_executor(None, runner.stop_warmup)
