"""The one error type for bad input, mapped by the server to an OpenAI-style JSON error."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad input from a user. ``param`` names the offending field; ``status_code`` the HTTP code."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.type = type


class EngineDeadError(RuntimeError):
    """The engine loop failed; the server answers 503 and /health turns unhealthy."""
