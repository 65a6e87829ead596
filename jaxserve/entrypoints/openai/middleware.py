"""ASGI middleware: the bearer key on /v1 and the X-Request-Id header on every answer."""
from __future__ import annotations

import secrets
import uuid


from jaxserve.entrypoints.openai.responses import error_response


MAX_REQUEST_ID_CHARS = 256  # a longer X-Request-Id is replaced, not echoed


# /v1, and the operations that change the engine (dev_routes.DEV_PATHS with the dev flag)
PROTECTED = ("/v1", "/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping",
             "/update_weights")


def _route_path(scope) -> str:
    """The path the routes see: without ``--root-path``, which uvicorn keeps in ``path``."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class BearerAuth:
    """Pure ASGI middleware: every protected route needs ``Authorization: Bearer <api_key>``."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _route_path(scope).startswith(PROTECTED):
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                resp = error_response("missing or invalid API key (Authorization: Bearer ...)",
                                      401)
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdHeader:
    """Pure ASGI middleware: every response carries ``X-Request-Id``, the client's own when it
    sent a usable one (printable ASCII, at most ``MAX_REQUEST_ID_CHARS``), else a fresh one.
    The id is only echoed and logged; the engine never keys anything by it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = client_request_id(scope) or uuid.uuid4().hex

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def client_request_id(scope) -> str | None:
    """The client's ``X-Request-Id`` header, when it is one we can echo safely."""
    raw = dict(scope.get("headers") or []).get(b"x-request-id")
    if not raw or len(raw) > MAX_REQUEST_ID_CHARS:
        return None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if text.isprintable() else None




class BodyLimit:
    """Pure ASGI middleware: a request whose ``Content-Length`` is over ``max_bytes`` gets a
    413 before any route reads it. Its bytes are drained and dropped first (up to
    ``drain_bytes``; past that the connection closes) so the client, still sending, reads the
    answer instead of a reset connection. A chunked body is counted as it arrives: the routes
    read it through ``receive`` and answer 413 once it passes the limit."""

    def __init__(self, app, max_bytes: int, drain_bytes: int | None = None):
        self.app = app
        self.max_bytes = int(max_bytes)
        self.drain_bytes = int(drain_bytes if drain_bytes is not None
                               else max(4 * self.max_bytes, 256 * 2**20))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            if int(declared) <= self.drain_bytes:
                more = True
                while more:
                    msg = await receive()
                    if msg["type"] != "http.request":
                        return  # the client left: nobody to answer
                    more = msg.get("more_body", False)
            resp = error_response(f"request body larger than {self.max_bytes} bytes "
                                  "(--max-request-body-bytes)", 413)
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)
