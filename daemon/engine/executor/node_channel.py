"""The driver's messages to the ranks of other nodes, over torch.distributed (a gloo group of rank 0 and
those ranks). A broadcast that waits longer than the group's timeout fails, so while the engine idles the
driver sends a no-op every third of it (at most every few seconds): a remote rank then only times out when
the driver is gone, and the driver learns that a node is gone from the failed no-op."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["NodeChannelReceiver", "NodeChannelSender"]

_MAX_HEARTBEAT_S = 5.0


class NodeChannelSender:
    def __init__(self, group: Any, timeout_s: float) -> None:
        self.group = group
        self._lock = threading.Lock()
        self._last = time.monotonic()
        # often enough that an idle engine notices a lost node within seconds (check_health)
        self._interval = min(timeout_s / 3, _MAX_HEARTBEAT_S)
        self._stop = threading.Event()
        self.failed: BaseException | None = None  # a heartbeat that failed: the next publish raises it
        self._thread = threading.Thread(target=self._heartbeat, name="kvpilot-node-heartbeat", daemon=True)
        self._thread.start()

    def publish(self, message: Any) -> None:
        if self.failed is not None:
            raise self.failed
        with self._lock:
            self._send(message)

    def _send(self, message: Any) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self.group)
        self._last = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._interval / 4):
            if time.monotonic() - self._last < self._interval:
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    self._send(("noop",))
                except Exception as exc:  # noqa: BLE001 - reported on the next publish
                    self.failed = exc
                    return

    def close(self) -> None:
        self._stop.set()


class NodeChannelReceiver:
    def __init__(self, group: Any) -> None:
        self.group = group

    def read(self, alive: Callable[[], bool]) -> Any:  # noqa: ARG002 - the group's timeout ends a wait on a lost driver
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
