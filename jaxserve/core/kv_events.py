"""KV-cache events, as vLLM publishes them (``--kv-events-config``): what a prefix-aware router
needs to know which blocks each replica holds.

The block manager records an event whenever a page enters the prefix cache (``BlockStored``),
leaves it (``BlockRemoved``, on eviction) or the cache is dropped (``AllBlocksCleared``); the
engine publishes them once per step as a ``KVEventBatch``. The structs and their msgpack layout
(array-like, tagged by class name) are vLLM's, so its subscribers (llm-d's inference scheduler)
decode them unchanged. Host side only: msgspec, no jax, no zmq.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import msgspec

from jaxserve.core.json_object import config_from

MEDIUM = "GPU"  # vLLM's name for the device pool (swap would be "CPU")


def block_hash_bytes(h: int) -> bytes:
    """Our 128-bit hash chain links as 16 big-endian bytes (msgpack ints stop at 64 bits)."""
    return h.to_bytes(16, "big")


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged by class name on the wire)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: Optional[bytes]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


def decode_batch(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (the fields it has; ``publisher`` zmq or null)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self):
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got "
                             f"{self.publisher!r}")
        if self.replay_endpoint is not None:
            raise ValueError("kv_events_config.replay_endpoint is not supported (events are "
                             "published live only)")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: Any) -> "KVEventsConfig | None":
        """A dict, its JSON text (the CLI's form) or None; unknown keys are an error."""
        return config_from(cls, value, "kv_events_config")
