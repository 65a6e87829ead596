"""``LoRARequest``: which adapter a request runs with (vLLM's class and field names)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter by name, id and path. ``lora_int_id`` (> 0) is the adapter's identity in
    the engine: two requests with the same id share its device slot and its cached prefixes."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    long_lora_max_len: int | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_int_id must be an integer "
                             f">= 1, got {self.lora_int_id!r}")
        if self.long_lora_max_len is not None:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: long_lora_max_len is not "
                             "supported")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
