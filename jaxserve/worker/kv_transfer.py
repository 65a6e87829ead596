"""Pages of a runner's pools in and out for disaggregated prefill/decode (the device half of
engine/kv_connector.py): a prefill's pages gathered into device arrays (one ``(k, v)`` pair
of ``[Hkv, n, block, D]`` per paged layer, as swap moves them, then each state layer's
arrays at the prefill's state slot), a decode's pulled arrays written into its fresh pages
and slot, and ``jax.experimental.transfer``'s server that hands the
gathered arrays to another process without a host copy."""
from __future__ import annotations

import logging

import jax
import numpy as np

logger = logging.getLogger(__name__)


def page_layout(runner) -> list[tuple[tuple[int, ...], str]]:
    """(shape without the page axis, dtype) of every array a page transfer moves, in order:
    both sides must agree (same model, block size and KV dtype)."""
    out = []
    with runner._pool_lock:
        for i, _ in runner._pool_rows():
            for a in runner.kv_pages[i]:
                out.append(((a.shape[0], *a.shape[2:]), str(a.dtype)))
    return out


def state_layout(runner) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of one slot of every state layer's arrays, in order (none without
    LinearState layers)."""
    with runner._pool_lock:
        return [(tuple(a.shape[1:]), str(a.dtype)) for i in runner.state_layers
                for a in runner.kv_pages[i]]


def page_bucket(n: int) -> int:
    """Pages a transfer moves for ``n``: 1, 2, 3, 4, 6, 8, 12, 16, ... (two sizes an octave),
    so the gathers and scatters compile for a few shapes, padded by at most half."""
    b = 1
    while b < n:
        half = b + b // 2
        b = half if half >= n and half > b else 2 * b
    return b


def padded(ids: list[int], n: int) -> np.ndarray:
    """Page ids padded to ``n`` with the trash page (0): pads gather and take its garbage."""
    return np.asarray(list(ids) + [0] * (n - len(ids)), dtype=np.int32)


def gather_pages(runner, pages: list[list[int]], state_slot: int = -1) -> list:
    """The pages (ids per pool, padded to ``page_bucket``) as fresh device arrays, flat: k, v
    of each paged layer, then (``state_slot`` >= 0) each state layer's arrays at that slot.
    Only enqueued under the pool lock; reading them does not hold up the next step."""
    n = page_bucket(max(len(p) for p in pages))
    idx = [jax.numpy.asarray(padded(p, n)) for p in pages]
    with runner._pool_lock:
        out = [a[:, idx[g]] for i, g in runner._pool_rows() for a in runner.kv_pages[i]]
        if state_slot >= 0:
            slot = jax.numpy.asarray(state_slot, dtype=jax.numpy.int32)
            out += [a[slot] for i in runner.state_layers for a in runner.kv_pages[i]]
        return out


def to_host(arrays: list) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.device_get(arrays)]


def write_pulled(runner, pages: list[list[int]], arrays: list, state_slot: int = -1) -> None:
    """Write pulled arrays (flat, as ``gather_pages`` made them: padded) into this runner's
    pages, and the state arrays after them into ``state_slot``; the pads go to the trash
    page."""
    n = page_bucket(max(len(p) for p in pages))
    n_paged = sum(len(runner.kv_pages[i]) for i, _ in runner._pool_rows())
    saved = [tuple(arrays[2 * k:2 * k + 2]) for k in range(n_paged // 2)]
    runner.swap_in([padded(p, n).tolist() for p in pages], saved)
    if state_slot >= 0 and runner.state_layers:
        rest, states = iter(arrays[n_paged:]), []
        for i in runner.state_layers:
            states.append(tuple(next(rest) for _ in runner.kv_pages[i]))
        runner.swap_in_state(state_slot, states)


def jax_transfer_supported(runner) -> bool:
    """The transfer server moves single-device arrays here; a sharded or pipelined pool goes
    host-staged (its arrays would need the same layout on both sides)."""
    try:
        from jax.experimental import transfer  # noqa: F401
    except ImportError:
        return False
    return runner.mesh is None and runner.stages is None and runner.kv_config is not None


class TransferServer:
    """``jax.experimental.transfer``'s server: offers arrays under a uuid until pulled, and
    pulls another server's."""

    def __init__(self, bind_host: str):
        from jax.experimental import transfer
        self.device = jax.local_devices()[0]
        host = "0.0.0.0" if bind_host in ("0.0.0.0", "") else bind_host
        self._server = transfer.start_transfer_server(self.device.client, f"{host}:0",
                                                      [f"{host}:0"])
        self._conns: dict[str, object] = {}

    @property
    def port(self) -> int:
        return int(self._server.address().rsplit(":", 1)[1])

    def offer(self, uuid: int, arrays: list) -> None:
        self._server.await_pull(uuid, arrays)

    def pull(self, address: str, uuid: int, layout, num_pages: int, states=()) -> list:
        """The offered arrays on this device (blocks until they arrived): ``layout``'s pages
        then ``states``' slot arrays."""
        conn = self._conns.get(address)
        if conn is None:
            conn = self._conns[address] = self._server.connect(address)
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        specs = [jax.ShapeDtypeStruct((shape[0], num_pages, *shape[1:]), jax.numpy.dtype(dtype),
                                      sharding=sharding) for shape, dtype in layout]
        specs += [jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype), sharding=sharding)
                  for shape, dtype in states]
        arrays = conn.pull(uuid, specs)
        jax.block_until_ready(arrays)
        return list(arrays)
