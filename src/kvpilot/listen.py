"""Starting an aiohttp app the way the daemon and the router serve theirs."""

from __future__ import annotations

from aiohttp import web


async def start_app(app: web.Application, host: str, port: int, shutdown_timeout: float) -> tuple[web.AppRunner, int]:
    """Listen on host:port; the runner (its cleanup() stops the app) and the port bound (port 0: the one the
    OS picked). aiohttp's own signal handling stays off: the caller drains on SIGTERM itself. Handlers are
    cancelled when their client goes, so an abandoned request frees its engine slot."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                           shutdown_timeout=shutdown_timeout)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    bound = port
    for address in runner.addresses:
        bound = address[1]
    return runner, bound
