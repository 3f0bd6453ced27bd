"""Domain errors -> OpenAI-style HTTP errors. The one place that decides status codes for them."""

from __future__ import annotations

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kvpilot.common.errors import APIError

from .engine.input_processor import InputError
from .engine.lora import LoRANotFound
from .errors import EngineDead, EngineNotReady, EngineQueueFull, EngineRejected


def to_api_error(exc: BaseException) -> APIError | None:
    """The HTTP answer for a domain error; None for anything else (a bug: the caller answers 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestPayloadError | HttpProcessingError):  # a body aiohttp could not decode
        return APIError(f"the request body could not be decoded: {str(exc).strip() or type(exc).__name__}",
                        code="invalid_body", headers={"Connection": "close"})
    if isinstance(exc, LoRANotFound):  # an InputError, but naming what is not there: vLLM answers 404
        return APIError(str(exc), status=404, param=exc.param, code=exc.code)
    if isinstance(exc, InputError):  # bad adapter names, paths and files among them: a 400
        return APIError(str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, EngineQueueFull):
        return APIError(str(exc), status=429, error_type="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineNotReady):
        return APIError(str(exc), status=503, error_type="service_unavailable_error", code="model_loading",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineDead):
        return APIError(str(exc), status=503, error_type="service_unavailable_error", code="engine_dead")
    if isinstance(exc, EngineRejected):
        return APIError(str(exc), status=500, error_type="internal_error", code="engine_error")
    return None
