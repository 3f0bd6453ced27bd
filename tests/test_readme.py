"""The examples of README.md and docs/*.md run as written: `make serve`, then their curl and openai-client
blocks, and the offline API; the scripts in examples/ likewise. The `kvpilot serve` flag table in
docs/configuration.md matches `--help`."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import serve_flags
from support.readme_blocks import KINDS, Block, all_blocks, doc_files

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
BLOCKS = all_blocks(ROOT)


def _env() -> dict[str, str]:
    # The README's commands say `.venv/bin/...` and `python`; both must be this interpreter's venv.
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _run(block: Block, port: int | None = None, timeout: float = 300) -> str:
    code = block.code if port is None else block.code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    cmd = ["bash", "-euo", "pipefail", "-c", code] if block.lang == "bash" else [sys.executable, "-c", code]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{block.where} exited {r.returncode}\n{code}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    expect = block.attrs.get("expect")
    if expect:
        assert re.search(expect, r.stdout), f"{block.where}: output does not match {expect!r}:\n{r.stdout}"
    return r.stdout


def _by_kind(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind]


def test_docs_are_collected():
    files = {p.relative_to(ROOT).as_posix() for p in doc_files(ROOT)}
    assert "README.md" in files and "docs/configuration.md" in files
    assert any(b.file == "README.md" for b in BLOCKS), "the README has no bash/python blocks"


def test_every_block_is_marked_with_a_known_kind():
    assert BLOCKS, "README.md and docs/*.md have no bash/python blocks"
    for b in BLOCKS:
        assert b.kind in KINDS, f"{b.where}: mark it with <!-- readme: {'|'.join(KINDS)} -->"
        if b.kind in ("run", "client"):
            assert "expect" in b.attrs, f"{b.where}: a {b.kind} block needs expect=\"regex\" on its output"
        if b.kind == "skip":
            assert b.attrs.get("why"), f"{b.where}: say why it is skipped"


def test_cluster_blocks_are_at_least_valid_syntax():
    for b in _by_kind("cluster"):
        if b.lang == "python":
            ast.parse(b.code)
        else:
            r = subprocess.run(["bash", "-n", "-c", b.code], capture_output=True, text=True)
            assert r.returncode == 0, f"{b.where}: {r.stderr}"


@pytest.mark.slow
@pytest.mark.parametrize("block", _by_kind("run"), ids=lambda b: f"{b.file}:{b.line}")
def test_run_blocks(block: Block):
    _run(block)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_port() -> Iterator[int]:
    """The README's own serve block (`make serve`), on a free port instead of 8000."""
    serves = _by_kind("serve")
    assert len(serves) == 1, f"exactly one serve block, the README's: {[b.where for b in serves]}"
    (serve,) = serves
    assert serve.file == "README.md", f"{serve.where}: the serve block belongs in the README's quick start"
    assert serve.code.strip() == "make serve", f"{serve.where}: the test starts exactly `make serve`"
    port = _free_port()
    log = open(ROOT / ".venv" / f"readme-serve-{port}.log", "w+")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(["make", "-s", "serve", f"PORT={port}"], cwd=ROOT, env=_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not _ready(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"`make serve` did not become ready (rc={proc.poll()}):\n{log.read()[-4000:]}")
            time.sleep(0.2)
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.slow
def test_client_blocks_against_make_serve(served_port: int):
    clients = _by_kind("client")
    assert any(b.file == "README.md" for b in clients), "the README shows no HTTP example"
    for block in clients:
        _run(block, port=served_port)


EXAMPLE_SCRIPTS = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLE_SCRIPTS, ids=lambda p: p.name)
def test_example_scripts(script: Path, served_port: int):
    """Each example names its expected output in an `# expect: REGEX` line; HTTP ones read KVPILOT_URL."""
    text = script.read_text()
    m = re.search(r"^# expect: (.+)$", text, re.M)
    assert m, f"{script.name}: add an '# expect: REGEX' line"
    env = {**_env(), "KVPILOT_URL": f"http://127.0.0.1:{served_port}/v1"}
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"{script.name}: {r.stderr[-3000:]}"
    assert re.search(m.group(1), r.stdout), f"{script.name}: output does not match {m.group(1)!r}:\n{r.stdout}"


def test_flag_table_matches_serve_help():
    text = serve_flags.TARGET.read_text()
    m = re.search(re.escape(serve_flags.START) + ".*?" + re.escape(serve_flags.END), text, re.S)
    assert m, "docs/configuration.md lacks the <!-- serve-flags:start/end --> table"
    assert m.group(0) == serve_flags.section(serve_flags.help_text()), (
        "docs/configuration.md's `kvpilot serve` table differs from `kvpilot serve --help`: run `make readme`")


def test_flag_table_lists_every_option_of_help():
    text = serve_flags.help_text()
    option_lines = [line for line in text.splitlines() if re.match(r"^\s+-", line)]
    spelled = {f for line in option_lines for f in re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", line)} - {"--help"}
    tabled = {f.split()[0] for flag, _ in serve_flags.options(text) for f in flag.split(", ")}
    assert spelled and spelled == tabled
