"""OpenAI-style error bodies and the JSON responses every handler returns."""
from __future__ import annotations

import logging

from starlette.responses import JSONResponse, Response

from jaxserve.entrypoints.openai import protocol as P
from jaxserve.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)


# ---- errors ----------------------------------------------------------------------------------
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError",
                422: "UnprocessableEntityError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


def error_body(message: str, status: int, param: str | None = None,
               type: str | None = None) -> dict:
    info = P.ErrorInfo(message=message, type=type or _ERROR_TYPES.get(status, "error"),
                       param=param, code=status)
    return P.ErrorResponse(error=info).model_dump()


def error_response(message: str, status: int, param: str | None = None,
                   type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, type), status_code=status)


def error_from_exception(exc: BaseException, engine) -> tuple[dict, int]:
    if isinstance(exc, InvalidRequestError):
        status = exc.status_code
        typ = exc.type if exc.type != "invalid_request_error" else None
        return error_body(exc.message, status, exc.param, typ), status
    if isinstance(exc, EngineDeadError):
        return error_body(f"the engine is not running: {exc}", 503), 503
    if isinstance(exc, ServerShuttingDown):
        return error_body(str(exc), 503), 503
    if isinstance(exc, ValueError):  # the project's contract: bad input raises ValueError
        return error_body(str(exc), 400), 400
    try:
        engine.check_health()
    except EngineDeadError as dead:
        return error_body(f"the engine is not running: {dead}", 503), 503
    logger.exception("internal error", exc_info=exc)
    return error_body(f"internal server error: {type(exc).__name__}", 500), 500


class ServerShuttingDown(Exception):
    """The server is draining: new requests get 503, and requests still running when the grace
    period ends get this error (in-band on a stream, then ``[DONE]``)."""


class JSONModel(Response):
    """JSON via pydantic (NaN/inf become null instead of failing)."""

    media_type = "application/json"

    def __init__(self, model: P.OpenAIBaseModel, status_code: int = 200):
        super().__init__(model.model_dump_json(), status_code=status_code)


# ---- auth ------------------------------------------------------------------------------------
# routes that need the API key: the OpenAI API, and what changes the server's state
class ClientGone(Exception):
    pass


