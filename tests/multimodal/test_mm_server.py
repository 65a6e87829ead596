"""Images through the OpenAI server (a real uvicorn, the openai client, the tiny random Qwen 3.5
VLM): chat ``image_url`` parts as data URLs and ``file://`` under ``--allowed-local-media-path``
answer as HF ``generate`` does; every bad image request is a 400 naming the part, and the
server serves on."""
from __future__ import annotations

import asyncio

import pytest

from jaxserve.testing.multimodal import data_url, make_image

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

N = 6
MODEL = "tiny-vl"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    make_image(64, 96, 3).save(d / "cat.png")
    return d


@pytest.fixture(scope="module")
def server(tiny_vlm, media_dir):
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
    from jaxserve.entrypoints.openai.app import build_app
    from tests.server_process import ServerThread

    flags = ["serve", str(tiny_vlm), "--served-model-name", MODEL, "--max-model-len", "256",
             "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--min-token-bucket",
             "32", "--block-size", "8", "--dtype", "float32", "--enforce-eager",
             "--limit-mm-per-prompt", '{"image": 2}',
             "--allowed-local-media-path", str(media_dir)]
    engine = AsyncLLM(engine_config_from_args(build_parser().parse_args(flags)))
    try:
        with ServerThread(build_app(engine, served_model_names=[MODEL])) as srv:
            yield srv
    finally:
        asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def _messages(*urls, text="What is in"):
    parts = [{"type": "text", "text": text}]
    for u in urls:
        parts += [{"type": "image_url", "image_url": {"url": u}}, {"type": "text", "text": "?"}]
    return [{"role": "user", "content": parts}]


def _chat(client, messages):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N,
                                       temperature=0, extra_body={"ignore_eos": True})
    return r


def _expected(hf_ref, messages, images):
    # an incomplete UTF-8 sequence at the end is held back by the server's detokenizer
    return hf_ref.tok.decode(hf_ref.greedy_ids(hf_ref.chat_ids(messages), images, N),
                             skip_special_tokens=True).rstrip("\ufffd")


def test_chat_with_images_equals_hf_generate(client, hf_ref, media_dir):
    from PIL import Image

    a, b = make_image(96, 40, 1), make_image(128, 64, 2)
    cases = [(_messages(), []), (_messages(data_url(a)), [a]),
             (_messages(data_url(a), data_url(b)), [a, b]),
             (_messages(f"file://{media_dir}/cat.png"), [Image.open(media_dir / "cat.png")])]
    for messages, images in cases:
        r = _chat(client, messages)
        assert r.choices[0].message.content == _expected(hf_ref, messages, images)
        assert r.usage.completion_tokens == N


@pytest.mark.parametrize("part,where", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAA"}},
     "messages.0.content.1"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
     "messages.0.content.1"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/hostname"}},
     "messages.0.content.1"),
    ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}},
     "messages.0.content.1"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
     "messages.0.content.1"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
     "messages.0.content.1"),
], ids=["corrupt", "bad-base64", "file-outside-allowed", "http-off", "video", "audio"])
def test_bad_image_parts_are_a_400_naming_the_part(client, part, where):
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert e.value.body["param"] == where, e.value.body


def test_too_many_or_too_large_images_are_a_400(client, monkeypatch, hf_ref):
    import jaxserve.multimodal.media as media

    url = data_url(make_image(32, 32, 5))
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, _messages(url, url, url))
    assert e.value.body["param"] == "messages.0.content.5"  # the third image
    assert "limit" in e.value.body["message"]
    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", 100)
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, _messages(url))
    assert e.value.body["param"] == "messages.0.content.1"
    monkeypatch.undo()
    # the engine serves on
    im = make_image(40, 72, 6)
    r = _chat(client, _messages(data_url(im)))
    assert r.choices[0].message.content == _expected(hf_ref, _messages(data_url(im)), [im])


def test_completions_with_vllm_prompt_dict(client, hf_ref):
    from jaxserve.testing.multimodal import IMAGE, PROMPT_HEAD, PROMPT_TAIL

    im = make_image(72, 72, 7)
    text = PROMPT_HEAD + "Caption " + IMAGE + PROMPT_TAIL
    r = client.completions.create(
        model=MODEL, max_tokens=N, temperature=0, extra_body={"ignore_eos": True},
        prompt={"prompt": text, "multi_modal_data": {"image": [data_url(im)]}})
    want = hf_ref.tok.decode(hf_ref.greedy(text, [im], N), skip_special_tokens=True)
    assert r.choices[0].text == want.rstrip("\ufffd")
    assert r.usage.prompt_tokens == len(hf_ref.ids(text, [im]))  # placeholders expanded
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, max_tokens=2, prompt={
            "prompt": text, "multi_modal_data": {"video": [data_url(im)]}})
    assert e.value.body["param"] == "prompt.multi_modal_data.video"
