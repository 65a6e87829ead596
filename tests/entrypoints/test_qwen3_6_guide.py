"""The on-prem guide's Qwen 3.6 command, word for word (``vllm`` -> ``jaxserve``, the model a
tiny random ``qwen3_5`` checkpoint): ``--quantization fp8`` weights, the GDN state in float32,
a chat request to ``Qwen/Qwen3.6-27B`` answers, with an image too (through the engine core's
process); a corrupt image content part is a 400 naming it; the
start-up log states what the state pool holds and that prefix caching is off."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ("vllm serve MODEL --served-model-name Qwen/Qwen3.6-27B --quantization fp8 "
         "--gpu-memory-utilization 0.9 --max-model-len 32768 --port PORT")


@pytest.mark.slow  # start-up compiles the hybrid model's buckets (~2 min on 2 cores)
def test_qwen3_6_guide_command_answers_a_chat_request(tmp_path):
    import httpx
    import openai

    from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5
    from server_process import free_port, stop, wait_healthy

    model = make_tiny_qwen3_5(tmp_path / "qwen3_6", moe=False, vl=True)
    port = free_port()
    words = shlex.split(GUIDE.replace("MODEL", str(model)).replace("PORT", str(port)))
    assert words[:2] == ["vllm", "serve"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p))
    log = tmp_path / "log.txt"
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.entrypoints.cli", *words[1:]],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(port, [proc], [log], timeout=600)
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none",
                               http_client=httpx.Client(timeout=600))
        (card,) = client.models.list().data
        assert card.id == "Qwen/Qwen3.6-27B" and card.model_extra["max_model_len"] == 32768
        r = client.chat.completions.create(
            model="Qwen/Qwen3.6-27B", messages=[{"role": "user", "content": "hello there"}],
            max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        assert r.model == "Qwen/Qwen3.6-27B" and r.usage.completion_tokens == 5
        assert r.choices[0].message.content
        bad = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "Qwen/Qwen3.6-27B", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
        # a corrupt image: a 400 naming the part (the tiny VLM takes images)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages.0.content.1"
        # a real one: processed in the API process, sent to the engine core with its pixels
        from jaxserve.testing.multimodal import data_url, make_image

        r = client.chat.completions.create(model="Qwen/Qwen3.6-27B", max_tokens=4,
                                           temperature=0, extra_body={"ignore_eos": True},
                                           messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": data_url(make_image(64, 64, 0))}}]}])
        plain = client.chat.completions.create(model="Qwen/Qwen3.6-27B", max_tokens=1, messages=[
            {"role": "user", "content": "what is this?"}])
        assert r.usage.completion_tokens == 4
        # vision start + 4 placeholders (64 px: 2x2 merged patches) + vision end
        assert r.usage.prompt_tokens == plain.usage.prompt_tokens + 6
        text = log.read_text()
        assert "state pool" in text and "prefix caching is off" in text
    finally:
        stop(proc)
