"""The prefill/decode KV connector of one engine (``--kv-transfer-config``): the scheduler's
bookkeeping (core.kv_transfer) joined to the bytes that move between instances.

Control goes over ZMQ: a producer binds a ROUTER at ``kv_ip:kv_port``; a consumer's pull is one
request ``{request_id, group_block_ids}`` (per pool, the producer's pages it needs: every page of
a full-attention pool, the last token's window of a sliding one) and one reply. The pages (and
a recurrent state's slot) travel either through ``jax.experimental.transfer`` (the reply names
a uuid the consumer pulls device to device) or, where the transfer server cannot serve the pool
(sharded, pipelined) or ``transport`` says ``zmq``, inside the reply as raw host bytes. Either way:

- producer: the server thread finds the held prefill, gathers its pages (device arrays made
  under the pool lock, so steps go on), offers or sends them, and reports the pull; the engine
  thread then frees the pages. Held pages nobody pulls are freed after
  ``abort_request_timeout``.
- consumer: a worker thread per pull waits for the reply (and the transfer) with the load
  timeout; the engine thread writes the arrays into the request's fresh pages before the next
  schedule and requeues it. A pull that fails, or is still missing at its deadline (a dead
  producer, a lost reply), ends the request with an error naming the producer; its pages are
  freed.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import uuid
import zlib

import msgspec
import numpy as np
import zmq

from jaxserve.core.kv_transfer import KVTransferConfig, KVTransferState
from jaxserve.errors import InvalidRequestError
from jaxserve.worker import kv_transfer as pages_io

logger = logging.getLogger(__name__)

_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()
IDLE_SLEEP_S = 0.002  # the loop's pause while only pulls are in flight


def prompt_digest(ids) -> int:
    """A check that the decode's prompt is the one prefilled (crc32 of the ids)."""
    return zlib.crc32(np.asarray(ids, dtype=np.int64).tobytes())


def _advertised_host(config: KVTransferConfig) -> str:
    host = config.extra("advertise_host") or config.kv_ip
    if host in ("0.0.0.0", "", "*", "::"):
        host = socket.gethostbyname(socket.gethostname())
    return host


class KVConnector:
    """One engine's connector: the server (producer), the pulls (consumer) and the step hook
    that applies their results on the engine thread."""

    def __init__(self, config: KVTransferConfig, engine):
        self.config = config
        self.engine = engine
        runner, scheduler = engine.runner, engine.scheduler
        check_supported(engine)
        self.layout = pages_io.page_layout(runner)
        self.state_layout = pages_io.state_layout(runner)
        want = config.extra("transport")
        jax_ok = pages_io.jax_transfer_supported(runner)
        if want == "jax" and not jax_ok:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.transport 'jax': "
                             "jax.experimental.transfer cannot serve this pool here (sharded "
                             "or pipelined); use 'zmq' or 'auto'")
        self.transport = "jax" if want in ("jax", "auto") and jax_ok else "zmq"
        self.transfer = pages_io.TransferServer(config.kv_ip) if self.transport == "jax" \
            else None
        self.host = _advertised_host(config)
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the held prefills, between server and engine threads
        self._pulled: queue.SimpleQueue = queue.SimpleQueue()  # producer: pulled request ids
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # consumer: (rid, arrays | error)
        address = None
        self._server_thread = None
        if config.is_producer:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            bind = "*" if config.kv_ip in ("0.0.0.0", "") else config.kv_ip
            try:
                if config.kv_port == 0:
                    port = self._router.bind_to_random_port(f"tcp://{bind}")
                else:
                    self._router.bind(f"tcp://{bind}:{config.kv_port}")
                    port = config.kv_port
            except zmq.ZMQError as e:
                raise ValueError(f"kv_transfer_config.kv_port {config.kv_port}: cannot listen "
                                 f"on {config.kv_ip} ({e})") from None
            address = (self.host, port)
            self._server_thread = threading.Thread(target=self._serve, name="kv-server",
                                                   daemon=True)
        self.num_rows = len(getattr(scheduler.block_manager, "managers", [None]))
        self.state = KVTransferState(config, scheduler.block_size, address,
                                     num_rows=self.num_rows)
        scheduler.kv_transfer = self.state
        if self._server_thread is not None:
            self._server_thread.start()
        logger.info("KV transfer: %s as %s, transport %s%s", config.kv_connector,
                    config.kv_role, self.transport,
                    f", pulls served on {address[0]}:{address[1]}" if address else "")

    # -- the engine thread ----------------------------------------------------------------
    def before_schedule(self) -> list:
        """Free pulled and expired prefills; write arrived pulls into their pages and requeue
        their requests; fail the late ones. Returns the outputs of requests that ended."""
        st, sched = self.state, self.engine.scheduler
        bm = sched.block_manager
        while True:
            try:
                rid = self._pulled.get_nowait()
            except queue.Empty:
                break
            req = st.release(rid, pulled=True)
            if req is not None:
                bm.free(req)
                sched.free_state_snapshot(req)
        with self._lock:
            expired = st.expired_holds()
            reqs = [st.release(rid, pulled=False) for rid in expired]
        for rid, req in zip(expired, reqs):
            logger.warning("KV transfer: prefill %s was not pulled within %ss; its pages are "
                           "freed", rid, self.config.extra("abort_request_timeout"))
            bm.free(req)
            sched.free_state_snapshot(req)
        outputs = []
        while True:
            try:
                rid, result = self._done.get_nowait()
            except queue.Empty:
                break
            load = st.loading.get(rid)
            if load is None:
                continue  # aborted, or failed at its deadline meanwhile
            if isinstance(result, str):
                out = sched.remote_kv_failed(rid, result)
            else:
                pages_io.write_pulled(self.engine.runner,
                                      [[b for b in p if b] for p in load.pages], result,
                                      load.request.state_slot)
                sched.remote_kv_loaded(rid)
                out = None
            if out is not None:
                outputs.append(out)
        for load in st.expired_loads():
            r = load.remote
            out = sched.remote_kv_failed(
                load.request.request_id,
                f"kv_transfer_params: the prompt's KV cache did not arrive from "
                f"{r.host}:{r.port} (request {r.request_id}) within "
                f"{self.config.extra('kv_load_timeout')} s")
            if out is not None:
                outputs.append(out)
        return outputs

    def after_schedule(self, scheduled_any: bool) -> None:
        """Start the pulls the scheduler asked for (fresh pages taken this step)."""
        for load in self.state.loads_to_start():
            r = load.remote
            try:
                wanted = remote_pages(r, load.pages)
            except ValueError as e:
                self._done.put((load.request.request_id, f"kv_transfer_params: {e}"))
                continue
            # a thread each: one stuck on a dead producer holds up no other pull (its
            # request fails at the deadline regardless)
            threading.Thread(target=self._pull, name="kv-pull", daemon=True, args=(
                load.request.request_id, r, wanted,
                prompt_digest(load.request.prompt_token_ids), load.deadline)).start()
        if not scheduled_any and self.state.loading and not self.engine.scheduler.running:
            time.sleep(IDLE_SLEEP_S)  # only pulls in flight: do not spin the loop

    def stats(self) -> dict:
        return self.state.stats()

    def close(self) -> None:
        self._stop.set()
        if self._server_thread is not None:
            self._server_thread.join(timeout=2)

    # -- producer: the server thread ------------------------------------------------------
    def _serve(self) -> None:
        sock = self._router
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, _, body = sock.recv_multipart()
            try:
                frames = self._answer(_DEC.decode(body))
            except Exception as e:  # noqa: BLE001 - the consumer hears why
                logger.exception("KV transfer: a pull failed")
                frames = [_ENC.encode({"error": f"{type(e).__name__}: {e}"})]
            sock.send_multipart([ident, b"", *frames])
        sock.close(0)

    def _answer(self, msg: dict) -> list[bytes]:
        rid = msg.get("request_id")
        if msg.get("engine_id") != self.state.engine_id:
            return [_ENC.encode({"error": f"remote_engine_id {msg.get('engine_id')!r} is not "
                                          f"this instance ({self.state.engine_id})"})]
        with self._lock:
            held = self.state.held.get(rid)
            if held is None:
                return [_ENC.encode({"error": f"no prefill {rid!r} is held on "
                                              f"{self.state.engine_id} (never run here, "
                                              f"already pulled, or expired)"})]
            held.pulling = True
        try:  # served or refused, the held prefill is released: one pull per prefill
            return self._send(msg, held)
        finally:
            self._pulled.put(rid)

    def _send(self, msg: dict, held) -> list[bytes]:
        wanted = msg.get("group_block_ids")
        if not isinstance(wanted, list) or len(wanted) != len(held.pages):
            return [_ENC.encode({"error": f"the pull names pages of "
                                          f"{len(wanted) if isinstance(wanted, list) else 0} "
                                          f"cache groups, the prefill has {len(held.pages)}"})]
        for g, (ids, have) in enumerate(zip(wanted, held.pages)):
            if not set(ids) <= set(have) - {0}:
                return [_ENC.encode({"error": f"remote_block_ids do not match prefill "
                                              f"{held.request.request_id!r} (cache group {g})"})]
        if msg.get("layout") != [[list(s), d] for s, d in self.layout]:
            return [_ENC.encode({"error": "the KV page layouts differ (same model, "
                                          "--block-size and --kv-cache-dtype on both sides)"})]
        if msg.get("prompt_digest") != prompt_digest(held.prompt_token_ids):
            return [_ENC.encode({"error": "the decode's prompt differs from the prefilled "
                                          "one"})]
        if msg.get("state_layout", []) != [[list(s), d] for s, d in self.state_layout]:
            return [_ENC.encode({"error": "the recurrent-state layouts differ (same model on "
                                          "both sides)"})]
        if self.state_layout and held.state_slot < 0:
            return [_ENC.encode({"error": "the prefill kept no recurrent state for its "
                                          "decode (no free state slot when it ran)"})]
        arrays = pages_io.gather_pages(self.engine.runner, wanted,
                                       held.state_slot if self.state_layout else -1)
        if msg.get("transport") == "jax" and self.transfer is not None:
            uid = uuid.uuid4().int >> 65
            self.transfer.offer(uid, arrays)
            return [_ENC.encode({"uuid": uid, "port": self.transfer.port})]
        host = [np.ascontiguousarray(a).view(np.uint8) for a in pages_io.to_host(arrays)]
        return [_ENC.encode({"num_arrays": len(host)}), *host]

    # -- consumer: one worker thread per pull ---------------------------------------------
    def _pull(self, rid: str, remote, wanted: list[list[int]], digest: int,
              deadline: float) -> None:
        try:
            self._done.put((rid, self._fetch(remote, wanted, digest, deadline)))
        except Exception as e:  # noqa: BLE001 - the request ends with it
            self._done.put((rid, f"kv_transfer_params: pulling the KV cache from "
                                 f"{remote.host}:{remote.port} failed: {type(e).__name__}: {e}"))

    def _fetch(self, remote, wanted: list[list[int]], digest: int, deadline: float):
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{remote.host}:{remote.port}")
            layout = [[list(s), d] for s, d in self.layout]
            sock.send_multipart([b"", _ENC.encode(dict(
                request_id=remote.request_id, engine_id=remote.engine_id,
                group_block_ids=wanted, layout=layout, prompt_digest=digest,
                state_layout=[[list(s), d] for s, d in self.state_layout],
                transport=self.transport))])
            wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
            if not sock.poll(wait_ms):
                return (f"kv_transfer_params: no answer from the prefill instance at "
                        f"{remote.host}:{remote.port} within "
                        f"{self.config.extra('kv_load_timeout')} s")
            _, head, *frames = sock.recv_multipart(copy=False)
            info = _DEC.decode(head.bytes)
            if "error" in info:
                return f"kv_transfer_params: the prefill instance refused the pull: " \
                       f"{info['error']}"
            # the producer pads its gather so
            n = pages_io.page_bucket(max(len(p) for p in wanted))
            if "uuid" in info:
                return self.transfer.pull(f"{remote.host}:{info['port']}", info["uuid"],
                                          self.layout, n, self.state_layout)
            shapes = [((s[0], n, *s[1:]), d) for s, d in self.layout] + self.state_layout
            if len(frames) != len(shapes):
                return "kv_transfer_params: the pull's reply is incomplete"
            return [np.frombuffer(f.buffer, dtype=_np_dtype(d)).reshape(s)
                    for f, (s, d) in zip(frames, shapes)]
        finally:
            sock.close(0)


def remote_pages(remote, pages: list[list[int]]) -> list[list[int]]:
    """Per pool, the producer's pages of the positions this instance took pages for (``pages``
    by position, 0 where a sliding window needs none); ValueError where the producer has none
    there (a prompt longer than its params, another window)."""
    theirs = remote.pages_by_row(len(pages))
    out = []
    for g, (mine, have) in enumerate(zip(pages, theirs)):
        if len(mine) > len(have):
            name = "remote_block_ids" if remote.group_block_ids is None else \
                f"remote_group_block_ids[{g}]"
            raise ValueError(f"{name} has {len(have)} pages, the prompt needs {len(mine)}")
        missing = [c for c, b in enumerate(mine) if b and not have[c]]
        if missing:
            raise ValueError(f"remote_group_block_ids[{g}] has no page at position(s) "
                             f"{missing} (released out of the producer's window)")
        out.append([have[c] for c, b in enumerate(mine) if b])
    return out


def _np_dtype(name: str):
    import jax.numpy as jnp
    return jnp.dtype(name)


def check_supported(engine) -> None:
    """Pages move per pool (a sliding-window pool: the pages of the last prompt token's
    window) and a recurrent state as its slot's arrays; a request's pages must be all it
    needs: one host, no draft model (its own pool would stay empty)."""
    par = engine.config.parallel
    if par.num_hosts > 1 or par.pipeline_parallel_size > 1 or engine.config.speculative:
        raise InvalidRequestError("--kv-transfer-config runs on one host, without pipeline "
                                  "parallelism or speculative decoding",
                                  param="kv_transfer_config")
