"""``build_engine(config)``: everything an ``LLMEngine`` is made of, loaded and sized once.

Order matters and is written once here: the config resolved for the platform; the mesh; model
and tokenizer (side by side); max_model_len against the model's limit; a draft model; the
generation config and EOS ids; float8 KV scales (static, so before the runner splits the
model); the runner (cache groups, page pools, compiled steps); block manager and scheduler;
the proposer; then warm-up, in the background or waited for.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_coordinator import make_kv_cache_manager
from jaxserve.core.kv_cache_spec import LinearState
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.spec_decode import MtpProposer, NgramProposer
from jaxserve.engine.generation_config import eos_token_ids, load_generation_config
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.errors import InvalidRequestError
from jaxserve.loaders.model_loader import load_model, load_tokenizer, resolve_dtype
from jaxserve.models.attention import resolve_attention_backend
from jaxserve.sharding import engine_mesh, pipeline_mesh
from jaxserve.worker.kv_cache import kv_cache_dtype, page_bytes
from jaxserve.worker.kv_calibration import prepare_kv_scales
from jaxserve.worker.runner import ModelRunner, enable_compilation_cache
from pallas_kernels import cpu_kernels

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what `jaxserve serve` / `LLM()` serve by default


def resolve_config(config: EngineConfig) -> EngineConfig:
    """The config an engine runs with: the default model named when none is, and what the
    platform decides (``EngineConfig.for_platform``). The caller's config is left as it is."""
    if config.model is None:
        from jaxserve.loaders.gguf import default_model_path
        config = dataclasses.replace(
            config, model=default_model_path(),
            served_model_name=config.served_model_name or DEFAULT_MODEL_NAME)
    return config.for_platform(jax.default_backend())


def cpu_kv_dtype(config: EngineConfig, model, dtype) -> EngineConfig:
    """``kv_cache_dtype`` "auto" on the CPU backend with the C++ attention kernel, float32
    activations and int8 weights (W8A8: the quantized GGUF default) resolves to "bfloat16":
    half the pool's bytes, read by the kernel in place. Float32 weights keep float32 pages, so
    ``--dtype float32`` stays the exact mode; ``--kv-cache-dtype float32`` asks for them."""
    if (config.cache.cache_dtype != "auto" or jax.default_backend() != "cpu"
            or jnp.dtype(dtype) != jnp.float32 or config.attention_backend != "xla"
            or not cpu_kernels.available()):
        return config
    leaves = jax.tree_util.tree_leaves(model)
    if not any(hasattr(x, "dtype") and x.dtype == jnp.int8 for x in leaves):
        return config
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                 cache_dtype="bfloat16"))


def build_engine(config: EngineConfig, devices=None, background_warmup: bool = False
                 ) -> LLMEngine:
    """Load, size and warm up an engine. ``devices``: this replica's devices (data parallel;
    default all visible). ``background_warmup``: return once the model is loaded and compile
    the buckets on a thread pool (steps wait for the buckets they need; the scheduler keeps
    each step within the compiled ones)."""
    from jaxserve.loaders.sentence_transformers import uses_pooling_runner
    if uses_pooling_runner(config):  # an encoder: its own engine (jaxserve.engine.pooling_engine)
        from jaxserve.engine.pooling_engine import build_pooling_engine
        return build_pooling_engine(config)
    config = resolve_config(config)
    enable_compilation_cache()
    try:
        dtype = resolve_dtype(config.dtype)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="dtype") from None
    t0 = time.perf_counter()
    cpu_kernels.prebuild()  # a first start compiles the CPU kernels beside the model's load
    pp_mesh = _pipeline_mesh(config, devices)  # None: no pipeline parallelism
    if pp_mesh is None:
        mesh = engine_mesh(config.parallel, devices)  # None: plain single-device path
    else:  # weights load onto this host's first stage, then each stage takes its part
        from jaxserve.worker.stages import load_mesh
        mesh = load_mesh(pp_mesh, config.parallel.tensor_parallel_size)
    local = Path(str(config.model)).expanduser()
    # the attention kernel, chosen once: the model (and a draft model) carry this object
    try:
        attention = resolve_attention_backend(config.attention_backend)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="attention_backend") from None
    spec = config.speculative
    mtp = spec is not None and spec.method == "mtp"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # a local model's tokenizer loads beside its weights (transformers' import and the
        # vocabulary overlap the dequantization and placement)
        early = pool.submit(_load_tokenizer, local, config.tokenizer) if local.exists() else None
        try:
            model, mc, model_dir = load_model(
                config.model, dtype=config.dtype, load_format=config.load_format,
                attention_backend=attention, mesh=mesh,
                enable_expert_parallel=config.parallel.enable_expert_parallel,
                quantization=config.quantization, lm_head_quantized=config.lm_head_quantized,
                load_mtp=mtp, **config.model_source())
        except ValueError as e:
            if str(e).startswith("speculative_config"):  # no (usable) MTP head
                raise InvalidRequestError(str(e), param="speculative_config") from None
            raise
        tokenizer = early.result() if early is not None else \
            _load_tokenizer(model_dir, config.tokenizer)
    if mtp and model.mtp is None:
        raise InvalidRequestError(
            f"speculative_config.method 'mtp' needs a model with a multi-token-prediction "
            f"head (Qwen 3.5 / 3.6); {mc.architecture} has none", param="speculative_config")
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(model) if hasattr(x, "nbytes"))
    logger.info("loaded %s (%s, %.1f MiB of params) in %.1f s", config.model,
                jnp.dtype(dtype).name, param_bytes / 2**20, time.perf_counter() - t0)
    limit = mc.max_position_embeddings or 2048
    max_model_len = int(config.scheduler.max_model_len or limit)
    if max_model_len > limit:
        raise InvalidRequestError(
            f"max_model_len={max_model_len} exceeds the model's limit of {limit}",
            param="max_model_len")
    draft = draft_on = None
    extra_page_bytes = 0
    if spec is not None and spec.method == "draft_model":
        if config.parallel.num_hosts > 1:  # followers replay only the target's steps
            raise InvalidRequestError("speculative_config: method 'draft_model' runs on one"
                                      " host", param="speculative_config")
        from jaxserve.worker.draft_proposer import DraftModelProposer
        if pp_mesh is not None:  # the draft runs on the last stage (see draft_mesh)
            from jaxserve.worker.stages import draft_mesh
            draft_on = draft_mesh(pp_mesh)
        draft = DraftModelProposer.load_model(spec, config, attention,
                                              mc.vocab_size, mesh=draft_on)
        extra_page_bytes = page_bytes(draft[1], config.cache.block_size, dtype)
    try:
        generation_config = load_generation_config(
            config.generation_config, model_dir, config.override_generation_config)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="generation_config") from None
    eos = list(eos_token_ids(mc.eos_token_id, generation_config.get("eos_token_id"),
                             getattr(tokenizer, "eos_token_id", None)))
    if any(isinstance(s, LinearState) for s in model.cache_specs("float32")):
        check_state_pool_support(config, None if draft is None else draft[0])
    config = cpu_kv_dtype(config, model, dtype)
    # float8 KV scales are settled before the runner splits the model (they are static)
    prepare_kv_scales(model, mc, config.cache, kv_cache_dtype(config.cache.cache_dtype, dtype),
                      serving_dtype=dtype, tokenizer=tokenizer, max_model_len=max_model_len,
                      mesh=mesh)
    runner = ModelRunner(model, mc, config, max_model_len, dtype, param_bytes=param_bytes,
                         mesh=None if pp_mesh is not None else mesh,
                         extra_page_bytes=extra_page_bytes, pipeline_mesh=pp_mesh)
    lora_manager = _lora_manager(config, model, mc, runner, dtype) \
        if config.lora is not None else None
    prefix_caching = config.cache.enable_prefix_caching
    if runner.num_state_slots is not None and prefix_caching:
        logger.info("prefix caching is off: %s has LinearState (recurrent-state) layers, "
                    "whose state a cached attention prefix does not restore", mc.architecture)
        prefix_caching = False
    # one manager per pool and the state slots, combined (core.kv_cache_coordinator); pages
    # out of a window are freed unless a draft model (which lags behind and may attend
    # globally) reads the same page ids, or --disable-hybrid-kv-cache-manager
    block_manager = make_kv_cache_manager(
        runner.kv_config.manager_pools(), block_size=config.cache.block_size, num_state_slots=runner.num_state_slots,
        enable_prefix_caching=prefix_caching,
        record_events=config.kv_events is not None and config.kv_events.enabled,
        free_out_of_window=(not config.scheduler.disable_hybrid_kv_cache_manager
                            and draft is None))
    scheduler = Scheduler(config.scheduler, config.cache, block_manager, max_model_len,
                          page_bytes=runner.page_bytes,
                          eos_token_ids=eos,
                          max_loras=config.lora.max_loras if config.lora is not None else None)
    from jaxserve.worker.kv_offload import build_kv_offload
    try:
        scheduler.kv_offload, host_kv = build_kv_offload(
            config.cache, runner, block_manager, max_model_len,
            record_events=config.kv_events is not None and config.kv_events.enabled,
            num_hosts=config.parallel.num_hosts, draft_model=draft is not None)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="kv_offloading_size") from None
    proposer = None
    if spec is not None and spec.method == "ngram":
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                 spec.prompt_lookup_max)
    elif mtp:
        proposer = MtpProposer(spec.num_speculative_tokens)
    elif spec is not None:
        from jaxserve.worker.draft_proposer import DraftModelProposer
        proposer = DraftModelProposer.build(spec, config, *draft, runner, block_manager,
                                            max_model_len, dtype, mesh=draft_on)
    publisher = None
    if config.kv_events is not None and config.kv_events.enabled:
        from jaxserve.engine.kv_event_publisher import KVEventPublisher
        publisher = KVEventPublisher(config.kv_events)
    engine = LLMEngine(config, model=model, model_config=mc, model_dir=model_dir,
                       tokenizer=tokenizer, dtype=dtype, mesh=mesh, max_model_len=max_model_len,
                       generation_config=generation_config, eos_token_ids=eos, runner=runner,
                       block_manager=block_manager, scheduler=scheduler, proposer=proposer,
                       kv_event_publisher=publisher, lora_manager=lora_manager)
    engine.host_kv = host_kv
    if str(config.model).endswith(".gguf"):
        from jaxserve.loaders.gguf import release_readers
        release_readers()
    if config.logits_processors:
        from jaxserve.worker.logits_processors import LogitsProcessors
        engine.logits_processors = LogitsProcessors(config.logits_processors, config,
                                                    jax.local_devices()[0])
        runner.set_logits_processors(engine.logits_processors)
    if config.kv_transfer is not None:
        from jaxserve.engine.kv_connector import KVConnector
        engine.kv_connector = KVConnector(config.kv_transfer, engine)
    if background_warmup:
        # while buckets compile, each step stays within the largest compiled one
        runner.start_warmup(on_token_limit=scheduler.limit_tokens)
    else:
        runner.warmup()
    return engine


def _pipeline_mesh(config: EngineConfig, devices):
    """The ``(pp, tp)`` mesh when ``pipeline_parallel_size`` > 1 (too few devices, or a feature
    pipelining lacks, is a start-up error here, before any weight is read)."""
    if config.parallel.pipeline_parallel_size == 1:
        return None
    from jaxserve.worker.stages import check_config
    check_config(config)
    return pipeline_mesh(config.parallel.pipeline_parallel_size,
                         config.parallel.tensor_parallel_size, devices)


def check_state_pool_support(config: EngineConfig, draft_model=None) -> None:
    """What a model with a recurrent-state pool cannot do yet: errors naming the flag. Every
    speculative method verifies with the target's state rolled back to the last accepted token
    (per-token snapshots); a draft model with LinearState layers of its own is refused (its
    proposer keeps no state slots)."""
    specs = draft_model.cache_specs("float32") if draft_model is not None else []
    if any(isinstance(s, LinearState) for s in specs):
        raise InvalidRequestError(
            "--speculative-config: a draft model with LinearState (Gated DeltaNet) layers is "
            "not supported (use method 'mtp', 'ngram', or an attention-only draft model)",
            param="speculative_config")


def _lora_manager(config: EngineConfig, model, mc, runner: ModelRunner, dtype):
    """--enable-lora: the device slots (on the runner, before warm-up: every step graph takes
    them) and the host side that fills them."""
    from jaxserve.loaders.peft import load_peft_adapter, lora_targets
    from jaxserve.lora.cache import LoRAManager

    lc = config.lora
    if not model.supports_lora:
        raise InvalidRequestError(f"--enable-lora: {type(model).__name__} does not support LoRA "
                                  "adapters yet", param="enable_lora")
    if config.parallel.num_hosts > 1:
        raise InvalidRequestError("--enable-lora runs on one host", param="enable_lora")
    targets = lora_targets(model)
    runner.lora = runner.make_lora_slots(targets, lc.max_loras, lc.max_lora_rank, dtype)
    logger.info("LoRA: %d device slots of rank %d over %d projections, host cache of %d",
                lc.max_loras, lc.max_lora_rank, len(targets.shapes), lc.max_cpu_loras)
    return LoRAManager(
        lc.max_loras, lc.max_cpu_loras,
        load=lambda r: load_peft_adapter(r.lora_name, r.lora_path, targets, lc.max_lora_rank,
                                         lc.allowed_paths),
        write=runner.write_lora)


def _load_tokenizer(model_path, tokenizer):
    """A GGUF file carries its own tokenizer and chat template; a HF dir has tokenizer files."""
    if tokenizer is None and str(model_path).endswith(".gguf"):
        from jaxserve.loaders.gguf import gguf_tokenizer
        return gguf_tokenizer(model_path)
    return load_tokenizer(model_path, tokenizer)
