"""Reading a JSON request body: media type, transfer decoding, strict UTF-8, unpaired surrogates.

Every failure here is the client's: an `APIError` with a 4xx status, never a 5xx.
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kvpilot.common.errors import APIError
from kvpilot.common.protocol import parse_json_body

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json_content_type(request: web.Request) -> None:
    """Only application/json. text/plain and form types are what a browser page may send
    cross-origin without a CORS preflight, so accepting them would expose a keyless daemon."""
    ctype = request.headers.get("Content-Type", "")
    mime, _, params = ctype.partition(";")
    if mime.strip().lower() != "application/json":
        shown = mime.strip() or "none"
        raise APIError(f"Content-Type must be application/json, got {shown}", status=415,
                       param="Content-Type", code="unsupported_media_type")
    for p in params.split(";"):
        key, _, value = p.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise APIError(f"request bodies must be UTF-8, got charset={value.strip()}", status=415,
                           param="Content-Type", code="unsupported_media_type")


async def read_json_body(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object of valid Unicode text; a bad body is a 400/413/415."""
    check_json_content_type(request)
    try:
        raw = await request.read()
    except (RequestPayloadError, HttpProcessingError) as exc:  # e.g. Content-Encoding: gzip, body not gzip
        # the rest of the body cannot be read either: close the connection after the answer
        raise APIError(f"the request body could not be decoded: {_reason(exc)}", code="invalid_body",
                       headers={"Connection": "close"}) from None
    return decode_json_body(raw)


def decode_json_body(raw: bytes) -> dict[str, Any]:
    """Strict UTF-8 bytes -> a JSON object whose strings and keys are all valid Unicode."""
    try:
        text = raw.decode("utf-8")  # strict: CESU-8 surrogates (ED A0 80) and stray bytes fail here
    except UnicodeDecodeError as exc:
        raise APIError(f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_json") from None
    body = parse_json_body(text)
    where = find_unpaired_surrogate(body)
    if where is not None:
        raise APIError(f"'{where}' holds an unpaired UTF-16 surrogate (an escape like \\ud800 "
                       f"without its pair); that is not valid Unicode text", param=where,
                       code="invalid_unicode")
    return body


def _reason(exc: Exception) -> str:
    cause = exc.__cause__ or exc
    return getattr(cause, "message", None) or str(cause).strip() or type(cause).__name__


def _key_path(path: str, key: str) -> str:
    if not key:  # an empty key still needs a visible name in the error's param
        return f'{path}[""]'
    return key if path == "body" else f"{path}.{key}"


def find_unpaired_surrogate(value: Any) -> str | None:
    """The path (e.g. messages[0].content) of the first string or key holding a lone surrogate.

    json.loads joins a valid escape pair into one character, so any surrogate left is unpaired.
    Iterative, so a deeply nested body cannot overflow the stack."""
    stack: list[tuple[str, Any]] = [("body", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return path
        elif isinstance(v, dict):
            for k, item in v.items():
                sub = _key_path(path, k)
                if _SURROGATE.search(k):
                    return path
                stack.append((sub, item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None
