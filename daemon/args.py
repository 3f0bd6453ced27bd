"""`kvpilot serve` settings: flags named as in `vllm serve`, each also settable as a KVPILOT_* variable.

Precedence is flag > environment variable > default, so a container image can be configured with
env vars alone while `kubectl exec ... kvpilot serve --port 9000` still wins. The engine flags are
generated from EngineConfig's fields (help text from their metadata), so a new engine setting is a
new flag without being declared twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpilot import sizes

from .engine.config import DEFAULT_MODEL, EngineConfig
from .engine.spec_decode.config import speculative_config_json
from .lora_modules import LoRAModulePath, parse_lora_module, parse_lora_modules_env

__all__ = ["DEFAULT_MODEL", "ServeArgs", "add_serve_arguments", "parse_serve_args", "parse_size",
           "resolve_serve_args"]

ENV_PREFIX = "KVPILOT_"
# KVPILOT_ names that are not flags: kvpilot.paths' cache folder, and the prefixes of the test, e2e, bench
# and operator switches. No flag may produce one (_flags checks), so such a variable never sets a flag.
RESERVED_ENV_NAMES = frozenset({"KVPILOT_CACHE_DIR"})
RESERVED_ENV_PREFIXES = ("KVPILOT_TEST_", "KVPILOT_E2E_", "KVPILOT_BENCH_", "KVPILOT_OPERATOR_")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_size(text: str | int) -> int:
    """Bytes from '268435456', '20Gi', '256MiB' or '1.5G': kvpilot.sizes' grammar, the CRD's too."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    """A dict-valued engine field's flag: a JSON object, as vLLM takes --speculative-config."""
    try:
        return speculative_config_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {text}")
    return value


def _path_list(text: str) -> list[str]:
    """Folders separated as in PATH: a folder name may hold spaces or commas."""
    return [p for p in text.split(os.pathsep) if p]


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (use true/false, 1/0, yes/no, on/off)")


@dataclass
class ServeArgs:
    """The daemon's own settings; everything the engine reads is in `engine`."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] = field(default_factory=list)  # the first is reported; [] derives it
    max_queued_requests: int = 1024
    max_queued_tokens: int | None = None
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    disable_log_requests: bool = False
    ready_before_kv_cache_mapped: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    lora_modules: list[LoRAModulePath] = field(default_factory=list)  # loaded at startup
    lora_root: list[str] = field(default_factory=list)  # where runtime adapter loads may read from
    allow_runtime_lora_updating: bool = False

    @property
    def model(self) -> str:
        return self.engine.model

    def engine_config(self) -> EngineConfig:
        """The engine's config, reporting the first served name when names were given."""
        if not self.served_model_name:
            return self.engine
        return dataclasses.replace(self.engine, served_model_name=self.served_model_name[0])


@dataclass(frozen=True)
class _Flag:
    """One `kvpilot serve` argument: argparse's keyword arguments plus where its value goes."""

    dest: str
    group: str  # "server" or "engine"
    kwargs: dict[str, Any]
    positional: bool = False
    env_type: Callable[[str], Any] | None = None  # the KVPILOT_* parser, when the flag's own does not fit

    @property
    def names(self) -> list[str]:
        return [self.dest] if self.positional else ["--" + self.dest.replace("_", "-")]


_SERVER_FLAGS = (
    _Flag("host", "server", {"help": "address to bind (default 127.0.0.1; 0.0.0.0 in a pod)"}),
    _Flag("port", "server", {"type": _port, "help": "port (default 8000)"}),
    _Flag("api_key", "server", {"help": "require 'Authorization: Bearer KEY' on /v1/*"}),
    _Flag("served_model_name", "server", {
        "nargs": "+", "metavar": "NAME",
        "help": "names clients may use in 'model'; the first one is reported (default: derived from MODEL, "
                "e.g. smollm2-135m for builtin://smollm2-135m)"}),
    _Flag("max_queued_requests", "server", {
        "type": _positive_int, "help": "answer 429 once this many requests wait for their first token (default 1024)"}),
    _Flag("max_queued_tokens", "server", {
        "type": _positive_int,
        "help": "answer 429 once the waiting requests' prompts hold this many tokens (default: no limit)"}),
    _Flag("shutdown_timeout", "server", {
        "type": _non_negative_float,
        "help": "seconds in-flight requests may run after SIGTERM before they are aborted (default 30)"}),
    _Flag("log_level", "server", {"choices": ["debug", "info", "warning", "error"], "help": "default info"}),
    _Flag("disable_log_requests", "server", {
        "action": argparse.BooleanOptionalAction, "default": None, "help": "do not write the per-request log line"}),
    _Flag("ready_before_kv_cache_mapped", "server", {
        "action": argparse.BooleanOptionalAction, "default": None,
        "help": "on the CPU, report ready once the model has loaded, before any of the KV cache's pages are "
                "mapped in. Default: ready once the blocks of two full token budgets are (the blocks the "
                "first steps are handed), so those steps run at full speed; either way the rest maps in "
                "on a background thread only while no request is in hand"}),
    _Flag("enable_auto_tool_choice", "server", {
        "action": argparse.BooleanOptionalAction, "default": None,
        "help": "allow tool_choice 'auto' (the default when tools are given): calls are parsed out of the "
                "model's text; needs --tool-call-parser. Named and 'required' tool choices work without it"}),
    _Flag("tool_call_parser", "server", {
        "choices": ["hermes"], "help": "how tool calls look in the model's text: hermes (JSON in tool_call tags, as Qwen2.5 writes)"}),
    _Flag("lora_modules", "server", {
        "nargs": "+", "type": parse_lora_module, "metavar": "NAME=PATH",
        "help": "LoRA adapters to load at startup (needs --enable-lora), as name=path or vLLM's JSON "
                "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a path is a local PEFT folder, "
                "file:// or hf://org/name[@revision]. Clients select one with 'model': NAME. The env form is "
                "whitespace-separated items or a JSON array"}, env_type=parse_lora_modules_env),
    _Flag("lora_root", "server", {
        "action": "append", "metavar": "DIR",
        "help": "a folder runtime adapter loads may read from (repeatable; the env form separates them with "
                f"'{os.pathsep}'). A local lora_path must resolve (symlinks followed) inside one; hf:// "
                "adapters download into kvpilot's cache and need none"},
          env_type=_path_list),
    _Flag("allow_runtime_lora_updating", "server", {
        "action": argparse.BooleanOptionalAction, "default": None,
        "help": "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora; also "
                "set by vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)"}),
)

# vLLM's variable for the same switch, honoured so a vLLM deployment's env keeps working
VLLM_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

# Parsers for engine fields whose annotation alone says too little (sizes, ranges).
_ENGINE_FIELD_TYPES: dict[str, Callable[[str], Any]] = {
    "kv_cache_memory": parse_size,
    "swap_space": _non_negative_float,
    "long_prefill_token_threshold": _non_negative_int,
    "gpu_memory_utilization": float,
    "seed": int,
    "node_rank": _non_negative_int,
    "speculative_config": _json_object,
}
_DAEMON_ONLY = {"served_model_name"}  # a list in the server group; the engine gets its first name


def _engine_flag(f: dataclasses.Field, hint: Any) -> _Flag:
    """The flag of one EngineConfig field: type from the annotation, choices and help from metadata."""
    base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    kwargs: dict[str, Any] = {"help": f.metadata.get("help", "")}
    if f.default is not dataclasses.MISSING and f.default is not None and f.name != "model":
        kwargs["help"] += f" (default {f.default})"
    if base is bool:
        kwargs.update(action=argparse.BooleanOptionalAction, default=None)
    elif "choices" in f.metadata:
        kwargs.update(type=base, choices=list(f.metadata["choices"]))
    elif typing.get_origin(base) is dict:
        kwargs.update(type=_ENGINE_FIELD_TYPES[f.name], metavar="JSON")
    else:
        kwargs["type"] = _ENGINE_FIELD_TYPES.get(f.name, _positive_int if base is int else base)
    if f.name == "model":
        kwargs.update(nargs="?", default=None, help=f"{kwargs['help']} (default {DEFAULT_MODEL}; env KVPILOT_MODEL)")
        return _Flag("model", "engine", kwargs, positional=True)
    return _Flag(f.name, "engine", kwargs)


def _engine_flags() -> tuple[_Flag, ...]:
    hints = typing.get_type_hints(EngineConfig)
    return tuple(_engine_flag(f, hints[f.name]) for f in dataclasses.fields(EngineConfig)
                 if f.name not in _DAEMON_ONLY)


def _flags() -> tuple[_Flag, ...]:
    flags = (*_SERVER_FLAGS, *_engine_flags())
    for flag in flags:
        name = env_name(flag.dest)
        if name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIXES):
            raise RuntimeError(f"flag {flag.dest!r} would be read from {name}, a name reserved for other uses")
    return flags


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `kvpilot serve`. Every flag's env variable is KVPILOT_<DEST> (e.g. KVPILOT_MAX_NUM_SEQS)."""
    groups = {"server": p.add_argument_group("server"), "engine": p.add_argument_group("engine")}
    for flag in _flags():
        target = p if flag.positional else groups[flag.group]
        target.add_argument(*flag.names, **flag.kwargs)


def _env_converter(flag: _Flag) -> Callable[[str], Any]:
    """The function turning a KVPILOT_* string into the flag's value."""
    kw = flag.kwargs
    if flag.env_type is not None:
        return flag.env_type
    if kw.get("action") is argparse.BooleanOptionalAction:
        convert: Callable[[str], Any] = parse_bool
    elif kw.get("nargs") in ("+", "*"):
        convert = _list_of(kw.get("type", str))
    else:
        convert = kw.get("type", str)
    if kw.get("choices") is not None:
        convert = _checked(convert, kw["choices"])
    return convert


def _list_of(item: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """A list flag's env form: items separated by commas or whitespace."""
    def convert(text: str) -> list[Any]:
        return [item(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    return convert


def _checked(fn: Callable[[str], Any], choices: Sequence[Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
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
    args, engine_values = ServeArgs(), {}
    for flag in _flags():
        value = getattr(ns, flag.dest, None)
        if value is None and env_name(flag.dest) in environ:
            raw = environ[env_name(flag.dest)]
            try:
                value = _env_converter(flag)(raw)
            except (argparse.ArgumentTypeError, ValueError) as exc:
                parser.error(f"{env_name(flag.dest)}={raw!r}: {exc}")
        if value is None:
            continue
        if flag.group == "engine":
            engine_values[flag.dest] = value
        else:
            setattr(args, flag.dest, value)
    if not args.api_key:
        args.api_key = None
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    try:
        args.engine = EngineConfig(**engine_values)  # its own checks: bad combinations exit like bad flags
    except ValueError as exc:
        parser.error(str(exc))
    _check_lora_flags(args, ns, parser, environ)
    return args


def _check_lora_flags(args: ServeArgs, ns: argparse.Namespace, parser: argparse.ArgumentParser,
                      environ: Mapping[str, str]) -> None:
    """vLLM's runtime-updating variable (below the flag and KVPILOT_*, as vLLM parses it), and the LoRA
    flags' need for --enable-lora: without it they would be silently useless, so they stop the start."""
    runtime_source = "--allow-runtime-lora-updating"
    unset = getattr(ns, "allow_runtime_lora_updating", None) is None
    vllm_on = environ.get(VLLM_RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")
    if unset and env_name("allow_runtime_lora_updating") not in environ and vllm_on:
        args.allow_runtime_lora_updating = True
        runtime_source = f"{VLLM_RUNTIME_LORA_ENV}=true"
    if args.engine.enable_lora:
        return
    given = [name for name, on in (("--lora-modules", bool(args.lora_modules)), ("--lora-root", bool(args.lora_root)),
                                   (runtime_source, args.allow_runtime_lora_updating)) if on]
    if given:
        parser.error(f"{', '.join(given)}: LoRA serving needs --enable-lora")


def parse_serve_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> ServeArgs:
    """Parse `kvpilot serve` arguments alone (tests and embedding)."""
    p = argparse.ArgumentParser(prog="kvpilot serve")
    add_serve_arguments(p)
    return resolve_serve_args(p.parse_args(list(argv)), p, environ)
