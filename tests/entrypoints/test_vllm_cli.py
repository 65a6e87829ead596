"""vLLM's command line as written: the guides' serving commands (vllm -> jaxserve, model -> a local
tiny checkpoint) parse through the one ``serve`` parser, each vLLM flag maps to its meaning, and
bad input fails at start-up naming the flags."""
from __future__ import annotations

import json
import logging
import shlex
import subprocess
import sys

import pytest

from jaxserve.entrypoints import cli
from jaxserve.entrypoints.cli import engine_config_from_args, main, parse_args

# The serving commands of the guides, as the issues quote them (the production guide starts
# the server as `python -m vllm.entrypoints.openai.api_server`; the on-prem guide's chapter 7
# serves Qwen 3.6 and Gemma 4 with `vllm serve`). MODEL stands for the model path.
GUIDE_COMMANDS = {
    "qwen3.6-27b": "vllm serve MODEL --served-model-name Qwen/Qwen3.6-27B --quantization fp8 "
                   "--gpu-memory-utilization 0.9 --max-model-len 32768 --port 8000",
    "gemma4": "vllm serve MODEL --dtype bfloat16 --quantization fp8 --kv-cache-dtype fp8 "
              "--gpu-memory-utilization 0.95 --tensor-parallel-size 1 --max-num-seqs 8 "
              "--max-model-len 32767 --enable-chunked-prefill --enable-prefix-caching",
    "405b-tp8-pp1": "python -m vllm.entrypoints.openai.api_server --model MODEL "
                    "--tensor-parallel-size 8 --pipeline-parallel-size 1",
    "production": "python -m vllm.entrypoints.openai.api_server --model MODEL "
                  "--served-model-name llama-3.1-8b --dtype auto --load-format auto "
                  "--max-model-len 8192 --gpu-memory-utilization 0.9 --enable-chunked-prefill "
                  "--max-num-batched-tokens 8192 --num-scheduler-steps 8 --enforce-eager "
                  "--trust-remote-code --disable-log-requests --scheduling-policy fcfs "
                  "--root-path /llm --host 0.0.0.0 --port 8000",
    "speculative": "python -m vllm.entrypoints.openai.api_server --model MODEL "
                   "--speculative-model [ngram] --num-speculative-tokens 5 "
                   "--ngram-prompt-lookup-max 4 --speculative-draft-tensor-parallel-size 1",
    "lora": "python -m vllm.entrypoints.openai.api_server --model MODEL --enable-lora "
            "--lora-modules korean-chat=/path/to/korean-lora code-assist=/path/to/code-lora "
            "medical-qa=/path/to/medical-lora --max-loras 3 --max-lora-rank 64",
}
NOT_YET: dict[str, str] = {}  # guide commands whose flags are not supported yet


def jaxserve_argv(command: str, model: str) -> list[str]:
    """A guide command with vllm -> jaxserve: the argv ``jaxserve`` / the module sees."""
    words = shlex.split(command.replace("MODEL", model))
    if words[:2] == ["vllm", "serve"]:
        return ["serve", *words[2:]]
    assert words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], command
    return ["serve", *words[3:]]  # what api_server.main passes on


@pytest.mark.parametrize("name", [pytest.param(
    n, marks=pytest.mark.xfail(strict=True, reason=NOT_YET[n], raises=SystemExit))
    if n in NOT_YET else n for n in GUIDE_COMMANDS])
def test_guide_command_parses_as_written(name, tiny_llama_dir):
    args = parse_args(jaxserve_argv(GUIDE_COMMANDS[name], str(tiny_llama_dir)))
    c = engine_config_from_args(args)
    assert c.model == str(tiny_llama_dir)
    if name == "gemma4":
        assert c.scheduler.enable_chunked_prefill and c.cache.enable_prefix_caching
        assert c.cache.gpu_memory_utilization == 0.95 and c.cache.cache_dtype == "fp8"
        assert c.scheduler.max_num_seqs == 8 and c.scheduler.max_model_len == 32767
    if name == "production":
        assert c.enforce_eager and c.trust_remote_code and c.scheduler.policy == "fcfs"
        assert args.root_path == "/llm" and args.disable_log_requests
    if name == "speculative":
        assert (c.speculative.method, c.speculative.num_speculative_tokens) == ("ngram", 5)
        assert c.speculative.draft_tensor_parallel_size == 1
    if name == "lora":
        assert (c.lora.max_loras, c.lora.max_lora_rank, c.lora.max_cpu_loras) == (3, 64, 3)
        assert [m["name"] for m in args.lora_modules] == ["korean-chat", "code-assist",
                                                           "medical-qa"]
        assert args.lora_modules[0]["path"] == "/path/to/korean-lora"
    if name == "405b-tp8-pp1":
        assert c.parallel.tensor_parallel_size == 8 and c.parallel.pipeline_parallel_size == 1


def test_api_server_module_is_serve(monkeypatch):
    """The module hands its argv to ``jaxserve serve``: one parser, the same flags."""
    from jaxserve.entrypoints.openai import api_server

    seen = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(argv) or 0)
    assert api_server.main(["--model", "m", "--port", "1"]) == 0
    assert seen == [["serve", "--model", "m", "--port", "1"]]


def test_vllm_flags_map_to_their_meaning(caplog):
    caplog.set_level(logging.WARNING, logger="jaxserve")
    a = parse_args(["serve", "m", "--no-enable-chunked-prefill", "--num-scheduler-steps", "8",
                    "--enforce-eager", "--trust-remote-code", "--revision", "v1",
                    "--download-dir", "/d", "--tokenizer-mode", "hf", "--scheduling-policy",
                    "fcfs", "--hf-overrides", '{"rope_theta": 5.0}', "-pp", "1",
                    "--speculative-model", "draft", "--num-speculative-tokens", "3",
                    "--speculative-draft-tensor-parallel-size", "1"])
    c = engine_config_from_args(a)
    assert c.scheduler.enable_chunked_prefill is False and c.enforce_eager
    assert c.model_source() == dict(revision="v1", download_dir="/d",
                                    hf_overrides={"rope_theta": 5.0}, trust_remote_code=True)
    assert c.tokenizer_mode == "hf" and c.scheduler.policy == "fcfs"
    assert (c.speculative.method, c.speculative.model) == ("draft_model", "draft")
    assert c.speculative.draft_tensor_parallel_size == 1
    warned = [r.getMessage() for r in caplog.records if "num-scheduler-steps" in r.getMessage()]
    assert len(warned) == 1 and "single" in warned[0]
    # vLLM's budget without chunked prefill when none is given: a whole prompt per step
    e = engine_config_from_args(parse_args(["serve", "m", "--no-enable-chunked-prefill",
                                            "--max-model-len", "4096"]))
    assert e.scheduler.max_num_batched_tokens == 4096
    assert "max_num_batched_tokens" not in e.scheduler.backend_defaults
    d = engine_config_from_args(parse_args(["serve", "m"]))
    assert d.scheduler.enable_chunked_prefill and not d.enforce_eager


def test_vllm_api_key_from_environment(monkeypatch):
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert parse_args(["serve"]).api_key == "v"
    monkeypatch.setenv("JAXSERVE_API_KEY", "j")  # ours wins when both are set
    assert parse_args(["serve"]).api_key == "j"


def test_config_yaml_flags_and_the_command_line_wins(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("model: from-yaml\nport: 6379\nserved-model-name: [a, b]\n"
                 "enable_chunked_prefill: false\nenforce-eager: true\n"
                 "hf-overrides: {max_position_embeddings: 64}\nmax-num-seqs: 4\n")
    a = parse_args(["serve", "--config", str(f), "--port", "9000"])
    c = engine_config_from_args(a)
    assert a.port == 9000 and a.served_model_name == ["a", "b"] and c.model == "from-yaml"
    assert c.enforce_eager and c.scheduler.max_num_seqs == 4
    assert c.hf_overrides == {"max_position_embeddings": 64}
    assert parse_args(["serve", "pos", "--config", str(f)]).model_flag is None  # MODEL wins
    f.write_text("port: 1\nno-such-flag: 3\n")
    with pytest.raises(SystemExit) as e:
        parse_args(["serve", "--config", str(f)])
    assert e.value.code == 2 and "--no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize("argv, names", [
    (["serve", "--enable-chunked-prefil"], ["--enable-chunked-prefil"]),  # no abbreviations
    (["serve", "--num-scheduler-step", "8"], ["--num-scheduler-step"]),
    (["serve", "--no-such-vllm-flag"], ["--no-such-vllm-flag"]),
    (["serve", "--scheduling-policy", "lifo"], ["--scheduling-policy", "lifo"]),
    (["serve", "--config", "/no/such.yaml"], ["--config", "/no/such.yaml"]),
])
def test_bad_flags_exit_2_naming_them(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(n in err for n in names), err


def test_pipeline_parallel_above_one_is_a_start_up_error(capsys):
    assert main(["serve", "m", "--pipeline-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "pipeline parallelism is not available yet" in err and "pipeline_parallel_size 2" in err


def test_ssl_files_are_checked_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # serve sets it otherwise
    key = tmp_path / "k.pem"
    key.write_text("x")
    assert main(["serve", "demo-random", "--ssl-keyfile", str(key)]) == 2
    assert "--ssl-certfile" in capsys.readouterr().err
    assert main(["serve", "demo-random", "--ssl-keyfile", str(key), "--ssl-certfile",
                 str(tmp_path / "none.pem")]) == 2
    assert "none.pem" in capsys.readouterr().err


def test_remote_code_config_is_a_clear_error(tmp_path, tiny_llama_dir):
    from jaxserve.loaders.model_loader import load_model

    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg.update(architectures=["MyCustomForCausalLM"],
               auto_map={"AutoModelForCausalLM": "modeling_custom.MyCustomForCausalLM"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="needs remote code.*MyCustomForCausalLM"):
        load_model(str(tmp_path), trust_remote_code=True)


def test_hf_overrides_merge_into_config():
    from jaxserve.loaders.model_loader import apply_hf_overrides

    base = {"a": 1, "rope_scaling": {"type": "linear", "factor": 2.0}}
    out = apply_hf_overrides(base, {"a": 2, "rope_scaling": {"factor": 4.0}})
    assert out == {"a": 2, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert base["a"] == 1  # the caller's dict is untouched


@pytest.mark.slow
def test_no_chunked_prefill_with_a_small_budget_fails_at_start_up(tiny_llama_dir, capsys):
    rc = main(["generate", str(tiny_llama_dir), "--no-enable-chunked-prefill",
               "--max-num-batched-tokens", "32", "--max-model-len", "128",
               "--num-gpu-blocks-override", "32", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "--no-enable-chunked-prefill" in err and "--max-num-batched-tokens" in err
    assert "(32)" in err and "(128)" in err


def test_allocator_fraction_is_set_before_jax_starts(tmp_path):
    """In a fresh process (the core process's situation): the fraction becomes the
    utilization; a user's own XLA_PYTHON_CLIENT_MEM_FRACTION is left alone."""
    code = ("import os; from jaxserve.worker.memory_budget import set_allocator_fraction as s;"
            "print(s(0.95), os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])")
    env = {k: v for k, v in __import__("os").environ.items()
           if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["0.95", "0.9500"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"},
                         check=True).stdout.split()
    assert out == ["0.5", "0.5"]


# ---- one real launch through vLLM's entry point, many of its flags at once -------------------
def _self_signed_cert(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return key, cert


@pytest.mark.slow
def test_guide_commands_serve_through_the_api_server_entry_point(tmp_path, tiny_llama_dir):
    """The production guide's command as written (host and port aside) plus the speculative
    guide's flags, through ``python -m jaxserve.entrypoints.openai.api_server``, with a YAML
    config, HTTPS and the vLLM API key variable: ready at once (--enforce-eager: the first
    request compiles its bucket) and a chat request under the served name answers. The tiny
    checkpoint's 2048-token limit is lifted by --hf-overrides, so --max-model-len 8192 loads;
    the command line's served name beats the YAML's; fcfs rejects a priority."""
    import os
    import shutil
    import time

    import httpx
    import openai

    from server_process import free_port, stop

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed for the self-signed certificate")
    key, cert = _self_signed_cert(tmp_path)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("served-model-name: [from-yaml]\nuvicorn-log-level: warning\n"
                   "enable-prefix-caching: true\nmax-num-seqs: 4\n")
    port = free_port()
    argv = jaxserve_argv(GUIDE_COMMANDS["production"], str(tiny_llama_dir))
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)
    spec = jaxserve_argv(GUIDE_COMMANDS["speculative"], str(tiny_llama_dir))
    argv += spec[spec.index("--speculative-model"):]
    argv += ["--config", str(cfg), "--hf-overrides", '{"max_position_embeddings": 8192}',
             "--tokenizer-mode", "auto", "--revision", "main", "--download-dir",
             str(tmp_path / "dl"), "--tensor-parallel-size", "1", "--pipeline-parallel-size",
             "1", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", VLLM_API_KEY="secret",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    env.pop("JAXSERVE_API_KEY", None)
    log_path = tmp_path / "log.txt"
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.entrypoints.openai.api_server",
                             *argv[1:]], stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env=env)
    base = f"https://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            try:
                if httpx.get(f"{base}/health", verify=False, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.5)
        http = httpx.Client(verify=False, timeout=120)
        # VLLM_API_KEY is the key, and --root-path (uvicorn puts it in front of the path the
        # middleware sees; the proxy strips it) does not open the /v1 routes
        assert http.get(f"{base}/v1/models").status_code == 401
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="secret", http_client=http)
        (card,) = client.models.list().data
        assert card.id == "llama-3.1-8b" and card.model_extra["max_model_len"] == 8192
        r = client.chat.completions.create(
            model="llama-3.1-8b", messages=[{"role": "user", "content": "hello there"}],
            max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert r.model == "llama-3.1-8b" and r.usage.completion_tokens == 4
        assert r.choices[0].message.content
        bad = http.post(f"{base}/v1/completions", headers={"Authorization": "Bearer secret"},
                        json={"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 2,
                              "priority": 3})
        assert bad.status_code == 400 and "priority" in bad.text
    finally:
        stop(proc)
    log = log_path.read_text()
    assert "enforce_eager: no ahead-of-time warm-up" in log
    assert "--num-scheduler-steps 8: ignored" in log
    assert "this is a bug" not in log and "warm-up:" not in log


def test_lora_flags():
    a = parse_args(["serve", "m", "--enable-lora", "--lora-modules", "a=/x",
                    '{"name": "b", "path": "/y", "base_model_name": "m"}', "--max-loras", "2",
                    "--max-cpu-loras", "4"])
    c = engine_config_from_args(a)
    assert (c.lora.max_loras, c.lora.max_lora_rank, c.lora.max_cpu_loras) == (2, 16, 4)
    assert a.lora_modules == [dict(name="a", path="/x", base_model_name=None),
                              dict(name="b", path="/y", base_model_name="m")]
    assert engine_config_from_args(parse_args(["serve", "m"])).lora is None
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        engine_config_from_args(parse_args(["serve", "m", "--lora-modules", "a=/x"]))
    with pytest.raises(ValueError, match="max_cpu_loras"):
        engine_config_from_args(parse_args(["serve", "m", "--enable-lora", "--max-loras", "3",
                                            "--max-cpu-loras", "2"]))
    with pytest.raises(SystemExit):
        parse_args(["serve", "m", "--enable-lora", "--lora-modules", "no-path"])
