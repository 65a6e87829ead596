"""The host side of multi-LoRA: known adapters, the host cache and the device-slot LRU.

Host only (no jax): loading from disk and writing a device slot are callables given by the
builder. ``add`` checks and caches an adapter when a request names it; ``prepare`` gives each
adapter of a step a device slot, evicting the least recently used slot that this step does not
use. The scheduler keeps a step's adapters within ``max_loras``, so a step always fits.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable

from jaxserve.errors import InvalidRequestError
from jaxserve.lora.request import LoRARequest


class LoRAManager:
    """``max_loras`` device slots and a host cache of ``max_cpu_loras`` loaded adapters.

    ``load(request) -> adapter`` reads and checks an adapter (raises naming it);
    ``write(slot, adapter)`` lays it into a device slot."""

    def __init__(self, max_loras: int, max_cpu_loras: int, load: Callable, write: Callable):
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras "
                             f"({max_loras})")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._load, self._write = load, write
        self._known: dict[int, LoRARequest] = {}  # every adapter a request or the server named
        self._host: OrderedDict[int, object] = OrderedDict()  # id -> adapter, oldest first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # id -> device slot, LRU first
        self.num_slot_loads = 0  # adapters written to a device slot (a measure of churn)

    # -- adapters ------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> None:
        """Check the adapter (loading it into the host cache) and remember it. An id already
        known under another name or path is an error."""
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got "
                                      f"{type(request).__name__}", param="lora_request")
        known = self._known.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name,
                                                                        request.lora_path):
            raise InvalidRequestError(
                f"LoRA adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} is "
                f"already used by adapter {known.lora_name!r}", param="lora_request")
        self._host_adapter(request)
        self._known[request.lora_int_id] = request

    def is_loaded(self, request: LoRARequest) -> bool:
        """Whether the adapter is in the host cache (``add`` then reads nothing)."""
        return (isinstance(request, LoRARequest) and request.lora_int_id in self._host
                and not self._conflicts(request))

    def _conflicts(self, request: LoRARequest) -> bool:
        known = self._known.get(request.lora_int_id)
        return known is not None and ((known.lora_name, known.lora_path)
                                      != (request.lora_name, request.lora_path))

    def read(self, request: LoRARequest):
        """Read and check an adapter without touching the caches: safe on a worker thread
        (jaxserve.engine.preparation); ``store`` then hands the result to the engine loop."""
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got "
                                      f"{type(request).__name__}", param="lora_request")
        return self._load(request)

    def store(self, request: LoRARequest, adapter) -> None:
        """Put an adapter ``read`` on a worker into the host cache (the engine loop's thread);
        one whose id another adapter holds is left out (``add`` then refuses it)."""
        if self._conflicts(request):
            return
        self._host[request.lora_int_id] = adapter
        self._host.move_to_end(request.lora_int_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot is free for others). False if it was not known."""
        self._host.pop(lora_int_id, None)
        self._slot_of.pop(lora_int_id, None)
        return self._known.pop(lora_int_id, None) is not None

    def list_loras(self) -> list[LoRARequest]:
        return list(self._known.values())

    def _host_adapter(self, request: LoRARequest):
        ad = self._host.get(request.lora_int_id)
        if ad is None:
            ad = self._load(request)
            self._host[request.lora_int_id] = ad
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        else:
            self._host.move_to_end(request.lora_int_id)
        return ad

    # -- device slots --------------------------------------------------------------------
    @property
    def resident(self) -> dict[int, int]:
        """Adapter id -> device slot, least recently used first."""
        return dict(self._slot_of)

    def prepare(self, requests: Iterable[LoRARequest]) -> dict[int, int]:
        """A device slot for each adapter of a step (loaded there if it is not); -> id -> slot."""
        want = {r.lora_int_id: r for r in requests}
        if len(want) > self.max_loras:
            raise ValueError(f"a step uses {len(want)} adapters > max_loras {self.max_loras}")
        for lid in want:
            if lid in self._slot_of:
                self._slot_of.move_to_end(lid)
        for lid, req in want.items():
            if lid in self._slot_of:
                continue
            used = set(self._slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:  # the least recently used slot this step does not need
                victim = next(v for v in self._slot_of if v not in want)
                slot = self._slot_of.pop(victim)
            self._write(slot, self._host_adapter(req))
            self.num_slot_loads += 1
            self._slot_of[lid] = slot
        return {lid: self._slot_of[lid] for lid in want}
