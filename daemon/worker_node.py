"""`kvpilot serve` on a node other than node 0 (a LeaderWorkerSet's worker pod): it runs this node's ranks
and answers only the probes. /ready is 200 once its ranks joined the group and loaded their shards,
/health 503 once one of them is gone; the process then exits non-zero, so that the group is recreated
(LWS RecreateGroupOnPodRestart) and rejoins a fresh leader."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from aiohttp import web

from kvpilot.listen import start_app

from .args import ServeArgs
from .engine.executor.layout import NodeLayout
from .engine.executor.multiproc import NodeRanks

log = logging.getLogger("kvpilot.daemon.worker_node")

_WATCH_S = 0.5
RANKS_KEY = web.AppKey("ranks", NodeRanks)


async def _health(request: web.Request) -> web.Response:
    ranks = request.app[RANKS_KEY]
    failure = ranks.failure()
    if failure is None:
        return web.json_response({"status": "ok", "role": "worker"})
    return web.json_response({"status": "dead", "role": "worker", "error": failure}, status=503)


async def _ready(request: web.Request) -> web.Response:
    ranks = request.app[RANKS_KEY]
    if ranks.ready():
        return web.json_response({"status": "ready", "role": "worker"})
    return web.json_response({"status": "loading" if ranks.alive() else "dead", "role": "worker"}, status=503)


async def serve_worker_node(args: ServeArgs, layout: NodeLayout) -> int:
    """Run this node's ranks until a signal (exit 0) or until one of them ends (exit 1)."""
    ranks = NodeRanks(args.engine_config(), layout)
    app = web.Application()
    app[RANKS_KEY] = ranks
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    runner, port = await start_app(app, args.host, args.port, shutdown_timeout=1.0)
    log.info("listening", extra={"fields": {"host": args.host, "port": port, "role": "worker",
                                            "node_rank": layout.node_rank, "nnodes": layout.nnodes,
                                            "ranks": [layout.local_ranks.start, layout.local_ranks.stop - 1]}})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        while not stop.is_set():
            failure = ranks.failure()
            if failure is not None:
                log.error("a rank of this node ended; exiting", extra={"fields": {"error": failure}})
                code = 1
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _WATCH_S)
    finally:
        await runner.cleanup()
        await asyncio.to_thread(ranks.stop)
    return code
