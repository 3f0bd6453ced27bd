"""The OpenAI-style request error, shared by the daemon (which answers it) and the router (which routes
on load when a body would be refused). Only the daemon's edge (daemon/http_errors.py) maps its other
domain errors onto it."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to the client with an OpenAI-style body."""

    def __init__(self, message: str, *, status: int = 400, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = error_type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(message, param=param, code=code)


def invalid_field(field: str, message: str) -> APIError:
    """A 400 naming `field`, its message prefixed with the field ("tools[0].type: ...")."""
    return invalid(field, f"{field}: {message}")
