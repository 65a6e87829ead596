"""The models a server answers to: the base model's served names and the LoRA adapters.

Each adapter is a model of its own in ``/v1/models`` (``parent`` = the base), and a request's
``model`` picks it. Adapters come from ``--lora-modules`` at start-up (a bad one stops the
server, naming it) and, when ``JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING`` (or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) is set, from ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's bodies and answers).
"""
from __future__ import annotations

import asyncio
import itertools
import os

from jaxserve.errors import InvalidRequestError
from jaxserve.lora.request import LoRARequest

RUNTIME_LORA_ENV = ("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_lora_updating() -> bool:
    """Whether the load/unload routes are on (either variable set to 1 / true)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true") for v in RUNTIME_LORA_ENV)


class ServingModels:
    """Served names -> (base or adapter). ``engine`` loads and checks adapters."""

    def __init__(self, engine, base_names: list[str], lora_modules: list[dict] | None = None):
        self.engine = engine
        self.base_names = list(base_names)
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._pending = [self._new(m["name"], m["path"], m.get("base_model_name"))
                         for m in (lora_modules or [])]

    @property
    def lora_enabled(self) -> bool:
        return getattr(self.engine.config, "lora", None) is not None

    def _new(self, name: str, path: str, base: str | None) -> LoRARequest:
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("lora_name must be a non-empty string", param="lora_name")
        if not isinstance(path, str) or not path:
            raise InvalidRequestError(f"LoRA adapter {name!r}: lora_path must be a non-empty "
                                      "string", param="lora_path")
        if name in self.base_names:
            raise InvalidRequestError(f"LoRA adapter {name!r}: the name is the base model's",
                                      param="lora_name")
        if base is not None and base not in self.base_names:
            raise InvalidRequestError(f"LoRA adapter {name!r}: base_model_name {base!r} is not "
                                      f"a served model ({', '.join(self.base_names)})",
                                      param="base_model_name")
        return LoRARequest(name, next(self._ids), path, base_model_name=base)

    async def load_startup_adapters(self) -> None:
        """``--lora-modules``: each checked by the engine before the server answers."""
        pending, self._pending = self._pending, []
        for req in pending:
            await self.add(req)

    async def add(self, req: LoRARequest) -> None:
        if not self.lora_enabled:
            raise InvalidRequestError(f"LoRA adapter {req.lora_name!r}: LoRA is not enabled "
                                      "(start with --enable-lora)", param="lora_name")
        async with self._lock:
            if req.lora_name in self.loras:
                raise InvalidRequestError(
                    f"The lora adapter '{req.lora_name}' has already been loaded.",
                    param="lora_name")
            await self.engine.add_lora(req)
            self.loras[req.lora_name] = req

    async def load(self, name, path) -> LoRARequest:
        """``POST /v1/load_lora_adapter``."""
        req = self._new(name, path, None)
        await self.add(req)
        return req

    async def unload(self, name) -> None:
        """``POST /v1/unload_lora_adapter``: requests already running finish on it."""
        async with self._lock:
            req = self.loras.get(name) if isinstance(name, str) else None
            if req is None:
                raise InvalidRequestError(f"The lora adapter '{name}' cannot be found.",
                                          param="lora_name", status_code=404)
            del self.loras[name]
            await self.engine.remove_lora(req.lora_int_id)

    def resolve(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """A request's ``model`` -> (the name answered with, its adapter or None)."""
        if requested is None:
            return self.base_names[0], None
        if requested in self.base_names:
            return requested, None
        if requested in self.loras:
            return requested, self.loras[requested]
        raise InvalidRequestError(f"The model `{requested}` does not exist.", param="model",
                                  status_code=404)

    def cards(self, card_cls, root: str | None, max_model_len: int) -> list:
        cards = [card_cls(id=name, root=root or name, max_model_len=max_model_len)
                 for name in self.base_names]
        cards += [card_cls(id=r.lora_name, root=r.lora_path,
                           parent=r.base_model_name or self.base_names[0],
                           max_model_len=max_model_len) for r in self.loras.values()]
        return cards
