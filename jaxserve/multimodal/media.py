"""Images from where clients put them: a PIL image (Python API), a ``data:`` URL with base64
PNG / JPEG / WebP, a ``file://`` path under ``--allowed-local-media-path``, or an http(s) URL
from a host ``--allowed-media-domains`` names (fetched with a size limit and a timeout,
``$VLLM_IMAGE_FETCH_TIMEOUT`` / ``$JAXSERVE_IMAGE_FETCH_TIMEOUT`` seconds, 5 by default;
redirects must stay on allowed hosts).
Every failure is an ``InvalidRequestError`` naming the field that carried the image."""
from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from jaxserve.errors import InvalidRequestError

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an encoded image larger than this is refused
MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # decoded size (a decompression bomb is refused)
FORMATS = ("PNG", "JPEG", "WEBP")


def decode_image(data: bytes, where: str):
    """An RGB PIL image from encoded bytes, or a 400 naming ``where``."""
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"{where}: the image is {len(data)} bytes, more than the "
                                  f"limit of {MAX_IMAGE_BYTES}", param=where)
    try:
        im = Image.open(io.BytesIO(data))
        if im.format not in FORMATS:
            raise InvalidRequestError(f"{where}: image format {im.format} is not supported "
                                      f"(supported: {', '.join(FORMATS)})", param=where)
        if im.width * im.height > MAX_IMAGE_PIXELS:
            raise InvalidRequestError(f"{where}: the image is {im.width}x{im.height}, more "
                                      f"than {MAX_IMAGE_PIXELS} pixels", param=where)
        im.load()
        return im.convert("RGB")
    except InvalidRequestError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever PIL says of a corrupt file
        raise InvalidRequestError(f"{where}: the image could not be decoded ({e})",
                                  param=where) from None


def load_image_url(url: str, where: str, *, allowed_local_media_path: str | None = None,
                   allowed_media_domains: tuple[str, ...] = (), timeout_s: float | None = None):
    """The image an ``image_url.url`` names."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{where}: an image URL is required", param=where)
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head or not head[5:].startswith("image/"):
            raise InvalidRequestError(f"{where}: a data URL must be data:image/...;base64,...",
                                      param=where)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(f"{where}: the data URL is not valid base64",
                                      param=where) from None
        return decode_image(data, where)
    scheme = urlparse(url).scheme
    if scheme == "file":
        return decode_image(_read_local(url, where, allowed_local_media_path), where)
    if scheme in ("http", "https"):
        if not allowed_media_domains:
            raise InvalidRequestError(f"{where}: http(s) image URLs are disabled on this "
                                      "server (--allowed-media-domains); send the image as a "
                                      "data URL", param=where)
        _check_host(url, where, allowed_media_domains)
        return decode_image(_fetch(url, where, fetch_timeout() if timeout_s is None
                                   else timeout_s, allowed_media_domains), where)
    raise InvalidRequestError(f"{where}: unsupported image URL scheme {scheme!r} (data:, "
                              "file:// or http(s))", param=where)


def _read_local(url: str, where: str, allowed: str | None) -> bytes:
    if not allowed:
        raise InvalidRequestError(f"{where}: file:// URLs need --allowed-local-media-path",
                                  param=where)
    path = Path(os.path.realpath(unquote(urlparse(url).path)))
    root = Path(os.path.realpath(allowed))
    if root != path and root not in path.parents:
        raise InvalidRequestError(f"{where}: {path} is outside --allowed-local-media-path",
                                  param=where)
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise InvalidRequestError(f"{where}: the image is {size} bytes, more than the "
                                      f"limit of {MAX_IMAGE_BYTES}", param=where)
        return path.read_bytes()
    except OSError as e:
        raise InvalidRequestError(f"{where}: cannot read {path} ({e.strerror})",
                                  param=where) from None


def fetch_timeout() -> float:
    """Seconds an http(s) image fetch may take (vLLM's ``VLLM_IMAGE_FETCH_TIMEOUT``)."""
    for key in ("JAXSERVE_IMAGE_FETCH_TIMEOUT", "VLLM_IMAGE_FETCH_TIMEOUT"):
        if os.environ.get(key):
            try:
                value = float(os.environ[key])
            except ValueError:
                raise ValueError(f"{key} must be a number of seconds") from None
            if value <= 0:
                raise ValueError(f"{key} must be > 0 seconds")
            return value
    return 5.0


def _check_host(url: str, where: str, allowed: tuple[str, ...]) -> None:
    host = (urlparse(url).hostname or "").lower()
    if "*" not in allowed and host not in allowed:
        raise InvalidRequestError(f"{where}: host {host!r} is not in --allowed-media-domains",
                                  param=where)


def _fetch(url: str, where: str, timeout_s: float, allowed: tuple[str, ...]) -> bytes:
    import urllib.request

    class _Redirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            _check_host(newurl, where, allowed)  # a redirect leaves no allowed host
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    try:
        with urllib.request.build_opener(_Redirects).open(url, timeout=timeout_s) as r:
            data = r.read(MAX_IMAGE_BYTES + 1)
    except InvalidRequestError:
        raise
    except Exception as e:  # noqa: BLE001
        raise InvalidRequestError(f"{where}: fetching the image failed ({e})",
                                  param=where) from None
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes",
                                  param=where)
    return data
