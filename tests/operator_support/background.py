"""Servers on an event loop of their own, in a thread of their own.

The operator runs in kopf's KopfRunner thread, and KopfRunner's exit joins that thread synchronously, which
blocks the test's event loop. Whatever the operator talks to (the API emulator, the daemons' /metrics) must
keep answering meanwhile, or kopf's last calls on exit (the peering PATCH that takes it out of the peering
object) wait until KopfRunner's timeout. So each server gets a loop that nothing on the test's side blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

T = TypeVar("T")

# How long a server may take to stop (aiohttp's graceful shutdown of open watches included).
STOP_TIMEOUT = 30.0


@contextlib.asynccontextmanager
async def on_own_loop(factory: Callable[[], AbstractAsyncContextManager[T]], name: str) -> AsyncIterator[T]:
    """Enter factory() on a new event loop in a new thread; yield what it yields; exit it there on the way out.

    The value is used from the test's thread too: plain attributes and lists are fine (the GIL), coroutines
    of the value must not be awaited on the test's loop."""
    entered: concurrent.futures.Future[tuple[T, asyncio.AbstractEventLoop, asyncio.Event]] = \
        concurrent.futures.Future()
    finished: concurrent.futures.Future[None] = concurrent.futures.Future()

    async def serve() -> None:
        stop = asyncio.Event()
        try:
            async with factory() as value:
                entered.set_result((value, asyncio.get_running_loop(), stop))
                await stop.wait()
        except BaseException as e:
            if not entered.done():
                entered.set_exception(e)
            raise

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as e:  # noqa: BLE001  (handed to the test's thread)
            finished.set_exception(e)
        else:
            finished.set_result(None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    value, loop, stop = await asyncio.wrap_future(entered)
    try:
        yield value
    finally:
        if not finished.done():  # else the server already stopped (and failed): its loop is closed
            loop.call_soon_threadsafe(stop.set)
        await asyncio.wait_for(asyncio.wrap_future(finished), STOP_TIMEOUT)
        thread.join()
