"""Configuration dataclasses: the one place that maps CLI flags / ``LLM(...)`` kwargs to fields.

Names and defaults follow vLLM. ``ModelConfig`` (HF config.json -> our fields) lives here too.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    swap_space: float = 4.0  # GiB of host memory for swapped-out pages
    cache_dtype: str = "auto"

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be >= 2 (page 0 is the trash page)")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own limit
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    min_token_bucket: int = 16

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    num_hosts: int = 1
    host_index: int = 0
    coordinator: str | None = None

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")


@dataclass
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: bf16 on GPU, float32 on CPU
    seed: int = 0
    load_format: str = "auto"  # auto | safetensors | gguf | orbax | dummy
    attention_backend: str = "auto"  # auto | reference | pallas
    served_model_name: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
