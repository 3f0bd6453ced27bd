"""The driver's messages to the ranks of its own node: one shared-memory buffer (a file under /dev/shm,
mapped by every process) that the driver writes and every reader copies out, and semaphores that wake the
readers and tell the driver they have read it. A step's message is written once, whatever the number of
ranks, and a waiting rank sleeps in the kernel instead of polling."""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ShmBroadcast", "ShmReader"]

_HEADER = struct.Struct("<QB")  # the chunk's bytes, and whether more chunks of the message follow
_POLL_S = 0.5  # how often a waiting side checks that the other is alive


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@dataclass
class ShmReader:
    """A reader's end, picklable into a spawned process; ``open`` maps the buffer there."""

    path: str
    capacity: int
    ready: Any  # semaphore the driver releases once per chunk for this reader
    done: Any  # semaphore every reader releases once per chunk it has copied out
    _map: mmap.mmap | None = None

    def open(self) -> ShmReader:
        with open(self.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _HEADER.size + self.capacity)
        return self

    def read(self, alive: Callable[[], bool]) -> Any:
        """The next message; ``alive()`` false while waiting raises ``EOFError`` (the driver is gone)."""
        assert self._map is not None, "open() first"
        parts: list[bytes] = []
        more = True
        while more:
            while not self.ready.acquire(timeout=_POLL_S):
                if not alive():
                    raise EOFError("the driver is gone")
            size, more = _HEADER.unpack_from(self._map, 0)
            parts.append(self._map[_HEADER.size:_HEADER.size + size])
            self.done.release()
        return pickle.loads(b"".join(parts))  # noqa: S301 - written by this engine's own driver

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}


class ShmBroadcast:
    """The driver's end: ``publish`` writes a message for ``readers`` processes. Before it writes again it
    waits until every reader has copied the previous chunk out, checking ``check()`` (which raises when a
    reader died) while it waits, and giving up after ``timeout_s``."""

    def __init__(self, mp_context: Any, readers: int, *, capacity: int = 8 << 20, timeout_s: float = 300.0) -> None:
        fd, self.path = tempfile.mkstemp(prefix="kvpilot-steps-", dir=_shm_dir())
        with os.fdopen(fd, "r+b") as f:
            f.truncate(_HEADER.size + capacity)
            self._map = mmap.mmap(f.fileno(), _HEADER.size + capacity)
        self.capacity = capacity
        self.timeout_s = timeout_s
        self._ready = [mp_context.Semaphore(0) for _ in range(readers)]
        self._done = mp_context.Semaphore(0)
        self._unread = 0  # readers yet to copy out the last chunk written

    def reader(self, index: int) -> ShmReader:
        return ShmReader(self.path, self.capacity, self._ready[index], self._done)

    def publish(self, message: Any, check: Callable[[], None]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(data)
        for start in range(0, max(len(data), 1), self.capacity):
            chunk = view[start:start + self.capacity]
            self._wait_read(check)
            _HEADER.pack_into(self._map, 0, len(chunk), start + self.capacity < len(data))
            self._map[_HEADER.size:_HEADER.size + len(chunk)] = chunk
            for sem in self._ready:
                sem.release()
            self._unread = len(self._ready)

    def _wait_read(self, check: Callable[[], None]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self._unread:
            if self._done.acquire(timeout=_POLL_S):
                self._unread -= 1
                continue
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"a rank did not take the driver's message within {self.timeout_s:g} s")

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
