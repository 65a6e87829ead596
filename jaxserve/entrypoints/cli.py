"""The ``jaxserve`` command: ``serve``, ``generate``, ``bench``, ``convert``, ``proxy``.

Flag names and defaults are vLLM's. Engine flags are ``jaxserve.args.EngineArgs``'s fields and
become the ``EngineConfig`` through it; the server's own flags (host, port, API key, chat
template, log level) are ``FrontendArgs``'s and go to ``run_server``. Unlike vLLM, ``--host`` defaults to 127.0.0.1: serving to the network is a
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

from jaxserve.args import DTYPE_ALIASES, DTYPES, EngineArgs, positive_int
from jaxserve.args import parse_size  # noqa: F401  (the CLI's size syntax, tested here)
from jaxserve.config import EngineConfig
from jaxserve.entrypoints.openai.cli_args import FrontendArgs

logger = logging.getLogger("jaxserve")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of ``jaxserve serve``, which
    ``python -m jaxserve.entrypoints.openai.api_server`` takes as well."""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model to serve (default: SmolLM2-135M-Instruct)")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="vLLM's YAML of flags (`port: 8000`, `served-model-name: x`, "
                        "`enable-prefix-caching: true`); flags on the command line win")
    FrontendArgs.add_cli_args(p)
    EngineArgs.add_cli_args(p)


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
    g.add_argument("--max-tokens", type=positive_int, default=64,
                   help="tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="0 disables (default: %(default)s)")
    EngineArgs.add_cli_args(gen)

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
    proxy = sub.add_parser("proxy", allow_abbrev=False,
                           help="route requests over prefill and decode instances",
                           description="Disaggregated prefill/decode: each request is "
                                       "prefilled on a --prefill instance, then decoded on a "
                                       "--decode instance that pulls its KV (instances started "
                                       "with --kv-transfer-config); round robin over each.")
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                       help="prefill instances (kv_role kv_producer or kv_both)")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL",
                       help="decode instances (kv_role kv_consumer or kv_both)")
    proxy.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    proxy.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    return parser


def _proxy(args) -> int:
    from jaxserve.entrypoints.proxy import run_proxy

    run_proxy(args.prefill, args.decode, args.host, args.port)
    return 0


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Parsed flags -> ``EngineConfig``, through ``EngineArgs`` as ``LLM(...)`` goes, so the
    CLI, the server and the offline API agree."""
    if getattr(args, "lora_modules", None) and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    return EngineArgs.from_cli_args(args).create_engine_config()


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """Parsed flags -> the ``LLM(...)`` keyword arguments they stand for."""
    return EngineArgs.from_cli_args(args).llm_kwargs()


def _serve(args) -> int:
    from jaxserve.entrypoints.openai.app import run_server
    from jaxserve.worker.memory_budget import set_allocator_fraction

    config = engine_config_from_args(args)  # bad flags fail here, before any work
    # before JAX starts here (data-parallel replicas and multi-host run in this process; the
    # core process inherits it): its allocator takes this fraction of the device's memory
    set_allocator_fraction(config.cache.gpu_memory_utilization)
    p = config.parallel
    if p.num_hosts > 1:  # before anything else touches JAX
        from jaxserve.worker import multihost

        multihost.initialize(p.num_hosts, p.host_index, p.coordinator)
    if p.num_hosts > 1 and p.host_index != 0:
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
    dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)
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


def underscore_flags(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """vLLM's parser takes ``--max_model_len`` for ``--max-model-len``: a flag written with
    underscores is the parser's dashed flag when that one exists (else argparse names it)."""
    known = {o for a in parser._actions for o in a.option_strings}
    out = []
    for a in argv:
        key, eq, value = a.partition("=")
        dashed = "--" + key[2:].replace("_", "-")
        out.append(dashed + eq + value if a.startswith("--") and "_" in key
                   and dashed in known else a)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The ``jaxserve`` command line, ``--config FILE.yaml`` expanded into flags."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("serve", "generate"):
        argv = underscore_flags(_subparser(parser, argv[0]), argv)
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
               "convert": _convert, "proxy": _proxy}[args.command]
    try:
        return handler(args)
    except (ValueError, FileNotFoundError) as e:  # bad flags or model path: no traceback
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
