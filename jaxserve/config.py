"""Configuration dataclasses, resolved once: what the engine runs with.

Names and defaults follow vLLM. Flags and ``LLM(...)`` keywords become these through
``jaxserve.args.EngineArgs``. ``ModelConfig`` (HF config.json -> our fields) lives here too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jaxserve.core.kv_events import KVEventsConfig
from jaxserve.core.kv_transfer import KVTransferConfig
from jaxserve.core.kv_offload import OFFLOADING_BACKENDS
from jaxserve.core.pooling_params import RUNNERS, PoolerConfig

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
SCHEDULING_POLICIES = ("fcfs", "priority")
TOKENIZER_MODES = ("auto", "hf")  # both load the checkpoint's Hugging Face tokenizer


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    swap_space: float = 4.0  # GiB of host memory for swapped-out pages
    # --kv-cache-dtype: auto (the serving dtype; bfloat16 for int8 weights on CPU, see
    # engine.builder.cpu_kv_dtype) | bfloat16 | float32 | fp8 | fp8_e4m3 | fp8_e5m2
    cache_dtype: str = "auto"
    # --calculate-kv-scales: float8 K/V scales from calibration text before serving
    calculate_kv_scales: bool = False
    # --kv-offloading-size: GiB of host memory for the prefix cache's host tier (None: off);
    # --kv-offloading-backend: native (jaxserve's own; vLLM's lmcache is refused); None:
    # native once a size is given
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None

    def __post_init__(self):
        if self.kv_offloading_size is not None and not (
                isinstance(self.kv_offloading_size, (int, float))
                and 0 < self.kv_offloading_size < float("inf")):
            raise ValueError(f"kv_offloading_size must be a positive number of GiB, got "
                             f"{self.kv_offloading_size!r}")
        if self.kv_offloading_backend is None:
            pass
        elif self.kv_offloading_size is None:
            raise ValueError("kv_offloading_backend needs kv_offloading_size (the host tier's "
                             "GiB)")
        elif self.kv_offloading_backend not in OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend must be one of {OFFLOADING_BACKENDS}, got "
                             f"{self.kv_offloading_backend!r}")
        elif self.kv_offloading_backend != "native":
            raise ValueError(f"kv_offloading_backend {self.kv_offloading_backend!r} is not "
                             "supported: jaxserve has the native host tier only (use 'native')")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.cache_dtype!r} is not one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.calculate_kv_scales and not self.cache_dtype.startswith("fp8"):
            raise ValueError("calculate_kv_scales needs a float8 kv_cache_dtype (fp8, fp8_e4m3 "
                             f"or fp8_e5m2), got kv_cache_dtype {self.cache_dtype!r}")
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
    # --scheduling-policy: priority orders waiting requests by (priority, arrival); fcfs by
    # arrival only, and a request that names a priority is an error (vLLM)
    policy: str = "priority"
    min_token_bucket: int = 16
    token_bucket_growth: int = 2  # ladder ratio between token buckets
    # keep every page of a sequence whose layers are all windowed (vLLM's flag of this name)
    disable_hybrid_kv_cache_manager: bool = False
    # Limits the user left unset: ``for_platform`` gives them the platform's defaults.
    backend_defaults: tuple[str, ...] = ()

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
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got"
                             f" {self.policy!r}")

    def for_platform(self, platform: str) -> "SchedulerConfig":
        """This config with the limits left unset at ``platform``'s defaults (a new config)."""
        defaults = PLATFORM_SCHEDULER_DEFAULTS["gpu" if platform == "gpu" else "cpu"]
        return dataclasses.replace(self, backend_defaults=(),
                                   **{name: defaults[name] for name in self.backend_defaults})


# Scheduler limits a user leaves unset, per platform (``SchedulerConfig.for_platform``).
# vLLM's defaults on a GPU. On CPU the ladder starts at 1 so single-request decode pays for one
# row, and doubles so a decode batch of up to 32 rows is padded by less than 2x (a small-M
# matmul costs nearly in proportion to M there); 256 tokens per step already reach the matmul's
# peak on a CPU. vLLM's CPU budget (4096 offline, 2048 served) is not taken: each bucket above
# 256 is compiled and run at warm-up, and a cached start of SmolLM2 on 2 cores took 56 / 75 /
# 95 / 144 s at 256 / 1024 / 2048 / 4096, to gain ~1 s of prefill on 32 x 128 prompt tokens
# (7.4-8.0 s in one step against 8.3 s in sixteen); pass ``max_num_batched_tokens`` for long
# offline batches.
PLATFORM_SCHEDULER_DEFAULTS = {
    "gpu": dict(max_num_seqs=256, max_num_batched_tokens=2048, min_token_bucket=16,
                token_bucket_growth=2),
    "cpu": dict(max_num_seqs=32, max_num_batched_tokens=256, min_token_bucket=1,
                token_bucket_growth=2),
}


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE: experts split whole over the tp devices
    num_hosts: int = 1
    host_index: int = 0
    coordinator: str | None = None
    pipeline_parallel_size: int = 1

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")


# --quantization methods (vLLM's names) jaxserve implements; see jaxserve/models/quantization.py.
QUANTIZATION_METHODS = ("fp8", "int8", "awq", "gptq", "gguf")

SPEC_METHODS = ("ngram", "draft_model", "mtp")
# vLLM's per-family names for a checkpoint's own multi-token-prediction head (model cards write
# them): all are our "mtp", the head found in the target checkpoint.
MTP_METHOD_ALIASES = ("deepseek_mtp", "mimo_mtp", "glm4_moe_mtp", "ernie_mtp", "qwen3_next_mtp",
                      "qwen3_5_mtp", "longcat_flash_mtp", "pangu_ultra_moe_mtp")
_SPEC_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                "model", "draft_tensor_parallel_size")


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config``: who proposes ``num_speculative_tokens`` tokens per step.

    ``ngram`` looks the last ``prompt_lookup_min..prompt_lookup_max`` tokens up in the request's
    own prompt + output (vLLM's defaults: max 5, min = max when only max is given, else 1).
    ``draft_model`` names a smaller model with the target's tokenizer (``model``), run
    unsharded (``draft_tensor_parallel_size`` 1). ``mtp`` drafts with the target checkpoint's
    own multi-token-prediction head (``mtp.*``, Qwen 3.5 / 3.6); it takes no other field, and
    vLLM's family spellings (``qwen3_5_mtp``, ``qwen3_next_mtp``, ``deepseek_mtp`` ...) mean it.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self):
        if self.method in MTP_METHOD_ALIASES:
            self.method = "mtp"
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got"
                             f" {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer >= 1,"
                             f" got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model is not used by method 'ngram'")
            hi, lo = self.prompt_lookup_max, self.prompt_lookup_min
            if hi is None and lo is None:
                hi, lo = 5, 5
            elif hi is None:
                hi = lo
            elif lo is None:
                lo = hi
            for name, v in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
                if not isinstance(v, int) or v < 1:
                    raise ValueError(f"speculative_config.{name} must be an integer >= 1, got"
                                     f" {v!r}")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <="
                                 f" prompt_lookup_max ({hi})")
            self.prompt_lookup_max, self.prompt_lookup_min = hi, lo
        elif self.method == "draft_model":
            if not self.model:
                raise ValueError("speculative_config.model is required for method"
                                 " 'draft_model'")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is only for method 'ngram'")
            if self.draft_tensor_parallel_size not in (None, 1):
                raise ValueError("speculative_config.draft_tensor_parallel_size: only 1 (the"
                                 " draft runs unsharded) is supported")
        elif self.method == "mtp":
            for name in ("model", "prompt_lookup_max", "prompt_lookup_min",
                         "draft_tensor_parallel_size"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is not used by method 'mtp'"
                                     " (the head is part of the target checkpoint)")

    @classmethod
    def from_dict(cls, d: dict | "SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """vLLM's dict spelling -> config; unknown keys are an error naming the key."""
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_SPEC_FIELDS))
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]} is not a supported field"
                             f" (supported: {', '.join(_SPEC_FIELDS)})")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**d)


@dataclass
class LoRAConfig:
    """--enable-lora: ``max_loras`` adapters per step in device slots of rank
    ``max_lora_rank``; ``max_cpu_loras`` loaded adapters kept on the host (None: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # --lora-allowed-paths: adapter directories must resolve under one of these (empty: any)
    allowed_paths: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")


@dataclass
class MultiModalConfig:
    """vLLM's multimodal flags: images per prompt (``--limit-mm-per-prompt '{"image": N}'``),
    settings laid over the checkpoint's image processor (``--mm-processor-kwargs``), whether
    processed images are cached by content (``--disable-mm-preprocessor-cache``) and the
    directory ``file://`` image URLs may read (``--allowed-local-media-path``) and the hosts
    http(s) image URLs may be fetched from (``--allowed-media-domains``)."""

    limit_mm_per_prompt: dict = field(default_factory=dict)
    mm_processor_kwargs: dict | None = None
    disable_mm_preprocessor_cache: bool = False
    allowed_local_media_path: str | None = None
    # hosts http(s) image URLs may be fetched from ("*": any); empty: http(s) URLs refused
    allowed_media_domains: tuple[str, ...] = ()

    MODALITIES = ("image", "video", "audio")
    DEFAULT_LIMIT = 999  # vLLM's default per modality

    def __post_init__(self):
        for k, v in self.limit_mm_per_prompt.items():
            if k not in self.MODALITIES:
                raise ValueError(f"limit_mm_per_prompt: unknown modality {k!r} (one of "
                                 f"{', '.join(self.MODALITIES)})")
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"limit_mm_per_prompt[{k!r}] must be an integer >= 0, got "
                                 f"{v!r}")

    def limit(self, modality: str) -> int:
        return int(self.limit_mm_per_prompt.get(modality, self.DEFAULT_LIMIT))


@dataclass
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: bf16 on GPU, float32 on CPU
    seed: int = 0
    load_format: str = "auto"  # auto | safetensors | gguf | orbax | dummy
    attention_backend: str = "auto"  # auto | reference | pallas
    # None: the checkpoint's own quantization_config; fp8 also quantizes a float checkpoint
    quantization: str | None = None
    # vLLM's lm_head_quantized: with fp8, the LM head (a tied embedding with it) in int8 too
    lm_head_quantized: bool = False
    served_model_name: str | None = None
    # schedule and dispatch step N+1 while step N runs (exact: same tokens as without)
    async_scheduling: bool = True
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # request defaults from the model's generation_config.json: auto | vllm (none) | a directory
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # vLLM's max_logprobs: the most (prompt) logprobs a request may ask for; -1 = the whole
    # vocabulary. Also the static top-k width of the sampler's logprobs (compiled once).
    max_logprobs: int = 20
    # --enforce-eager: no ahead-of-time bucket warm-up; each bucket compiles on its first step
    enforce_eager: bool = False
    # the most layers a request's return_hidden_states may name: the static width of the
    # step's hidden-state capture (0: no capture compiled in, requests asking are refused)
    max_hidden_state_layers: int = 0
    # --enable-prompt-embeds: prompts may be {"prompt_embeds": [n, hidden]} (the step then
    # takes [T, hidden] embeddings beside the token ids)
    enable_prompt_embeds: bool = False
    # vLLM's --logits-processors: "module:Class" strings or classes (core.logits_processor)
    logits_processors: tuple = ()
    # --batch-invariant (or VLLM_BATCH_INVARIANT=1): a request's logprobs bit-identical
    # whatever else is in its steps (models.batch_invariant)
    batch_invariant: bool = False
    # where the checkpoint comes from: a Hub revision, a download directory, and keys laid over
    # its config.json (--hf-overrides); remote code is never run (a config that needs it is an
    # error, trust_remote_code or not)
    revision: str | None = None
    download_dir: str | None = None
    hf_overrides: dict | None = None
    trust_remote_code: bool = False
    tokenizer_mode: str = "auto"
    # --kv-events-config: publish prefix-cache block events (vLLM's KVEventsConfig)
    kv_events: KVEventsConfig | None = None
    # --kv-transfer-config: disaggregated prefill/decode (vLLM's KVTransferConfig)
    kv_transfer: KVTransferConfig | None = None
    lora: LoRAConfig | None = None  # None: LoRA off (no --enable-lora)
    # a grammar not compiled within this many seconds fails its request (400)
    structured_outputs_compile_timeout: float = 5.0
    # --runner: auto (pooling for a sentence-transformers directory or a pooling-only
    # architecture, else generate) | generate | pooling; --task embed|score|classify also
    # selects pooling and names the default task
    runner: str = "auto"
    pooling_task: str | None = None
    pooler_config: PoolerConfig | None = None  # --pooler-config overrides the checkpoint's
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)

    def for_platform(self, platform: str) -> "EngineConfig":
        """Everything left to the platform resolved, once (a new config; nothing mutates it
        afterwards): the scheduler's unset limits and the attention backend (Pallas on GPU,
        the XLA path elsewhere)."""
        backend = self.attention_backend
        if backend in (None, "auto"):
            backend = "pallas" if platform == "gpu" else "xla"
        return dataclasses.replace(self, attention_backend=backend,
                                   scheduler=self.scheduler.for_platform(platform))

    def __post_init__(self):
        if (not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool)
                or self.max_logprobs < -1):
            raise ValueError(f"max_logprobs must be -1 (the whole vocabulary) or an integer >= 0,"
                             f" got {self.max_logprobs!r}")
        m = self.max_hidden_state_layers
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"max_hidden_state_layers must be an integer >= 0, got {m!r}")
        if m and self.speculative is not None:
            raise ValueError("max_hidden_state_layers > 0 with speculative decoding is not "
                             "supported (a verify step reads tokens it may reject)")
        if self.logits_processors and self.speculative is not None:
            raise ValueError("logits_processors with speculative decoding is not supported")
        if self.enable_prompt_embeds and self.speculative is not None:
            raise ValueError("enable_prompt_embeds with speculative decoding is not supported")
        if self.attention_backend == "mosaic" and self.cache.cache_dtype != "auto":
            # Its GPU test (tests/kernels/test_mosaic_gpu_attention.py) disagrees with the
            # reference on float8 pages under jax 0.11, so the engine does not serve them.
            raise ValueError(f"attention_backend 'mosaic' does not serve kv_cache_dtype "
                             f"{self.cache.cache_dtype!r}; use attention_backend 'triton' or "
                             f"'pallas' for float8 KV pages")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization {self.quantization!r} is not one of "
                             f"{', '.join(QUANTIZATION_METHODS)} (or None)")
        if not isinstance(self.lm_head_quantized, bool):
            raise ValueError(f"lm_head_quantized must be true or false, got "
                             f"{self.lm_head_quantized!r}")
        if self.lm_head_quantized and self.quantization not in (None, "fp8", "int8"):
            raise ValueError(f"lm_head_quantized needs quantization 'fp8' or 'int8' (got "
                             f"{self.quantization!r})")
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode must be one of {TOKENIZER_MODES}, got"
                             f" {self.tokenizer_mode!r}")
        if (self.kv_events is not None and self.kv_events.enabled
                and self.parallel.data_parallel_size > 1):
            raise ValueError("kv_events_config with data_parallel_size > 1 is not supported "
                             "yet (one publisher endpoint per replica)")
        if self.kv_transfer is not None and self.parallel.data_parallel_size > 1:
            raise ValueError("kv_transfer_config with data_parallel_size > 1 is not supported "
                             "yet (one kv_port per replica)")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict (JSON object), got"
                             f" {self.hf_overrides!r}")

    def model_source(self) -> dict:
        """The loader's keyword arguments that say where the checkpoint comes from."""
        return dict(revision=self.revision, download_dir=self.download_dir,
                    hf_overrides=self.hf_overrides, trust_remote_code=self.trust_remote_code)


_QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_moe")  # qkv bias without an `attention_bias` field in config.json
_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")
# transformers 4.x configs without `layer_types`: every n-th layer is global (Gemma 2: 1 in 2).
_SLIDING_PATTERN = {"gemma2": 2, "gemma3_text": 6, "gemma4_text": 6}


@dataclass
class ModelConfig:
    """The fields of an HF ``config.json`` the Llama-family forward needs, under one set of names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope parameters ("rope_type", "factor", ...); None = plain
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None = None  # Mistral; None = full attention
    layer_types: tuple[str, ...] | None = None  # HF per-layer "full_attention"/"sliding_attention"
    architecture: str = "LlamaForCausalLM"
    model_type: str = "llama"
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    hidden_act: str = "silu"
    enable_expert_parallel: bool = False  # serving choice (ParallelConfig), read by MoE families
    load_mtp: bool = False  # serving choice: build the checkpoint's MTP head (speculative "mtp")
    # The whole HF config.json: a family's own fields (soft-capping, experts, ...) are read from
    # here by its model module, so a new family needs no new ModelConfig field.
    hf: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of one layer (None = full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def attention_window(self) -> int | None:
        """The window every layer attends within (the largest), or None when some layer attends
        to the whole context: pages before it can be released (``BlockManager``)."""
        windows = [self.layer_sliding_window(i) for i in range(self.num_layers)]
        if not windows or any(w is None for w in windows):
            return None
        return max(windows)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)

    @classmethod
    def from_hf_config(cls, d: dict) -> "ModelConfig":
        """Map an HF config.json dict (transformers 4.x or 5.x spelling) to a ModelConfig."""
        d = dict(d)
        if "text_config" in d and "hidden_size" not in d:
            top = d
            d = {**d, **d["text_config"]}
            # the outer class (e.g. Qwen3_5ForConditionalGeneration) names the layout to load
            d["architectures"] = top.get("architectures") or d.get("architectures")
        if "intermediate_size" not in d and "moe_intermediate_size" in d:
            d["intermediate_size"] = d["moe_intermediate_size"]  # every layer sparse (Qwen3.5 MoE)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in d:
                raise ValueError(f"config.json lacks {key!r}")
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        model_type = d.get("model_type", "llama")
        num_heads = int(d["num_attention_heads"])
        num_kv = int(d.get("num_key_value_heads") or num_heads)
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads

        # transformers 5 folds rope_theta and rope_scaling into `rope_parameters`, per layer type
        # when layer types differ (Gemma 3); the global layers' rope is the model's rope here.
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        rope = dict(rope) if rope else {}
        if isinstance(rope.get("full_attention"), dict):
            rope = dict(rope["full_attention"])
        rope_theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type in ("default", None) and not {"factor"} & rope.keys():
            rope_scaling = None
        else:
            rope.pop("type", None)
            rope["rope_type"] = "longrope" if rope_type == "su" else rope_type
            if rope["rope_type"] == "longrope":  # 4.x keeps the original length at the top
                rope.setdefault("original_max_position_embeddings",
                                d.get("original_max_position_embeddings"))
            rope_scaling = rope

        sliding = d.get("sliding_window")
        if d.get("use_sliding_window") is False:
            sliding = None
        layer_types = d.get("layer_types")
        if layer_types is None and sliding and d.get("use_sliding_window") and \
                "max_window_layers" in d:  # transformers 4.x Qwen2/Qwen3 spelling
            layer_types = ["sliding_attention" if i >= d["max_window_layers"] else
                           "full_attention" for i in range(int(d["num_hidden_layers"]))]
        if layer_types is None and sliding and model_type in _SLIDING_PATTERN:
            every = int(d.get("sliding_window_pattern") or _SLIDING_PATTERN[model_type])
            layer_types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                           for i in range(int(d["num_hidden_layers"]))]
        if layer_types is not None:
            layer_types = tuple(layer_types)
            if "sliding_attention" not in layer_types:
                sliding = None

        attention_bias = d.get("attention_bias")
        if attention_bias is None:
            attention_bias = model_type in _QKV_BIAS_MODEL_TYPES
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(attention_bias),
            qk_norm=model_type in _QK_NORM_MODEL_TYPES,
            sliding_window=int(sliding) if sliding else None,
            layer_types=layer_types,
            architecture=archs[0],
            model_type=model_type,
            eos_token_id=d.get("eos_token_id"),
            bos_token_id=d.get("bos_token_id"),
            hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "silu",
            hf=d,
        )


def __getattr__(name: str):
    """``jaxserve.config.engine_config_from_kwargs``: the name's earlier home, kept for callers;
    the mapping itself is ``jaxserve.args.EngineArgs``."""
    if name == "engine_config_from_kwargs":
        from jaxserve.args import engine_config_from_kwargs

        return engine_config_from_kwargs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
