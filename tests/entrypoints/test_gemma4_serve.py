"""The on-prem guide's Gemma 4 command, flag for flag (vllm -> jaxserve, the model -> a tiny
random Gemma 4 directory, a free port), answers a chat request; an image part is a 400."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers.models.gemma4")

from test_vllm_cli import GUIDE_COMMANDS, jaxserve_argv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a server process: load, fp8 quantization, warm-up of the first buckets
def test_guide_gemma4_command_answers_a_chat_request(tmp_path):
    import httpx
    import openai

    from jaxserve.testing.tiny_gemma4 import make_tiny_gemma4
    from server_process import free_port, stop

    model = make_tiny_gemma4(tmp_path / "gemma4", moe=True, max_position_embeddings=32768)
    port = free_port()
    argv = jaxserve_argv(GUIDE_COMMANDS["gemma4"], str(model)) + ["--port", str(port)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p))
    log_path = tmp_path / "log.txt"
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.entrypoints.cli", *argv],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 400
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x",
                               http_client=httpx.Client(timeout=300))
        (card,) = client.models.list().data
        assert card.model_extra["max_model_len"] == 32767
        r = client.chat.completions.create(
            model=card.id, messages=[{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "hello there"}],
            max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4 and r.choices[0].message.content
        bad = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": card.id, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
        assert bad.status_code == 400, bad.text
    finally:
        stop(proc)
    log = log_path.read_text()
    assert "this is a bug" not in log
    assert "float8_e4m3fn" in log and "Maximum concurrency for 32767 tokens per request" in log
