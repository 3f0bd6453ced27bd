"""Serving an aiohttp app on loopback for a test: one way to start it and learn its port."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web


async def start_app(app: web.Application, host: str = "127.0.0.1", port: int = 0,
                    **runner_kwargs: Any) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0: the OS picks one); the runner (its cleanup() stops the app) and the
    port it is bound to."""
    runner = web.AppRunner(app, **runner_kwargs)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[0][1]


@contextlib.asynccontextmanager
async def serving(app: web.Application, host: str = "127.0.0.1") -> AsyncIterator[int]:
    """`start_app` for the length of a with-block; yields the port."""
    runner, port = await start_app(app, host)
    try:
        yield port
    finally:
        await runner.cleanup()
