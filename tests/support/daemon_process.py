"""Run a real `kvpilot serve` subprocess on loopback: used by the tests and bench/serving.py.

The daemon binds port 0 and logs the port it got, so there is no free-port race.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


class DaemonProcess:
    def __init__(self, *serve_args: str, env: dict[str, str] | None = None, host: str = "127.0.0.1") -> None:
        self.serve_args = list(serve_args)
        self.host = host
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        fd, name = tempfile.mkstemp(prefix="kvpilot-daemon-", suffix=".log")
        os.close(fd)  # the child writes the log; this side only reads it back
        self.log_path = Path(name)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def start(self, timeout: float = 180.0, wait_ready: bool = True) -> DaemonProcess:
        cmd = [sys.executable, "-m", "kvpilot.daemon.cli", "serve", *self.serve_args, "--host", self.host,
               "--port", "0"]
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while self.port is None:
            self._check_alive()
            self.port = self._find_port()
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon did not start listening in {timeout}s:\n{self.logs()}")
            time.sleep(0.05)
        if wait_ready:
            while self.get("/ready")[0] != 200:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"daemon not ready in {timeout}s:\n{self.logs()}")
                time.sleep(0.1)
        return self

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.logs()}")

    def _find_port(self) -> int | None:
        for rec in self.log_records():
            if rec.get("msg") == "listening":
                return int(rec["port"])
        return None

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_records(self) -> list[dict]:
        """The daemon's JSON log lines (others, e.g. from libraries, are skipped)."""
        recs = []
        for line in self.logs().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    recs.append(json.loads(line))
        return recs

    def get(self, path: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url(path), headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, b""

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
