"""FrontendArgs: the HTTP server's own flags (vLLM's ``vllm/entrypoints/openai/cli_args.py``),
declared like ``EngineArgs`` and shown in the same help groups. ``jaxserve serve`` hands them
to ``run_server``; they never reach the engine's config."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from jaxserve.args import add_flags, arg, positive_int
from jaxserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from jaxserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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


def json_list(value: str) -> list[str]:
    """A JSON list of strings (vLLM's form for the CORS flags)."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"must be a JSON list such as '[\"*\"]', got {value!r}")
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {value!r}")
    return items


def non_negative_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value!r}")
    return x


@dataclass
class FrontendArgs:
    """The server's flags (``--host``, ``--port``, ``--api-key``, TLS, CORS, parsers, logs)."""

    lora_modules: list | None = arg(
        group="Frontend", type=lora_module, nargs="+", metavar="NAME=PATH",
        help="adapters served as models: name=path or JSON {\"name\": ..., \"path\": ..., "
             "\"base_model_name\": ...} (needs --enable-lora)")
    host: str = arg("127.0.0.1", group="Frontend",
                    help="address to bind; 0.0.0.0 to serve the network (default: %(default)s)")
    port: int = arg(8000, group="Frontend", type=int, help="port (default: %(default)s)")
    api_key: str | None = arg(
        group="Frontend", env=("JAXSERVE_API_KEY", "VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $JAXSERVE_API_KEY, "
             "else $VLLM_API_KEY, else no key)")
    root_path: str = arg("", group="Frontend",
                         help="the path prefix a reverse proxy serves us under (ASGI root_path)")
    ssl_keyfile: str | None = arg(group="Frontend", help="serve HTTPS with this private key")
    ssl_certfile: str | None = arg(group="Frontend", help="serve HTTPS with this certificate")
    chat_template: str | None = arg(
        group="Frontend",
        help="Jinja chat template, or a file holding one (default: the tokenizer's)")
    enable_auto_tool_choice: bool = arg(
        False, group="Frontend", action="store_true",
        help='tool_choice "auto": parse tool calls out of the answer (needs --tool-call-parser)')
    tool_call_parser: str | None = arg(
        group="Frontend", choices=tuple(sorted(TOOL_PARSERS)),
        help="how the model writes tool calls (hermes: <tool_call>{json}</tool_call>; "
             "qwen3_coder: Qwen 3.5/3.6's <function=NAME><parameter=ARG> XML)")
    reasoning_parser: str | None = arg(
        group="Frontend", choices=tuple(sorted(REASONING_PARSERS)),
        help="split <think>...</think> off the answer into reasoning_content")
    trust_request_chat_template: bool = arg(
        False, group="Frontend", action="store_true",
        help="accept a chat_template field in chat requests")
    uvicorn_log_level: str = arg("info", group="Frontend", choices=LOG_LEVELS,
                                 help="uvicorn's log level (default: %(default)s)")
    shutdown_timeout: float = arg(
        20.0, group="Frontend", type=non_negative_float,
        help="seconds requests in flight get to finish after SIGTERM/SIGINT (new ones get 503 "
             "meanwhile); the rest end with an error (default: %(default)s)")
    max_request_body_bytes: int = arg(
        32 * 2**20, group="Frontend", type=positive_int,
        help="largest request body, else 413; accepts 32M (default: %(default)s)")
    allowed_origins: list = arg(["*"], group="Frontend", type=json_list, metavar="JSON",
                                help="CORS: origins allowed, a JSON list (default: [\"*\"])")
    allowed_methods: list = arg(["*"], group="Frontend", type=json_list, metavar="JSON",
                                help="CORS: methods allowed, a JSON list (default: [\"*\"])")
    allowed_headers: list = arg(["*"], group="Frontend", type=json_list, metavar="JSON",
                                help="CORS: headers allowed, a JSON list (default: [\"*\"])")
    allow_credentials: bool = arg(False, group="Frontend", action="store_true",
                                  help="CORS: allow credentials (default: off)")
    response_role: str = arg(
        "assistant", group="Frontend",
        help="the role of chat answers after a generation prompt (default: %(default)s)")
    enable_log_requests: bool = arg(
        False, group="Frontend", action="store_true",
        help="log each request's prompt tokens and sampling params at INFO")
    disable_log_requests: bool = arg(
        False, group="Frontend", action="store_true",
        help="vLLM's older flag; requests are not logged unless --enable-log-requests")
    max_log_len: int | None = arg(
        group="Frontend", type=positive_int,
        help="with --enable-log-requests, log at most this many prompt tokens (default: all)")
    metrics_prefix: str = arg(
        "jaxserve", group="ObservabilityConfig", choices=("jaxserve", "vllm"),
        help="prefix of every /metrics name: vllm publishes vLLM's exact names "
             "(vllm:num_requests_waiting ...), so vLLM's dashboards and alert rules read them "
             "unchanged (default: %(default)s)")
    disable_log_stats: bool = arg(
        False, group="ObservabilityConfig", action="store_true",
        help="no periodic stats log line (throughput, queue, KV cache usage and, when "
             "speculating, the spec-decode line; every 10 s, JAXSERVE_LOG_STATS_INTERVAL "
             "seconds if set)")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_flags(parser, cls)
