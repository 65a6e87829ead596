"""Multi-host serving: a leader runs the scheduler and the HTTP server, followers replay its steps.

JAX is multi-controller: every process must issue the same jitted computations, in the same
order, on the global mesh. So every host builds the same ``LLMEngine`` (weights, KV pool shard,
warm-up), then:

* the **leader** (host 0) serves as usual; its ``runner.dispatch`` first broadcasts the step's
  arguments (the StepPlan's numpy arrays, pickled) to all hosts, then runs the step;
* each **follower** loops: receive a step, run ``runner.dispatch`` with it, discard the
  (replicated) result.

The broadcast is ``jax.experimental.multihost_utils.broadcast_one_to_all``, in two calls: a fixed
``int64[2]`` header (command, payload length), then the payload bytes as ``uint8[n]``. When the
leader is idle it sends a no-op every ``HEARTBEAT_S`` so followers' collectives never sit
waiting long; on shutdown it sends STOP and followers exit 0. Only the leader's scheduler
exists, so host-side state (block tables, prefix cache) cannot diverge. Swap preemption
(host copies of pages outside the step) is not replayed: multi-host requires ``recompute``.
The payload is pickle: hosts of one deployment trust each other (as with jax.distributed).
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time

import numpy as np

from jaxserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

CMD_STOP, CMD_STEP, CMD_NOOP = 0, 1, 2
HEARTBEAT_S = 10.0


def initialize(num_hosts: int, host_index: int, coordinator: str | None) -> None:
    """``jax.distributed.initialize`` (before any other JAX call); CPU collectives use gloo."""
    if num_hosts < 1:
        raise InvalidRequestError(f"num_hosts must be >= 1, got {num_hosts}", param="num_hosts")
    if num_hosts == 1:
        return
    if not 0 <= host_index < num_hosts:
        raise InvalidRequestError(f"host_index must be in [0, {num_hosts}), got {host_index}",
                                  param="host_index")
    if not coordinator or ":" not in coordinator:
        raise InvalidRequestError("multi-host serving needs --coordinator ADDR:PORT (host 0's "
                                  "address, the same on every host)", param="coordinator")
    import jax

    try:  # only affects the CPU backend; GPUs use NCCL
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # noqa: BLE001 - option absent in some JAX builds
        pass
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_hosts,
                               process_id=host_index)
    logger.info("jax.distributed: host %d of %d, %d local / %d global devices", host_index,
                num_hosts, jax.local_device_count(), jax.device_count())


def check_config(config) -> None:
    """What multi-host serving needs: the mesh spans every device, steps are replayable."""
    import jax

    p = config.parallel
    if p.data_parallel_size > 1:
        raise InvalidRequestError("data_parallel_size > 1 is not supported across hosts",
                                  param="data_parallel_size")
    if p.tensor_parallel_size * p.pipeline_parallel_size != jax.device_count():
        raise InvalidRequestError(
            f"with {p.num_hosts} hosts, --tensor-parallel-size x --pipeline-parallel-size must "
            f"equal the global device count ({jax.device_count()}), got "
            f"{p.tensor_parallel_size} x {p.pipeline_parallel_size}",
            param="tensor_parallel_size")
    if config.scheduler.preemption_mode != "recompute":
        raise InvalidRequestError("multi-host serving needs preemption_mode='recompute'",
                                  param="preemption_mode")


class StepChannel:
    """Leader -> all hosts: (command, bytes) through two ``broadcast_one_to_all`` calls."""

    def __init__(self):
        import jax

        self.is_leader = jax.process_index() == 0
        self.lock = threading.Lock()  # one collective at a time on the leader
        self.last_send = time.monotonic()
        self.num_steps = 0

    def _broadcast(self, cmd: int, payload: bytes) -> tuple[int, bytes]:
        from jax.experimental import multihost_utils as mu

        if self.is_leader:
            header = np.array([cmd, len(payload)], np.int64)
        else:
            header = np.zeros(2, np.int64)
        header = np.asarray(mu.broadcast_one_to_all(header))
        cmd, n = int(header[0]), int(header[1])
        if n == 0:
            return cmd, b""
        buf = np.frombuffer(payload, np.uint8) if self.is_leader else np.zeros(n, np.uint8)
        return cmd, np.asarray(mu.broadcast_one_to_all(buf)).tobytes()

    def send(self, cmd: int, payload: bytes = b"") -> None:
        """Leader only; callers hold ``lock``."""
        self._broadcast(cmd, payload)
        self.last_send = time.monotonic()

    def recv(self) -> tuple[int, bytes]:
        return self._broadcast(CMD_NOOP, b"")


class Leader:
    """The leader engine's runner broadcasts each step before it runs (``step_broadcast``):
    followers replay every dispatch, so their on-device last-sampled buffer stays the same."""

    def __init__(self, engine):
        self.channel = StepChannel()
        engine.runner.step_broadcast = self._broadcast_step
        self._stop = threading.Event()
        self._stopped = False
        self._beat = threading.Thread(target=self._heartbeat, name="jaxserve-heartbeat",
                                      daemon=True)
        self._beat.start()

    @contextlib.contextmanager
    def _broadcast_step(self, plan, mm=None, host_logits=None):
        """Send the step's arguments, then let it run, under the channel's lock (the
        heartbeat never interleaves)."""
        with self.channel.lock:
            self.channel.send(CMD_STEP, pickle.dumps(((plan, mm, host_logits), {}), protocol=5))
            self.channel.num_steps += 1
            yield

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S / 4):
            if time.monotonic() - self.channel.last_send < HEARTBEAT_S:
                continue
            if self.channel.lock.acquire(timeout=0.1):
                try:
                    if not self._stopped:
                        self.channel.send(CMD_NOOP)
                finally:
                    self.channel.lock.release()

    def stop(self) -> None:
        """Tell the followers to exit (once)."""
        self._stop.set()
        with self.channel.lock:
            if not self._stopped:
                self._stopped = True
                self.channel.send(CMD_STOP)


def follow(engine) -> int:
    """A follower's life after its engine is built: replay the leader's steps until STOP."""
    channel = StepChannel()
    dispatch = engine.runner.dispatch
    while True:
        cmd, payload = channel.recv()
        if cmd == CMD_STOP:
            logger.info("follower: leader stopped after %d steps", channel.num_steps)
            return 0
        if cmd == CMD_STEP:
            args, kwargs = pickle.loads(payload)
            dispatch(*args, **kwargs)
            channel.num_steps += 1
