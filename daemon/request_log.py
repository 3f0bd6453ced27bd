"""Keys of the per-request log line on an aiohttp request: when it started and the fields it will log.

The error middleware in server.py writes the line; the routes add fields to it. These are request-log
keys, nothing to do with the KV cache.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

# typed keys where this aiohttp has them (3.11+), plain strings before
_RequestKey = getattr(web, "RequestKey", None)
REQUEST_STARTED_AT: Any = _RequestKey("request_started_at", float) if _RequestKey else "request_started_at"
REQUEST_LOG_FIELDS: Any = _RequestKey("request_log_fields", dict) if _RequestKey else "request_log_fields"
