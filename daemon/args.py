"""`kvpilot serve` settings: flags named as in `vllm serve`, each also settable as a KVPILOT_* variable.

Precedence is flag > environment variable > default, so a container image can be configured with
env vars alone while `kubectl exec ... kvpilot serve --port 9000` still wins.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .engine.config import DTYPES, PREEMPTION_MODES, SCHEDULING_POLICIES, EngineConfig

DEFAULT_MODEL = "builtin://smollm2-135m"
ENV_PREFIX = "KVPILOT_"

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_size(text: str | int) -> int:
    """Bytes from '268435456', '256MiB', '1.5G' or '512Mi' (k8s style)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes, or e.g. 256MiB, 1G)")
        value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {text}")
    return value


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (use true/false, 1/0, yes/no, on/off)")


@dataclass
class ServeArgs:
    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] = field(default_factory=list)
    # engine
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    swap_space: float = 1.0
    seed: int = 0
    # daemon
    max_queued_requests: int = 1024
    max_queued_tokens: int | None = None
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    disable_log_requests: bool = False

    @property
    def model_names(self) -> list[str]:
        """Names a request may use in `model`; the first is the one reported and put on metrics."""
        return list(self.served_model_name)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            served_model_name=self.served_model_name[0] if self.served_model_name else None,
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_kv_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduling_policy=self.scheduling_policy,
            preemption_mode=self.preemption_mode,
            swap_space=self.swap_space,
            seed=self.seed,
        )


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `kvpilot serve`. Every flag's env variable is KVPILOT_<DEST> (e.g. KVPILOT_MAX_NUM_SEQS)."""
    p.add_argument("model", nargs="?", default=None,
                   help=f"model URI: builtin://NAME, hf://org/name, pvc://claim/path or a local path "
                        f"(default {DEFAULT_MODEL}; env KVPILOT_MODEL)")
    g = p.add_argument_group("server")
    g.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 in a pod)")
    g.add_argument("--port", type=_port, help="port (default 8000)")
    g.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="names clients may use in 'model'; the first one is reported (default: derived from MODEL)")
    g.add_argument("--max-queued-requests", type=_positive_int,
                   help="answer 429 once this many requests wait for their first token (default 1024)")
    g.add_argument("--max-queued-tokens", type=_positive_int,
                   help="answer 429 once the waiting requests' prompts hold this many tokens (default: no limit)")
    g.add_argument("--shutdown-timeout", type=_non_negative_float,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted (default 30)")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    g.add_argument("--disable-log-requests", action=argparse.BooleanOptionalAction, default=None,
                   help="do not write the per-request log line")
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", choices=DTYPES)
    e.add_argument("--device", choices=["auto", "cpu", "cuda"])
    e.add_argument("--block-size", type=int, choices=[8, 16, 32, 64, 128])
    e.add_argument("--max-num-seqs", type=_positive_int)
    e.add_argument("--max-num-batched-tokens", type=_positive_int)
    e.add_argument("--max-model-len", type=_positive_int)
    e.add_argument("--kv-cache-memory", type=parse_size, help="bytes for the KV cache (e.g. 256MiB)")
    e.add_argument("--gpu-memory-utilization", type=float)
    e.add_argument("--num-kv-blocks", type=_positive_int, help="fixed number of KV blocks (overrides memory sizing)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    e.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES)
    e.add_argument("--preemption-mode", choices=PREEMPTION_MODES)
    e.add_argument("--swap-space", type=_non_negative_float, help="GiB of CPU memory for swapped-out blocks")
    e.add_argument("--seed", type=int)


def _env_converters(p: argparse.ArgumentParser) -> dict[str, object]:
    """dest -> function turning an env string into the flag's value, taken from the parser itself."""
    conv: dict[str, object] = {}
    for action in p._actions:
        if action.dest in ("help", argparse.SUPPRESS):
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            conv[action.dest] = parse_bool
        elif action.nargs in ("+", "*"):
            conv[action.dest] = lambda s, t=action.type: [(t or str)(x) for x in re.split(r"[,\s]+", s.strip()) if x]
        else:
            conv[action.dest] = action.type or str
        if action.choices is not None:
            conv[action.dest] = _checked(conv[action.dest], action.choices)
    return conv


def _checked(fn, choices):
    def convert(text):
        value = fn(text)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if v not in choices:
                raise argparse.ArgumentTypeError(f"{v!r} is not one of {list(choices)}")
        return value
    return convert


def resolve_serve_args(ns: argparse.Namespace, parser: argparse.ArgumentParser,
                       environ: Mapping[str, str] | None = None) -> ServeArgs:
    """Merge parsed flags with KVPILOT_* variables and defaults. Bad env values exit like bad flags."""
    environ = os.environ if environ is None else environ
    args = ServeArgs()
    conv = _env_converters(parser)
    for dest, fn in conv.items():
        value = getattr(ns, dest, None)
        if value is None and env_name(dest) in environ:
            raw = environ[env_name(dest)]
            try:
                value = fn(raw)  # type: ignore[operator]
            except (argparse.ArgumentTypeError, ValueError) as exc:
                parser.error(f"{env_name(dest)}={raw!r}: {exc}")
        if value is not None and hasattr(args, dest):
            setattr(args, dest, value)
    if not args.api_key:
        args.api_key = None
    try:
        args.engine_config()
    except ValueError as exc:
        parser.error(str(exc))
    return args


def parse_serve_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> ServeArgs:
    """Parse `kvpilot serve` arguments alone (tests and embedding)."""
    p = argparse.ArgumentParser(prog="kvpilot serve")
    add_serve_arguments(p)
    return resolve_serve_args(p.parse_args(list(argv)), p, environ)
