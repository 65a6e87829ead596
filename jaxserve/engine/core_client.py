"""The API process's handle on an engine core running in a child process.

Same surface as ``AsyncLLM`` (``generate``/``abort``/``check_health``/``stats``/``shutdown``,
``tokenizer``, ``model_config``, ``max_model_len``), so the server does not know which one it
holds. This side is the input and output processor: prompts go to the core as token ids (an
``n > 1`` request as ``n`` core requests, engine/parallel_sampling.py), and the core's ids come
back through the ``OutputProcessor`` (detokenization, stop strings,
logprob text) on the reader thread, which hands each ``RequestOutput`` to its request's
asyncio queue and tells the core about stop strings. The reader also watches the child: when
the core dies every stream gets ``EngineDeadError`` and ``check_health`` raises within
``WATCH_S`` seconds.

This module and everything it imports must stay free of jax: that is the point of the split
(a test reads ``/proc/<pid>/maps`` of the API process).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import io
import itertools
import logging
import multiprocessing
import os
import tempfile
import threading
from typing import AsyncIterator

import numpy as np
import zmq

from jaxserve.config import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.prompt_embeds import PLACEHOLDER_ID
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.core_process import (AbortRequest, AddRequest, CoreRequest, FinishSequences,
                                          LoRAUpdate, PoolRequest,
                                          ResetPrefixCache, Shutdown, Utility, decode_message,
                                          encode_request, run_engine_core)
from jaxserve.engine.multimodal import split_prompt, text_only_error
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.streams import FINISHED, RequestStreams
from jaxserve.engine.tokenizer import prompt_ids
from jaxserve.multimodal.inputs import MultiModalInputProcessor
from jaxserve.errors import EngineDeadError

logger = logging.getLogger(__name__)

WATCH_S = 0.2  # the reader thread checks the child this often


def use_core_process(config: EngineConfig) -> bool:
    """``jaxserve serve`` runs the engine core in a child process unless
    ``JAXSERVE_ENABLE_MULTIPROCESSING=0`` (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING``). Data
    parallel replicas and multi-host leaders keep their cores in the API process for now."""
    if os.environ.get("JAXSERVE_ENABLE_MULTIPROCESSING", "1").lower() in ("0", "false", "no"):
        return False
    return config.parallel.data_parallel_size == 1 and config.parallel.num_hosts == 1


def preimport_tokenizer_library() -> None:
    """Import transformers' tokenizer classes (~1 s of Python) while the core loads the model,
    so unpickling the tokenizer of the ``ready`` message does not add that second to start-up
    (the classes are imported then anyway). Nothing when transformers is not installed."""
    try:
        if importlib.util.find_spec("transformers") is not None:
            from transformers import PreTrainedTokenizerFast  # noqa: F401
    except Exception:  # noqa: BLE001 - an optimization only: the unpickle imports it anyway
        logger.debug("pre-importing transformers failed", exc_info=True)


class EngineCoreClient:
    def __init__(self, config: EngineConfig, ready_timeout_s: float | None = None):
        self.config = config
        self.served_model_name = config.served_model_name or config.model or "jaxserve"
        self.chat_template = None
        self._streams = RequestStreams()
        self._adds: dict[str, asyncio.Future] = {}  # answers awaited: adds and resets
        self._tokens = itertools.count()
        self._dead: str | None = None
        self._stopping = False
        self._send_lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="jaxserve-core-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(in_addr)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.bind(out_addr)
        mp = multiprocessing.get_context("spawn")
        self.process = mp.Process(target=run_engine_core, name="jaxserve-engine-core",
                                  args=(config, in_addr, out_addr, os.getpid()), daemon=True)
        self.process.start()
        # the tokenizer arrives pickled with "ready": its library is imported meanwhile
        threading.Thread(target=preimport_tokenizer_library, name="jaxserve-preimport",
                         daemon=True).start()
        info = self._wait_ready(ready_timeout_s)
        self.tokenizer = info["tokenizer"]
        self.model_config = info["model_config"]
        self.max_model_len = info["max_model_len"]
        self.dtype = info["dtype"]
        self.default_sampling = info["default_sampling"]
        self.core_pid = info["pid"]
        self.runner_type = info.get("runner", "generate")  # "pooling": /v1/embeddings & co.
        self.pooling_info = info.get("pooling_info")
        self.pooling_task = info.get("pooling_task")
        self._pooled: dict[str, asyncio.Future] = {}  # pooling requests awaiting their output
        # the core resolved the default model: this process's config names it too
        self.config = config = dataclasses.replace(
            config, model=info["model"], served_model_name=info["served_model_name"])
        self.served_model_name = config.served_model_name or config.model or "jaxserve"
        self._stats = info["stats"]
        self._processor = OutputProcessor(self.tokenizer)
        self._processor_lock = threading.Lock()  # the reader thread and the event loop(s)
        # the image processor (host side) when the core serves images
        self.mm_processor = (None if info.get("model_dir") is None else
                             MultiModalInputProcessor.for_model(
                                 info["model_dir"], self.model_config.hf, config.multimodal,
                                 max_num_batched_tokens=config.scheduler.max_num_batched_tokens))
        self.takes_images = self.mm_processor is not None
        self._reader = threading.Thread(target=self._read, name="jaxserve-core-reader",
                                        daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float | None) -> dict:
        waited = 0.0
        while not self._from_core.poll(int(WATCH_S * 1000)):
            waited += WATCH_S
            if not self.process.is_alive():
                raise EngineDeadError(f"the engine core exited while starting "
                                      f"(exit code {self.process.exitcode}); see its log above")
            if timeout_s is not None and waited > timeout_s:
                self.process.kill()
                raise EngineDeadError(f"the engine core was not ready after {timeout_s:.0f} s")
        kind, *rest = decode_message(self._from_core.recv())
        if kind != "ready":
            raise EngineDeadError(f"the engine core failed while starting: {rest[0]}")
        return rest[0]

    # ---- reader thread -----------------------------------------------------------------
    def _read(self) -> None:
        sock = self._from_core
        while not self._stopping:
            if sock.poll(int(WATCH_S * 1000)):
                try:
                    self._dispatch(decode_message(sock.recv()))
                except Exception:  # noqa: BLE001 - a bad frame must not kill the reader
                    logger.exception("could not handle a frame from the engine core")
                continue
            if self._dead is None and not self.process.is_alive() and not self._stopping:
                self._die(f"the engine core process exited (exit code {self.process.exitcode})")
        # after shutdown: nothing more to read

    def _dispatch(self, msg) -> None:
        kind = msg[0]
        if kind == "step":
            _, core_outputs, stats = msg
            with self._processor_lock:
                outputs, stops = self._processor.process(core_outputs)
            if stops:
                self._send(FinishSequences(stops))
            for out in outputs:
                self._streams.put(out.request_id, out)
                if out.finished:
                    self._streams.put(out.request_id, FINISHED)
            if stats is not None:
                self._stats = stats
        elif kind == "pooled":
            _, pooled, stats = msg
            for out in pooled:
                fut = self._pooled.pop(out.request_id, None)
                if fut is not None:
                    fut.get_loop().call_soon_threadsafe(_settle_value, fut, out)
            if stats is not None:
                self._stats = stats
        elif kind == "added":
            _, rid, err = msg
            fut = self._adds.pop(rid, None)
            if fut is not None:
                loop = fut.get_loop()
                loop.call_soon_threadsafe(_settle, fut, err)
        elif kind == "reset":
            _, token, ok = msg
            fut = self._adds.pop(token, None)
            if fut is not None:
                fut.get_loop().call_soon_threadsafe(_settle_value, fut, ok)
        elif kind == "lora":
            _, token, result, err = msg
            fut = self._adds.pop(token, None)
            if fut is not None:
                fut.get_loop().call_soon_threadsafe(
                    _settle if err is not None else _settle_value, fut, err or result)
        elif kind == "utility":
            _, token, result, err = msg
            fut = self._adds.pop(token, None)
            if fut is not None:
                fut.get_loop().call_soon_threadsafe(
                    _settle if err is not None else _settle_value, fut, err or result)
        elif kind == "dead":
            self._die(f"the engine core died: {msg[1]}")

    def _die(self, why: str) -> None:
        logger.error(why)
        self._dead = why
        self._streams.fail_all(EngineDeadError(why))
        for rid, fut in list(self._adds.items()):
            fut.get_loop().call_soon_threadsafe(_settle, fut, EngineDeadError(why))
        self._adds.clear()
        for rid, fut in list(self._pooled.items()):
            fut.get_loop().call_soon_threadsafe(_settle, fut, EngineDeadError(why))
        self._pooled.clear()

    def _send(self, msg: CoreRequest) -> None:
        frame = encode_request(msg)
        with self._send_lock:
            self._to_core.send(frame)

    # ---- public API (AsyncLLM's) ---------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None,
                       request_id: str, *, priority: int = 0, lora_request=None
                       ) -> AsyncIterator[RequestOutput]:
        self.check_health()
        params = sampling_params or SamplingParams()
        embeds = images = None
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:  # checked by the core
            arr = np.ascontiguousarray(prompt["prompt_embeds"], dtype=np.float32)
            buf = io.BytesIO()
            np.save(buf, arr, allow_pickle=False)
            embeds, text, ids = buf.getvalue(), None, [PLACEHOLDER_ID] * len(arr)
        else:
            prompt, mm_data = split_prompt(prompt)
            text, ids = prompt_ids(self.tokenizer, prompt)
            if mm_data is not None:
                if self.mm_processor is None:
                    raise text_only_error()
                ids, images = self.mm_processor.process(ids, mm_data)
        q = self._streams.open(request_id)
        try:
            with self._processor_lock:
                parent = self._processor.add_request(request_id, text,
                                                     [] if embeds is not None else ids, params)
        except BaseException:
            self._streams.close(request_id)
            raise
        core_ids = [c.request_id for c in parent.children]
        loop = asyncio.get_running_loop()
        answers = []
        for child in parent.children:
            answers.append(loop.create_future())
            self._adds[child.request_id] = answers[-1]
            self._send(AddRequest(child.request_id, ids, child.params, priority, lora_request,
                                  child.prefix_parent, images, embeds))

        added = asyncio.gather(*answers)

        def rejected(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None and len(core_ids) > 1:
                self._abort_core(core_ids)  # the siblings the core took: nobody reads them

        added.add_done_callback(rejected)

        def end(finished: bool) -> None:
            for rid in core_ids:
                self._adds.pop(rid, None)
            with self._processor_lock:
                self._processor.abort_request(request_id)
            if not finished:
                self._abort_core(core_ids)

        async with contextlib.aclosing(
                self._streams.follow(request_id, q, added, end)) as outputs:
            async for out in outputs:
                yield out

    async def encode(self, token_ids: list[int], params, request_id: str, *,
                     token_type_ids: list[int] | None = None):
        """One pooling request (token ids in, ``PoolingOutput`` out); cancelling aborts it."""
        self.check_health()
        loop = asyncio.get_running_loop()
        added, done = loop.create_future(), loop.create_future()
        self._adds[request_id] = added
        self._pooled[request_id] = done
        self._send(PoolRequest(request_id, list(token_ids), params, token_type_ids))
        finished = False
        try:
            await added
            out = await done
            finished = True
            if out.error is not None:  # the core ended it before its prompt was computed
                raise RuntimeError(f"pooling request {request_id} failed: {out.error}")
            return out
        finally:
            self._adds.pop(request_id, None)
            self._pooled.pop(request_id, None)
            if not finished:
                self._abort_core([request_id])

    def _abort_core(self, core_ids: list[str]) -> None:
        if self._dead is None and not self._stopping:
            self._send(AbortRequest(core_ids))


    async def abort(self, request_id: str) -> None:
        with self._processor_lock:
            core_ids = self._processor.abort_request(request_id)
        if core_ids:
            self._abort_core(core_ids)
        self._streams.put(request_id, FINISHED)

    async def add_lora(self, lora_request) -> bool:
        """The core loads and checks an adapter (raises naming it)."""
        return await self._lora_update(lora_request=lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._lora_update(remove_id=lora_int_id)

    async def _lora_update(self, **kw):
        self.check_health()
        token = f"lora-{next(self._tokens)}"
        fut = asyncio.get_running_loop().create_future()
        self._adds[token] = fut
        self._send(LoRAUpdate(token, **kw))
        try:
            return await fut
        finally:
            self._adds.pop(token, None)

    async def reset_prefix_cache(self) -> bool:
        """The core drops its cached prefix pages between steps; False while pages are in use."""
        self.check_health()
        token = f"reset-{next(self._tokens)}"  # never a request id: those come from the server
        fut = asyncio.get_running_loop().create_future()
        self._adds[token] = fut
        self._send(ResetPrefixCache(token))
        try:
            return await fut
        finally:
            self._adds.pop(token, None)

    async def call_utility(self, method: str, **kwargs):
        """One of the core's research controls (``core_process.UTILITY_METHODS``), run
        between steps; its error (bad input) is raised here."""
        self.check_health()
        token = f"utility-{next(self._tokens)}"
        fut = asyncio.get_running_loop().create_future()
        self._adds[token] = fut
        self._send(Utility(token, method, kwargs))
        try:
            return await fut
        finally:
            self._adds.pop(token, None)

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self.process.is_alive():
            raise EngineDeadError(f"the engine core process exited "
                                  f"(exit code {self.process.exitcode})")

    @property
    def is_running(self) -> bool:
        return self._dead is None and self.process.is_alive()

    def startup_progress(self) -> tuple[bool, int, int]:
        """(ready to serve without waiting for a compile, buckets compiled, buckets), as the
        core last reported it."""
        ready, k, n = self._stats.get("startup", (True, 0, 0))
        return bool(ready), int(k), int(n)

    def stats(self) -> dict:
        return {k: v for k, v in self._stats.items() if k != "startup"}

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the core (it finishes its current step), then the reader and the sockets."""
        if self._stopping:
            return
        if self.process.is_alive():
            try:
                self._send(Shutdown())
            except zmq.ZMQError:
                pass
            self.process.join(timeout_s)
            if self.process.is_alive():
                logger.warning("the engine core did not stop in %.0f s; killing it", timeout_s)
                self.process.kill()
                self.process.join(5.0)
        self._stopping = True
        self._reader.join(2 * WATCH_S + 1.0)
        self._to_core.close(0)
        self._from_core.close(0)
        self._ctx.term()
        for name in ("in", "out"):
            try:
                os.unlink(os.path.join(self._dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


def _settle(fut: asyncio.Future, err) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)


def _settle_value(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
