"""One source for every setting: EngineConfig fields reach the kernels and the runner through the settings
resolved at engine start, bad values name their field, and no code outside the config layer reads a
KVPILOT_* variable."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvpilot.daemon.engine import LLM, config
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.kernels import cpu_native, ops, reference, settings

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("daemon", "kernels", "router", "operator", "src")
# the config layer: the only files that may read a KVPILOT_* variable
CONFIG_LAYER = {"config.py", "args.py", "paths.py", "cli.py", "__main__.py"}
ENV_READ = re.compile(r'(environ\.get|environ\[|getenv)\(?\s*"KVPILOT_')
# a whole KVPILOT_ name as a string constant, read through a name (_ENV = "KVPILOT_X"; os.environ.get(_ENV))
ENV_NAME_CONSTANT = re.compile(r"""["']KVPILOT_[A-Z0-9_]+["']""")
ENV_ACCESS = re.compile(r"\b(os\.environ|environ\b|getenv\()")


@pytest.fixture(autouse=True)
def restore_kernel_settings() -> Iterator[None]:
    before = ops.current()
    yield
    ops.configure(before)


def in_config_layer(path: Path) -> bool:
    return path.name in CONFIG_LAYER or (path.name.startswith("settings") and path.suffix == ".py")


def env_reads(text: str) -> list[str]:
    """The lines of a non-config-layer source that read a KVPILOT_* variable, directly or via a constant."""
    hits = [line.strip() for line in text.splitlines() if ENV_READ.search(line)]
    if ENV_ACCESS.search(text):
        hits += [line.strip() for line in text.splitlines() if ENV_NAME_CONSTANT.search(line)]
    return hits


def test_the_scan_finds_what_it_forbids() -> None:
    assert env_reads('x = os.environ.get("KVPILOT_FOO", "1")')
    assert env_reads('x = os.getenv("KVPILOT_FOO")')
    assert env_reads('_ENV = "KVPILOT_FOO"\n\ndef f():\n    return os.environ.get(_ENV)')
    assert not env_reads('x = os.environ.get("HF_HUB_OFFLINE")\nraise ValueError("set KVPILOT_CACHE_DIR")')
    assert in_config_layer(Path("kernels/settings.py")) and not in_config_layer(Path("kernels/ops.py"))


def test_no_kvpilot_variable_is_read_outside_the_config_layer() -> None:
    found = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if in_config_layer(path):
                continue
            hits = env_reads(path.read_text())
            if hits:
                found[str(path.relative_to(ROOT))] = hits
    assert not found, f"KVPILOT_* variables read outside the config layer (make them EngineConfig fields): {found}"


def test_engine_config_reaches_the_kernels_and_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    # where the native kernel is there, auto would pick it for these float32 CPU tensors: only the
    # engine's attention_backend="torch" sends attention to the reference
    if not cpu_native.available():
        pytest.skip("no native CPU kernel: auto and torch pick the same")
    calls = {"torch": 0, "cpu": 0}

    def counting(name: str, module: object) -> None:
        real = module.paged_attention  # type: ignore[attr-defined]

        def counted(*args: object, **kwargs: object) -> torch.Tensor:
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "paged_attention", counted)

    counting("torch", reference)
    counting("cpu", cpu_native)
    threads = torch.get_num_threads()
    try:
        llm = LLM(model="builtin://smollm2-135m", dtype="float32", num_kv_blocks=16, max_model_len=128,
                  attention_backend="torch", prepack_weights=False, populate_kv=False, num_threads=1)
        assert ops.current().attention_backend == "torch" and not ops.current().prepack_weights
        assert torch.get_num_threads() == 1
        runner = llm.engine.runner
        assert not runner.model.prepacked and runner.kv_population is None
        calls.update(torch=0, cpu=0)  # warm-up steps ran already
        out = llm.generate(["The capital of France is"], use_tqdm=False)
        assert out[0].outputs[0].token_ids
        assert calls["torch"] > 0 and calls["cpu"] == 0, calls
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not cpu_native.available(), reason="no C compiler for the native CPU kernels")
def test_cpu_kernel_off_drops_the_native_kernels() -> None:
    q = torch.zeros(1, 2, 64)
    cache = torch.zeros(4, 16, 1, 64)
    assert ops.attention_backend_for(q, cache) == "cpu"
    ops.configure(replace(ops.current(), cpu_kernels=False))
    assert not ops.native_available() and ops.attention_backend_for(q, cache) == "torch"
    assert "disabled" in (cpu_native.build_error() or "")
    assert ops.panel_gemm_max_rows() == 0  # the model's small-batch GEMM is off with them
    ops.configure(replace(ops.current(), cpu_kernels=True))
    assert ops.native_available() and ops.attention_backend_for(q, cache) == "cpu"


@pytest.mark.parametrize(("field", "value"), [
    ("attention_backend", "cuda"),
    ("attention_backend", "TRITON"),
    ("enforce_eager", "yes"),
    ("cpu_kernel", 0),
    ("prepack_weights", None),
    ("small_batch_gemm", "auto"),
    ("malloc_tuning", 1),
    ("populate_kv", "0"),
    ("num_threads", 0),
    ("num_threads", 2.5),
])
def test_bad_values_name_their_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.parametrize(("field", "value"), [
    ("attention_backend", "cuda"),
    ("triton_fp32_precision", "fp64"),
    ("triton_fp32_prefill_block_m", 24),
    ("triton_fp32_prefill_block_m", 8),
    ("cpu_kernel_cflags", "-mno-avx2"),
])
def test_bad_kernel_settings_name_their_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ops.KernelSettings(**{field: value})


def test_the_engine_and_the_kernels_agree_on_the_backends() -> None:
    assert config.ATTENTION_BACKENDS == settings.ATTENTION_BACKENDS
    assert EngineConfig().attention_backend == ops.KernelSettings().attention_backend


def test_configure_returns_the_previous_settings() -> None:
    before = ops.current()
    chosen = replace(before, attention_backend="torch")
    assert ops.configure(chosen) is before
    assert ops.current() is chosen
    with pytest.raises(TypeError):
        ops.configure({"attention_backend": "torch"})  # type: ignore[arg-type]
