"""Publishes the block manager's KV-cache events over ZMQ, vLLM's wire format: a PUB socket
bound to ``endpoint`` sends ``[topic, sequence number (8 bytes, big-endian), msgpack
KVEventBatch]`` once per engine step that has events."""
from __future__ import annotations

import time
import weakref

import msgspec
import zmq

from jaxserve.core.kv_events import KVEventBatch, KVEventsConfig


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None):
        self._topic = config.topic.encode()
        self._rank = data_parallel_rank
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(config.endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        weakref.finalize(self, self._socket.close, 0)

    def publish(self, events: list) -> None:
        if not events:
            return
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank)
        self._socket.send_multipart(
            [self._topic, self._seq.to_bytes(8, "big"), self._encoder.encode(batch)])
        self._seq += 1

    def close(self) -> None:
        self._socket.close(0)
