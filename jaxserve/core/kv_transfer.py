"""Disaggregated prefill and decode, host side (no jax): ``--kv-transfer-config`` (vLLM's
``KVTransferConfig`` fields), a request's ``kv_transfer_params`` (vLLM's NIXL protocol) and the
scheduler's bookkeeping of KV that leaves (held pages of a prefill) or arrives (a decode
waiting for its remote prefix).

The protocol, as vLLM's NixlConnector:

- a request with ``{"do_remote_decode": true}`` runs its prompt only (one output token); when
  it finishes, its pages are *held* (not freed) and its output carries the params a decode
  instance needs: ``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id``,
  ``remote_host``, ``remote_port``, ``remote_request_id``, ``remote_num_tokens``. The pages go
  back to the pool once pulled, or after ``abort_request_timeout`` seconds. A model with several
  cache groups (a pool per group: sliding-window and full attention) adds
  ``remote_group_block_ids``, one list per block-table row, indexed by page position (``0``: a
  page released out of a sliding window); ``remote_block_ids`` stays the first full-attention
  pool's list, as vLLM's single-group params. With a recurrent state the prefill also holds
  a copy of its state before the last prompt token (the decode computes that token again).
- a request with ``{"do_remote_prefill": true, ...}`` gets fresh pages for its first
  ``prompt - 1`` tokens, waits (beside the queue, holding nobody up) while the connector pulls
  them, then runs as if those tokens were computed: the last prompt token is computed here and
  samples the first output token. A pull that fails or does not arrive within
  ``kv_load_timeout`` seconds ends the request with an error (``kv_load_failure_policy``
  ``fail``), or computes the prompt locally (``recompute``); its pages are freed either way.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from jaxserve.core.json_object import config_from, json_object
from jaxserve.errors import InvalidRequestError

# our connector, and vLLM's names a seed command line uses for the same protocol
CONNECTOR_NAME = "JaxTransferConnector"
CONNECTOR_ALIASES = ("NixlConnector", "P2pNcclConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
TRANSPORTS = ("auto", "jax", "zmq")
FAILURE_POLICIES = ("fail", "recompute")

# kv_connector_extra_config keys and their defaults
EXTRA_DEFAULTS: dict[str, Any] = {
    # seconds a prefill's pages wait to be pulled (vLLM: VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
    "abort_request_timeout": 480.0,
    # seconds a decode waits for its pull before the failure policy applies
    "kv_load_timeout": 60.0,
    # auto: jax.experimental.transfer where it works, else host-staged over ZMQ
    "transport": "auto",
    # the host a decode instance is told to pull from (default: kv_ip)
    "advertise_host": None,
}

# the kv_transfer_params keys a request may carry (vLLM's, plus ours for the pull)
REQUEST_KEYS = ("do_remote_decode", "do_remote_prefill", "remote_block_ids",
                "remote_group_block_ids",
                "remote_engine_id", "remote_host", "remote_port", "remote_request_id",
                "remote_num_tokens", "tp_size")


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's ``KVTransferConfig`` (its fields; those about NCCL buffers are accepted and
    unused, since pages move through the transfer server or ZMQ)."""

    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str = "cuda"
    kv_buffer_size: float = 1e9
    kv_role: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False
    kv_load_failure_policy: str = "fail"

    def __post_init__(self):
        name = "kv_transfer_config"
        if self.kv_connector is None:
            raise ValueError(f"{name}.kv_connector is required (e.g. {CONNECTOR_NAME!r}, or "
                             f"vLLM's 'NixlConnector')")
        if self.kv_connector not in (CONNECTOR_NAME, *CONNECTOR_ALIASES):
            raise ValueError(f"{name}.kv_connector {self.kv_connector!r} is not supported; "
                             f"one of {[CONNECTOR_NAME, *CONNECTOR_ALIASES]}")
        if self.kv_role not in ROLES:
            raise ValueError(f"{name}.kv_role must be one of {list(ROLES)}, got "
                             f"{self.kv_role!r}")
        if self.kv_connector_module_path is not None:
            raise ValueError(f"{name}.kv_connector_module_path is not supported (connectors "
                             "are built in)")
        if self.enable_permute_local_kv:
            raise ValueError(f"{name}.enable_permute_local_kv is not supported")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"{name}.kv_load_failure_policy must be one of "
                             f"{list(FAILURE_POLICIES)}, got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"{name}.kv_port must be a port number, got {self.kv_port!r}")
        if self.kv_parallel_size < 1:
            raise ValueError(f"{name}.kv_parallel_size must be >= 1")
        extra = json_object(self.kv_connector_extra_config,
                            f"{name}.kv_connector_extra_config")
        unknown = sorted(set(extra) - set(EXTRA_DEFAULTS))
        if unknown:
            raise ValueError(f"{name}.kv_connector_extra_config: unknown key(s) {unknown}; "
                             f"known: {sorted(EXTRA_DEFAULTS)}")
        for key in ("abort_request_timeout", "kv_load_timeout"):
            v = extra.get(key, EXTRA_DEFAULTS[key])
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{name}.kv_connector_extra_config.{key} must be a positive "
                                 f"number of seconds, got {v!r}")
        if extra.get("transport", "auto") not in TRANSPORTS:
            raise ValueError(f"{name}.kv_connector_extra_config.transport must be one of "
                             f"{list(TRANSPORTS)}, got {extra['transport']!r}")
        object.__setattr__(self, "kv_connector_extra_config", extra)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str):
        return self.kv_connector_extra_config.get(key, EXTRA_DEFAULTS[key])

    @classmethod
    def parse(cls, value: Any) -> "KVTransferConfig | None":
        """A dict, its JSON text (the CLI's form) or None; unknown keys are an error."""
        return config_from(cls, value, "kv_transfer_config")


def _bad(msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"kv_transfer_params: {msg}", param="kv_transfer_params")


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode request's prompt KV waits: the producer's held pages."""

    block_ids: tuple[int, ...]
    engine_id: str
    host: str
    port: int
    request_id: str
    num_tokens: int
    # per block-table row, by page position (0: released out of a window); None: one pool
    group_block_ids: tuple[tuple[int, ...], ...] | None = None

    def pages_by_row(self, num_rows: int) -> list[list[int]]:
        """The producer's page of every position, per row of a pool layout of ``num_rows``."""
        if self.group_block_ids is None:
            if num_rows != 1:
                raise _bad(f"this model has {num_rows} cache groups: the params need "
                           "remote_group_block_ids (a prefill instance of the same model)")
            return [list(self.block_ids)]
        if len(self.group_block_ids) != num_rows:
            raise _bad(f"remote_group_block_ids has {len(self.group_block_ids)} lists, this "
                       f"model has {num_rows} cache groups")
        return [list(g) for g in self.group_block_ids]


def _page_ids(v) -> bool:
    return isinstance(v, list) and all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in v)


def parse_request_params(params: Any) -> tuple[bool, RemotePrefill | None]:
    """A request's ``kv_transfer_params`` -> (do_remote_decode, the remote prefill to pull or
    None); a 400 naming the field for anything malformed."""
    if not isinstance(params, dict):
        raise _bad(f"must be an object, got {type(params).__name__}")
    unknown = sorted(set(params) - set(REQUEST_KEYS))
    if unknown:
        raise _bad(f"unknown key(s) {unknown}; known: {sorted(REQUEST_KEYS)}")
    decode = params.get("do_remote_decode", False)
    prefill = params.get("do_remote_prefill", False)
    if not isinstance(decode, bool) or not isinstance(prefill, bool):
        raise _bad("do_remote_decode and do_remote_prefill must be booleans")
    if decode and prefill:
        raise _bad("do_remote_decode and do_remote_prefill cannot both be true")
    if not prefill:
        return decode, None
    missing = [k for k in ("remote_block_ids", "remote_engine_id", "remote_host",
                           "remote_port", "remote_request_id", "remote_num_tokens")
               if params.get(k) is None]
    if missing:
        raise _bad(f"do_remote_prefill needs {missing} (the prefill response's "
                   "kv_transfer_params, passed on unchanged)")
    ids = params["remote_block_ids"]
    if not _page_ids(ids):
        raise _bad("remote_block_ids must be a list of page ids")
    groups = params.get("remote_group_block_ids")
    if groups is not None:
        if not isinstance(groups, list) or not groups or not all(_page_ids(g) for g in groups):
            raise _bad("remote_group_block_ids must be a list (one per cache group) of lists "
                       "of page ids")
        groups = tuple(tuple(g) for g in groups)
    port, n = params["remote_port"], params["remote_num_tokens"]
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise _bad(f"remote_port must be a port number, got {port!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise _bad(f"remote_num_tokens must be a positive integer, got {n!r}")
    for k in ("remote_engine_id", "remote_host", "remote_request_id"):
        if not isinstance(params[k], str) or not params[k]:
            raise _bad(f"{k} must be a non-empty string")
    return False, RemotePrefill(tuple(ids), params["remote_engine_id"], params["remote_host"],
                                port, params["remote_request_id"], n, groups)


@dataclass
class HeldPrefill:
    """A finished prefill's pages kept for a decode instance to pull."""

    request: Any  # core.request.Request (its pages stay allocated)
    pages: list[list[int]]  # per pool, by position (0: released out of a window)
    num_tokens: int  # tokens whose K/V the pages hold
    prompt_token_ids: list[int]
    deadline: float
    pulling: bool = False
    # recurrent-state models: the slot holding the state before the last prompt token
    state_slot: int = -1


@dataclass
class PendingLoad:
    """A decode request whose first ``num_tokens`` prompt tokens are being pulled."""

    request: Any
    remote: RemotePrefill
    pages: list[list[int]]  # per pool by position, this instance's fresh pages (0: none,
    # out of a sliding window)
    num_tokens: int
    deadline: float
    started: bool = False


class KVTransferState:
    """The scheduler's side of the connector: which requests hold pages for a pull, which wait
    for one. The engine's connector (engine/kv_connector.py) moves the bytes and reports back
    with ``pulled`` / ``loaded`` / ``load_failed``; every method runs on the engine thread."""

    def __init__(self, config: KVTransferConfig, block_size: int,
                 address: tuple[str, int] | None = None, clock=time.monotonic,
                 num_rows: int = 1):
        self.config = config
        self.num_rows = num_rows  # block-table rows (a pool per cache group)
        # named in the params a prefill hands out (a random one per engine unless configured)
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self.block_size = block_size
        self.address = address  # (host, port) decode instances pull from
        self.clock = clock
        self.held: dict[str, HeldPrefill] = {}
        self.loading: dict[str, PendingLoad] = {}
        self.remote_decode: set[str] = set()  # requests that hold their pages when they end
        self.num_pulled_total = 0
        self.num_expired_total = 0
        self.num_loaded_total = 0
        self.num_load_failures_total = 0

    # -- requests in -------------------------------------------------------------------------
    def on_add(self, req) -> None:
        """Check a new request's ``kv_transfer_params`` against the role; a prefill runs one
        token; a decode is marked to pull (an n > 1 sibling shares its first child's pull)."""
        params = (getattr(req.sampling_params, "extra_args", None) or {}).get(
            "kv_transfer_params")
        req.remote_prefill = None
        if params is None:
            return
        decode, remote = parse_request_params(params)
        if decode:
            if not self.config.is_producer:
                raise _bad(f"do_remote_decode needs kv_role kv_producer or kv_both (this "
                           f"instance is {self.config.kv_role})")
            if req.prefix_parent is not None:
                raise _bad("do_remote_decode needs n = 1 (the decode request asks for n)")
            req.max_tokens = 1  # prefill only, as vLLM's proxy asks
            self.remote_decode.add(req.request_id)
        elif remote is not None:
            if not self.config.is_consumer:
                raise _bad(f"do_remote_prefill needs kv_role kv_consumer or kv_both (this "
                           f"instance is {self.config.kv_role})")
            if remote.num_tokens != req.num_prompt_tokens:
                raise _bad(f"remote_num_tokens {remote.num_tokens} differs from this "
                           f"prompt's {req.num_prompt_tokens} tokens")
            remote.pages_by_row(self.num_rows)  # the layout of this model's pools
            if req.prefix_parent is None and req.num_prompt_tokens > 1:
                req.remote_prefill = remote

    def wants_load(self, req) -> bool:
        return getattr(req, "remote_prefill", None) is not None

    def start_load(self, req, pages: list[list[int]], num_tokens: int) -> None:
        """``req`` got fresh pages for ``num_tokens`` tokens: pull them."""
        self.loading[req.request_id] = PendingLoad(
            req, req.remote_prefill, [list(p) for p in pages], num_tokens,
            self.clock() + float(self.config.extra("kv_load_timeout")))
        req.remote_prefill = None

    def loads_to_start(self) -> list[PendingLoad]:
        todo = [p for p in self.loading.values() if not p.started]
        for p in todo:
            p.started = True
        return todo

    def expired_loads(self) -> list[PendingLoad]:
        now = self.clock()
        return [p for p in self.loading.values() if now > p.deadline]

    def take_load(self, request_id: str) -> PendingLoad | None:
        return self.loading.pop(request_id, None)

    # -- requests out ------------------------------------------------------------------------
    def hold(self, req, status, pages: list[list[int]], full_row: int = 0) -> bool:
        """A request ends: True when it is a finished prefill whose pages wait for a pull
        (the caller then does not free them); its output carries the decode's params.
        ``pages``: per pool, the page of every computed position (0: released out of a
        window); ``full_row`` the first full-attention pool (``remote_block_ids``)."""
        self.loading.pop(req.request_id, None)  # ended while loading: its pages are freed
        if req.request_id not in self.remote_decode:
            return False
        self.remote_decode.discard(req.request_id)
        if status.finish_reason == "abort" or self.address is None or not any(pages):
            return False
        n = req.num_computed_tokens
        self.held[req.request_id] = HeldPrefill(
            req, [list(p) for p in pages], n, list(req.prompt_token_ids),
            self.clock() + float(self.config.extra("abort_request_timeout")),
            state_slot=getattr(req, "kv_state_snapshot", -1))
        host, port = self.address
        req.kv_transfer_params = dict(
            do_remote_decode=False, do_remote_prefill=True,
            remote_block_ids=list(pages[full_row]),
            remote_engine_id=self.engine_id, remote_host=host, remote_port=port,
            remote_request_id=req.request_id, remote_num_tokens=req.num_prompt_tokens,
            tp_size=1)
        if len(pages) > 1:
            req.kv_transfer_params["remote_group_block_ids"] = [list(p) for p in pages]
        return True

    def expired_holds(self) -> list[str]:
        now = self.clock()
        return [rid for rid, h in self.held.items() if now > h.deadline and not h.pulling]

    def release(self, request_id: str, pulled: bool):
        """Forget a held prefill (pulled, or expired): its request, whose pages the caller
        frees."""
        h = self.held.pop(request_id, None)
        if h is None:
            return None
        if pulled:
            self.num_pulled_total += 1
        else:
            self.num_expired_total += 1
        return h.request

    @property
    def num_held_pages(self) -> int:
        return sum(1 for h in self.held.values() for p in h.pages for b in p if b)

    def stats(self) -> dict:
        return dict(kv_transfer_held_requests=len(self.held),
                    kv_transfer_held_pages=self.num_held_pages,
                    kv_transfer_loading_requests=len(self.loading),
                    kv_transfer_pulled_total=self.num_pulled_total,
                    kv_transfer_expired_total=self.num_expired_total,
                    kv_transfer_loaded_total=self.num_loaded_total,
                    kv_transfer_load_failures_total=self.num_load_failures_total)
