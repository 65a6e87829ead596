"""The ``jaxserve`` CLI: flag names and defaults, the flag -> EngineConfig mapping, and the real
``serve`` / ``generate`` commands in a subprocess (start-up log, SIGINT/SIGTERM shutdown)."""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from server_process import free_port, wait_healthy

from jaxserve.entrypoints.cli import build_parser, engine_config_from_args, main, parse_size


def parse(*argv):
    return build_parser().parse_args(list(argv))


def test_serve_defaults_are_vllms_and_host_is_local():
    a = parse("serve")
    assert a.model is None and a.host == "127.0.0.1" and a.port == 8000
    assert a.block_size == 16 and a.gpu_memory_utilization == 0.9 and a.swap_space == 4.0
    assert a.enable_prefix_caching is True and a.seed == 0 and a.dtype == "auto"
    assert a.tensor_parallel_size == 1 and a.preemption_mode == "recompute"
    assert a.uvicorn_log_level == "info"


def test_flags_map_to_engine_config():
    a = parse("serve", "some/model", "--served-model-name", "alias", "alias2", "--dtype", "half",
              "--max-model-len", "2k", "--gpu-memory-utilization", "0.5", "--block-size", "32",
              "--max-num-seqs", "7", "--max-num-batched-tokens", "333",
              "--no-enable-prefix-caching", "--swap-space", "1.5", "--seed", "42",
              "--tensor-parallel-size", "2", "--load-format", "gguf", "--tokenizer", "tok",
              "--attention-backend", "reference", "--num-gpu-blocks-override", "77",
              "--preemption-mode", "swap", "--min-token-bucket", "8", "-dp", "3")
    c = engine_config_from_args(a)
    assert c.model == "some/model" and c.tokenizer == "tok" and c.dtype == "float16"
    assert c.served_model_name == "alias" and c.seed == 42 and c.load_format == "gguf"
    assert c.attention_backend == "reference"
    assert c.scheduler.max_model_len == 2000 and c.scheduler.max_num_seqs == 7
    assert c.scheduler.max_num_batched_tokens == 333 and c.scheduler.preemption_mode == "swap"
    assert c.cache.block_size == 32 and c.cache.gpu_memory_utilization == 0.5
    assert c.cache.enable_prefix_caching is False and c.cache.swap_space == 1.5
    assert c.cache.num_gpu_blocks_override == 77
    assert c.parallel.tensor_parallel_size == 2 and c.scheduler.min_token_bucket == 8
    assert c.parallel.data_parallel_size == 3


def test_model_flag_and_positional_agree():
    assert engine_config_from_args(parse("serve", "--model", "m")).model == "m"
    with pytest.raises(ValueError):
        engine_config_from_args(parse("serve", "a", "--model", "b"))


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("JAXSERVE_API_KEY", "from-env")
    assert parse("serve").api_key == "from-env"
    assert parse("serve", "--api-key", "flag").api_key == "flag"
    monkeypatch.delenv("JAXSERVE_API_KEY")
    assert parse("serve").api_key is None


def test_sizes():
    assert parse_size("4096") == 4096 and parse_size("4k") == 4000 and parse_size("4K") == 4096
    assert parse_size("1M") == 2**20


@pytest.mark.parametrize("argv", [
    ["serve", "--block-size", "x"], ["serve", "--max-model-len", "0"],
    ["serve", "--dtype", "int3"], ["serve", "--port", "eighty"], ["nonsense"],
    ["generate"],  # --prompt is required
])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_config_errors_are_reported_without_traceback(capsys):
    assert main(["serve", "demo-random", "--block-size", "12"]) == 2
    err = capsys.readouterr().err
    assert "block_size" in err and "Traceback" not in err


def test_help_is_grouped(capsys):
    with pytest.raises(SystemExit):
        parse("serve", "--help")
    out = capsys.readouterr().out
    for group in ("Frontend:", "ModelConfig:", "CacheConfig:", "SchedulerConfig:",
                  "ParallelConfig:"):  # vLLM's help groups
        assert group in out
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching", "--api-key",
                 "--chat-template", "--uvicorn-log-level", "--max-num-batched-tokens"):
        assert flag in out


def test_bench_unknown_name(capsys):
    assert main(["bench", "no-such-benchmark"]) == 2
    assert "no benchmark named 'no-such-benchmark'" in capsys.readouterr().err


def test_bench_forwards_to_the_script(capsys):
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
    if not os.path.isfile(os.path.join(root, "serving.py")):
        pytest.skip("no benchmarks/serving.py in this checkout")
    argv = sys.argv[:]
    try:
        with pytest.raises(SystemExit) as e:
            main(["bench", "serving", "--help"])
    finally:
        sys.argv = argv
    assert e.value.code == 0
    assert "usage: serving.py" in capsys.readouterr().out


# ---- the real commands -----------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    env.pop("JAXSERVE_API_KEY", None)
    return env


TINY = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
        "--min-token-bucket", "32", "--num-gpu-blocks-override", "32"]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """A persistent compilation cache shared by this module's subprocesses (the second start
    skips the warm-up compiles)."""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_starts_answers_and_stops_cleanly(sig, tmp_path, tiny_llama_dir, jax_cache):
    port = free_port()
    log = open(tmp_path / "log.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.entrypoints.cli", "serve",
                             str(tiny_llama_dir), *TINY, "--port", str(port), "--api-key", "k",
                             "--uvicorn-log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env={**_env(), **jax_cache})
    try:
        wait_healthy(port, [proc], [tmp_path / "log.txt"], timeout=240)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       headers={"Authorization": "Bearer k"},
                       json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (tmp_path / "log.txt").read_text()
    ready = re.search(r"jaxserve ready: .*", text)
    assert ready, text
    line = ready.group(0)
    assert f"http://localhost:{port}/v1" in line and "KV pages" in line
    assert re.search(r"\d+ compiles in warm-up", line) and "dtype" in line
    assert "jaxserve stopped" in text


# Same engine shapes as tests/entrypoints/test_server.py, so whichever runs second reuses the compiled step.
SERVER_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens",
                "32", "--min-token-bucket", "32", "--num-gpu-blocks-override", "96"]


@pytest.mark.slow
def test_generate_one_shot(capsys, caplog, tiny_llama_dir):
    caplog.set_level(logging.INFO, logger="jaxserve")
    rc = main(["generate", str(tiny_llama_dir), *SERVER_FLAGS, "--prompt", "Hello", "--prompt", "Bye",
               "--max-tokens", "5"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("--- 'Hello'\n") and "--- 'Bye'\n" in out
    done = [r.getMessage() for r in caplog.records if "finish_reason=" in r.getMessage()]
    assert len(done) == 2
    assert all(re.match(r"\d+ prompt tokens, [1-5] generated, finish_reason=(length|stop)", m)
               for m in done), done
