"""The engine core in its own process: the scheduler and the device loop, nothing else.

``jaxserve serve`` runs this in a child process so the device loop never waits for HTTP,
JSON, tokenization or chat templates, and the API process never imports jax. The wire is two
ZeroMQ sockets on ipc:// paths: requests come in on a PULL socket as typed msgspec structs
(``AddRequest``, ``AbortRequest``, ``FinishSequences``, ``ResetPrefixCache``, ``Shutdown``:
msgpack, decoded into exactly those types), and each step's outputs go out on a PUSH socket,
msgpack-encoded with msgspec (the hot path). Only token ids
travel: the API process tokenizes (``add`` carries ids) and runs the output processor
(detokenization, stop strings, logprob text); a stop string comes back as ``finish``.
Messages out:

- ``("ready", info)``: once, when the model is loaded (buckets then compile in the background;
  ``stats["startup"]`` follows their progress); ``info`` holds what the API process needs
  (tokenizer, model config, max_model_len, stats).
- ``("added", rid, None)`` / ``("added", rid, error)``: the answer to each ``add``.
- ``("step", outputs, stats)``: the ``CoreOutput``s of one step; ``stats`` at most every
  ``STATS_INTERVAL_S`` (None between).
- ``("pooled", outputs, stats)``: the ``PoolingOutput``s of one step of a pooling engine.
- ``("reset", token, ok)``: the answer to ``reset_prefix_cache``.
- ``("utility", token, result, error)``: the answer to a ``Utility`` call (sleep, wake_up,
  is_sleeping, update_weights).
- ``("dead", message)``: the loop failed; the process then exits.

The core exits when its parent does (it checks its parent id), so it never outlives the
server.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import signal
import time

import msgspec
import numpy as np
import zmq

from jaxserve.config import EngineConfig
from jaxserve.core.mm_inputs import MultiModalInputs
from jaxserve.core.outputs import CoreOutput
from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.output_processor import SequenceStop
from jaxserve.engine.preparation import Preparer
from jaxserve.errors import InvalidRequestError
from jaxserve.lora.request import LoRARequest
from jaxserve.worker.host_memory import limit_malloc_arenas, trim
from jaxserve.worker.memory_budget import set_allocator_fraction

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05  # stats ride along with step outputs at most this often
POLL_MS = 50  # how long an idle core waits for input before it checks its parent again
PREPARE_POLL_MS = 5  # the same while requests wait for their adapter or grammar


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """A tokenized request of one sequence (the API process validated, tokenized and fanned it
    out: ``prefix_parent`` names the core request whose prompt pages an n > 1 sibling shares)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    lora_request: LoRARequest | None = None
    prefix_parent: str | None = None
    mm: MultiModalInputs | None = None  # its images, processed in the API process
    prompt_embeds: bytes | None = None  # the prompt as embeddings: a float32 .npy array


class PoolRequest(msgspec.Struct, tag="pool", array_like=True):
    """A tokenized pooling request (``--runner pooling``): answered by ``added``, then its
    ``PoolingOutput`` in a ``pooled`` message."""

    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams
    token_type_ids: list[int] | None = None


class LoRAUpdate(msgspec.Struct, tag="lora", array_like=True):
    """Load (``lora_request``) or forget (``remove_id``) an adapter; the answer carries
    ``token`` back with the result or the error."""

    token: str
    lora_request: LoRARequest | None = None
    remove_id: int = 0


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]  # core request ids (every child of an n > 1 request)


class FinishSequences(msgspec.Struct, tag="finish", array_like=True):
    """Sequences the API process stopped on a stop string."""

    stops: list[SequenceStop]


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    token: str  # the answer carries it back


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


# the engine's research controls (engine/weight_sync.py) a client may call between steps
UTILITY_METHODS = ("sleep", "wake_up", "is_sleeping", "update_weights")


class Utility(msgspec.Struct, tag="utility", array_like=True):
    """Call ``engine.<method>(**kwargs)`` (one of ``UTILITY_METHODS``) between steps; the
    answer ``("utility", token, result, error)`` carries ``token`` back."""

    token: str
    method: str
    kwargs: dict = {}


CoreRequest = (AddRequest | PoolRequest | AbortRequest | FinishSequences | ResetPrefixCache
               | LoRAUpdate | Utility | Shutdown)


def encode_request(msg: CoreRequest) -> bytes:
    return _ENCODER.encode(msg)


def encode_outputs(outputs: list[CoreOutput], stats: dict | None) -> bytes:
    return _ENCODER.encode(("step", outputs, stats))


def decode_message(frame: bytes):
    """Decode a core → API frame: step outputs typed, the rest as plain msgpack or pickle."""
    if frame[:1] == b"P":
        return pickle.loads(frame[1:])
    kind, outputs, stats = _STEP_DECODER.decode(frame)
    return kind, outputs, stats


def _pickled(msg) -> bytes:
    return b"P" + pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


_ENCODER = msgspec.msgpack.Encoder()
_STEP_DECODER = msgspec.msgpack.Decoder(tuple[str, list[CoreOutput], dict | None])
_REQUEST_DECODER = msgspec.msgpack.Decoder(CoreRequest)


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str,
                    parent_pid: int) -> None:
    """Entry point of the core process (``multiprocessing`` spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the API process, which stops us
    limit_malloc_arenas()  # before any thread starts: a few C-heap arenas, not 8 per core
    # before JAX starts: its allocator takes --gpu-memory-utilization of the device's total memory
    set_allocator_fraction(config.cache.gpu_memory_utilization)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(output_addr)
    try:
        _serve(config, inbox, outbox, parent_pid)
    except BaseException as e:  # noqa: BLE001 - the API process must hear why we died
        logger.exception("engine core died")
        try:
            outbox.send(_pickled(("dead", f"{type(e).__name__}: {e}")))
        except zmq.ZMQError:
            pass
    finally:
        inbox.close(0)
        outbox.close()
        ctx.term()


def _serve(config: EngineConfig, inbox, outbox, parent_pid: int) -> None:
    from jaxserve.engine.builder import build_engine

    # ready once loaded: the buckets compile in the background while requests are taken
    # (a step waits for the bucket it needs); stats carry the progress for /health
    engine = build_engine(config, background_warmup=True)
    preparer = Preparer(engine, config.structured_outputs_compile_timeout)
    outbox.send(_pickled(("ready", _ready_info(engine))))
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    last_stats = 0.0
    try:
        _loop(engine, preparer, poller, inbox, outbox, parent_pid, last_stats)
    finally:
        preparer.shutdown()


def _loop(engine, preparer, poller, inbox, outbox, parent_pid: int, last_stats: float) -> None:
    was_busy = False
    while True:
        busy = engine.has_unfinished_requests()
        if was_busy and not busy and engine.runner.warmed_up:
            # idle again: the C heap's free memory (request temporaries, per-thread arenas)
            # goes back to the kernel, so an idle server's RSS returns near its warm-up level
            trim()
        was_busy = busy
        wait = 0 if busy else (PREPARE_POLL_MS if preparer.num_pending else POLL_MS)
        if poller.poll(wait):  # take every message waiting, then step
            while True:
                try:
                    frame = inbox.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if not _handle(engine, _REQUEST_DECODER.decode(frame), outbox, preparer):
                    return
        preparer.poll()  # adapters read and grammars compiled meanwhile: their requests in
        if engine.has_unfinished_requests():
            outs = engine.core_step()
            now = time.monotonic()
            stats = None
            # at most every STATS_INTERVAL_S, and when the last request ends (gauges go to 0)
            if now - last_stats > STATS_INTERVAL_S or not engine.has_unfinished_requests():
                stats, last_stats = _stats(engine, preparer), now
            if getattr(engine, "is_pooling", False):  # pooled vectors: numpy, pickled
                if outs:
                    outbox.send(_pickled(("pooled", outs, stats)))
                elif stats is not None:
                    outbox.send(encode_outputs([], stats))
                continue
            if engine.pooling is not None and engine.pooling.pending:  # a decoder's embeddings
                pooled, outs = engine.pooling.outputs(outs)
                if pooled:
                    outbox.send(_pickled(("pooled", pooled, None)))
            if outs or stats is not None:
                outbox.send(encode_outputs(outs, stats))
        else:
            connector = getattr(engine, "kv_connector", None)
            if connector is not None:  # held prefills pulled or expired meanwhile
                connector.before_schedule()
            if os.getppid() != parent_pid:
                logger.warning("the API process is gone; the engine core stops")
                return
            now = time.monotonic()
            # idle: keep the API's gauges fresh, cheaply (often while buckets still compile)
            if now - last_stats > (1.0 if engine.runner.warmed_up else STATS_INTERVAL_S):
                outbox.send(encode_outputs([], _stats(engine, preparer)))
                last_stats = now


def _handle(engine, msg: CoreRequest, outbox, preparer: Preparer | None = None) -> bool:
    """Apply one API message; False on shutdown. A request whose adapter or grammar is not
    ready yet is prepared beside the loop (``preparer``) and answered when it is."""
    if isinstance(msg, AddRequest):
        def add(err: BaseException | None = None) -> None:
            if err is None:
                err = _guarded(lambda: engine.add_core_request(
                    msg.request_id, msg.prompt_token_ids, msg.params, priority=msg.priority,
                    lora_request=msg.lora_request, prefix_parent=msg.prefix_parent,
                    mm=msg.mm,
                    prompt_embeds=(None if msg.prompt_embeds is None
                                   else np.load(io.BytesIO(msg.prompt_embeds),
                                                allow_pickle=False))))[1]
            outbox.send(_pickled(("added", msg.request_id, err)))

        if preparer is None or not preparer.submit(
                msg.request_id, add, params=msg.params, lora_request=msg.lora_request,
                after=msg.prefix_parent):
            add()
    elif isinstance(msg, PoolRequest):
        def add_pool():
            if not getattr(engine, "is_pooling", False) and engine.pooling is not None:
                engine.pooling.add_core(msg.request_id, msg.prompt_token_ids, msg.params)
                return
            if not getattr(engine, "is_pooling", False):
                raise InvalidRequestError(
                    "this server runs a generative model (--runner generate): it does not "
                    "embed, score or classify; serve a pooling model with --runner pooling",
                    param="model")
            engine.add_core_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                    token_type_ids=msg.token_type_ids)

        outbox.send(_pickled(("added", msg.request_id, _guarded(add_pool)[1])))
    elif isinstance(msg, AbortRequest):
        if preparer is not None:
            for rid in msg.request_ids:
                preparer.cancel(rid)  # still preparing: it leaves at once, unanswered
        engine.abort_core_requests(msg.request_ids)
    elif isinstance(msg, FinishSequences):
        engine.finish_sequences(msg.stops)
    elif isinstance(msg, ResetPrefixCache):
        outbox.send(_pickled(("reset", msg.token, engine.reset_prefix_cache())))
    elif isinstance(msg, LoRAUpdate):
        def update(err: BaseException | None = None) -> None:
            result = None
            if err is None:
                result, err = _guarded(
                    lambda: engine.add_lora(msg.lora_request) if msg.lora_request is not None
                    else engine.remove_lora(msg.remove_id))
            outbox.send(_pickled(("lora", msg.token, result, err)))

        if (msg.lora_request is None or preparer is None
                or not preparer.submit(msg.token, update, lora_request=msg.lora_request)):
            update()
    elif isinstance(msg, Utility):
        result, err = _guarded(lambda: call_utility(engine, msg.method, msg.kwargs))
        outbox.send(_pickled(("utility", msg.token, result, err)))
    elif isinstance(msg, Shutdown):
        return False
    return True


def call_utility(engine, method: str, kwargs: dict):
    """One of the engine's research controls by name (the only names a client may call)."""
    if method not in UTILITY_METHODS:
        raise InvalidRequestError(f"unknown utility method {method!r} (one of "
                                  f"{', '.join(UTILITY_METHODS)})", param="method")
    return getattr(engine, method)(**kwargs)


def _guarded(fn):
    """(result, None), or (None, the error for the client): bad input is an
    ``InvalidRequestError`` already; anything else is logged here and answered without its
    Python text."""
    try:
        return fn(), None
    except InvalidRequestError as e:
        return None, e
    except Exception:  # noqa: BLE001 - bad input goes back to its caller
        logger.exception("a request failed in the engine core")
        return None, InvalidRequestError("the request could not be accepted (see the server "
                                         "log)")


def _stats(engine, preparer: Preparer | None = None) -> dict:
    s = dict(engine.stats(), startup=list(engine.startup_progress()))
    if preparer is not None:  # a request waiting for its adapter or grammar is waiting
        s["num_waiting"] = s.get("num_waiting", 0) + preparer.num_pending
        s["num_preparing"] = preparer.num_pending
    return s


def _ready_info(engine) -> dict:
    dtype = getattr(engine, "dtype", None)
    return dict(
        tokenizer=engine.tokenizer,
        model_config=engine.model_config,
        max_model_len=engine.max_model_len,
        dtype=getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype),
        stats=_stats(engine),
        pid=os.getpid(),
        model=engine.config.model,  # the engine resolves the default model
        served_model_name=engine.config.served_model_name,
        default_sampling=engine.default_sampling,
        runner="pooling" if getattr(engine, "is_pooling", False) else "generate",
        # a pooling runner's model, or a generative decoder's own embeddings
        pooling_info=(engine.pooling_info if getattr(engine, "is_pooling", False) else
                      engine.pooling.info if engine.pooling is not None else None),
        pooling_task=engine.config.pooling_task,
        # images are processed in the API process: where the checkpoint's processor lives
        model_dir=(str(engine.model_dir) if getattr(getattr(engine, "runner", None), "mm", None)
                   else None),
    )
