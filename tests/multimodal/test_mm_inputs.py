"""The front end's image inputs without the engine: the checkpoint's processor chosen by its
PIL backend (a torchvision class name still loads), placeholder expansion and hashes, the
content cache (``--disable-mm-preprocessor-cache``), ``--mm-processor-kwargs``, M-RoPE
positions, and media URLs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.testing.multimodal import data_url, make_image

pytest.importorskip("PIL")


def test_processor_uses_the_pil_backend_of_the_checkpoints_class(tiny_vlm):
    from jaxserve.multimodal.processor import ImageProcessor, image_processor_class_name

    cfg = json.loads((tiny_vlm / "preprocessor_config.json").read_text())
    assert cfg["image_processor_type"] == "Qwen2VLImageProcessorFast"  # torchvision-backed
    assert image_processor_class_name(tiny_vlm) == "Qwen2VLImageProcessorPil"
    a, b = ImageProcessor(tiny_vlm).process([make_image(64, 96, 0), make_image(64, 96, 1)])
    assert a.grid_thw == (1, 6, 4) and a.num_tokens == 6
    assert a.pixel_values.shape == (24, 3 * 2 * 16 * 16)
    assert a.hash != b.hash
    again = ImageProcessor(tiny_vlm).process([make_image(64, 96, 0)])[0]
    assert again.hash == a.hash
    small = ImageProcessor(tiny_vlm, {"max_pixels": 32 * 32}).process([make_image(64, 96, 0)])
    assert small[0].num_tokens == 1
    with pytest.raises(ValueError, match="not_a_setting"):
        ImageProcessor(tiny_vlm, {"not_a_setting": 1})


def test_placeholders_expand_and_the_cache_follows_the_flag(tiny_vlm):
    from jaxserve.config import MultiModalConfig
    from jaxserve.multimodal.inputs import MultiModalInputProcessor

    hf = json.loads((tiny_vlm / "config.json").read_text())
    img = hf["image_token_id"]
    cached = MultiModalInputProcessor.for_model(tiny_vlm, hf, MultiModalConfig())
    ids, mm = cached.process([1, 7, img, 8, img, 9],
                             {"image": [make_image(64, 96, 0), make_image(32, 32, 1)]})
    assert ids == [1, 7] + [img] * 6 + [8] + [img] + [9]
    assert [(i.offset, i.num_tokens) for i in mm.images] == [(2, 6), (9, 1)]
    assert mm.images[0].pixel_array().shape == (24, 1536)
    before = dict(cached._cache)
    assert len(before) == 2
    cached.process([img], {"image": make_image(64, 96, 0)})  # the same picture: a hit
    assert cached._cache == before and all(cached._cache[k] is v for k, v in before.items())
    off = MultiModalInputProcessor.for_model(
        tiny_vlm, hf, MultiModalConfig(disable_mm_preprocessor_cache=True))
    off.process([img], {"image": make_image(64, 96, 0)})
    assert off._cache is None


def test_mrope_positions_follow_hf_get_rope_index(tiny_vlm):
    torch = pytest.importorskip("torch")
    import transformers as tf

    from jaxserve.multimodal.mrope import mrope_positions

    hf = tf.Qwen3_5ForConditionalGeneration.from_pretrained(tiny_vlm)
    img = hf.config.image_token_id
    grids = [(1, 6, 4), (1, 2, 8)]
    ids = [5, 6] + [img] * 6 + [7] + [img] * 4 + [8, 9]
    ref, delta = hf.model.get_rope_index(torch.tensor([ids]),
                                         torch.tensor([[int(t == img) for t in ids]]),
                                         image_grid_thw=torch.tensor(grids))
    ours, our_delta = mrope_positions(ids, img, grids)
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    assert our_delta == int(delta[0, 0]) and our_delta != 0


def test_media_urls(tmp_path):
    from jaxserve.errors import InvalidRequestError
    from jaxserve.multimodal.media import load_image_url

    im = make_image(20, 10, 0)
    assert load_image_url(data_url(im), "x").size == (20, 10)
    im.save(tmp_path / "a.webp", format="WEBP")
    im.save(tmp_path / "a.jpg", format="JPEG")
    for name in ("a.webp", "a.jpg"):
        assert load_image_url(f"file://{tmp_path}/{name}", "x",
                              allowed_local_media_path=str(tmp_path)).size == (20, 10)
    bad = [(f"file://{tmp_path}/a.jpg", {}),  # no allowed path
           (f"file://{tmp_path}/../a.jpg", {"allowed_local_media_path": str(tmp_path)}),
           ("https://example.com/a.png", {}), ("ftp://x/a.png", {}),
           ("data:text/plain;base64,aGk=", {}), ("data:image/png;base64,aGk=", {})]
    for url, kw in bad:
        with pytest.raises(InvalidRequestError) as e:
            load_image_url(url, "messages.0.content.1", **kw)
        assert e.value.param == "messages.0.content.1"


def test_http_image_urls_only_from_allowed_domains(tmp_path):
    """--allowed-media-domains: fetched from a listed host, refused elsewhere (also when a
    listed host redirects away), and bounded in size."""
    import http.server
    import io
    import threading

    from jaxserve.errors import InvalidRequestError
    from jaxserve.multimodal import media

    buf = io.BytesIO()
    make_image(12, 7, 3).save(buf, format="PNG")
    png = buf.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/away":
                self.send_response(302)
                self.send_header("Location", "http://localhost:1/a.png")
                self.end_headers()
                return
            body = png if self.path == "/a.png" else b"x" * (media.MAX_IMAGE_BYTES + 10)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        im = media.load_image_url(f"{base}/a.png", "x", allowed_media_domains=("127.0.0.1",))
        assert im.size == (12, 7)
        assert media.load_image_url(f"{base}/a.png", "x", allowed_media_domains=("*",)).size \
            == (12, 7)
        for path, domains, why in [("/a.png", (), "disabled"),
                                   ("/a.png", ("example.com",), "not in"),
                                   ("/away", ("127.0.0.1",), "not in"),
                                   ("/big", ("127.0.0.1",), "larger")]:
            with pytest.raises(InvalidRequestError, match=why) as e:
                media.load_image_url(base + path, "messages.0.content.1",
                                     allowed_media_domains=domains)
            assert e.value.param == "messages.0.content.1"
    finally:
        server.shutdown()


def test_allowed_media_domains_flag_reaches_the_config():
    from jaxserve.config import engine_config_from_kwargs

    with pytest.raises(ValueError, match="allowed_media_domains"):
        engine_config_from_kwargs("m", allowed_media_domains=["http://a/b"])
