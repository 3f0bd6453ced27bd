"""`kvpilot router` / `python -m kvpilot.router`: flags, each also settable as KVPILOT_ROUTER_<FLAG>."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from .picker import PickerConfig
from .proxy import ProxyConfig
from .server import RouterSettings, serve
from .tokenize_pool import INLINE_CHARS, PENDING_PER_THREAD

ENV_PREFIX = "KVPILOT_ROUTER_"


class _EnvDefaults(argparse.ArgumentParser):
    """Every flag's default may come from KVPILOT_ROUTER_<FLAG> (dashes as underscores); flags win."""

    def add_argument(self, *args, **kwargs):  # type: ignore[override]
        action = super().add_argument(*args, **kwargs)
        env = os.environ.get(ENV_PREFIX + action.dest.upper())
        if env is not None and action.option_strings:
            if isinstance(action, argparse.BooleanOptionalAction):
                action.default = env.strip().lower() in ("1", "true", "yes", "on")
            else:
                action.default = action.type(env) if callable(action.type) else env
        return action


def build_parser() -> argparse.ArgumentParser:
    p = _EnvDefaults(prog="kvpilot router", description="Prefix- and load-aware OpenAI router in front of "
                     "kvpilot daemons.")
    a = p.add_argument
    a("--host", default="0.0.0.0")
    a("--port", type=int, default=8000)
    a("--endpoints", default=None, help="static comma-separated http://host:port list (dev/tests)")
    a("--service", default=None, help="route to the ready EndpointSlice addresses of this Service")
    a("--namespace", default=None, help="the Service's namespace (default: the pod's own)")
    a("--port-name", default=None, help="EndpointSlice port name (default: the first TCP port)")
    a("--tokenizer", default="", help="model URI whose tokenizer and chat template to use, as `kvpilot serve` "
      "takes it (default: UTF-8 bytes, which agrees across routers but not with the engine's token counts)")
    a("--block-size", type=int, default=16, help="the daemons' --block-size")
    a("--prefix", action=argparse.BooleanOptionalAction, default=True, help="prefix affinity")
    a("--load", action=argparse.BooleanOptionalAction, default=True, help="scraped load and the load cap")
    a("--session", default="off", help="session affinity: off, user (the body's `user`) or header:<Name>")
    a("--load-cap", type=float, default=PickerConfig.load_cap, help="affinity may put a replica this share above the mean")
    a("--kv-full", type=float, default=0.95, help="KV usage above which a replica takes no affinity traffic")
    a("--hash-blocks", type=int, default=1, help="leading blocks that seed the consistent hash")
    a("--queue-weight", type=float, default=PickerConfig.queue_weight, help="extra cost of a waiting request "
      "(a request counts 1; a waiting one 1 + this)")
    a("--kv-weight", type=float, default=PickerConfig.kv_weight, help="cost of a full KV cache, in requests")
    a("--spill-margin", type=float, default=PickerConfig.spill_margin, help="a request leaves its affinity "
      "replica when that replica's queue is more than this many requests above the replicas' mean")
    a("--spill-kv-margin", type=float, default=PickerConfig.spill_kv_margin, help="... or its KV usage more "
      "than this share above their mean")
    a("--adapter-affinity", action=argparse.BooleanOptionalAction, default=True, help="send a LoRA adapter's "
      "requests to the replicas that list it (their /v1/models), those where it is loaded first")
    a("--models-interval", type=float, default=5.0, help="seconds between polls of each replica's /v1/models")
    a("--replica-slots", type=float, default=None, help="requests a replica runs at once (the daemons' "
      "--max-num-seqs): one more would queue there (default: learned from the scraped running/waiting)")
    a("--tokenize-threads", type=int, default=2, help="threads that encode long prompts off the event loop "
      "(0: all inline)")
    a("--tokenize-inline-chars", type=int, default=INLINE_CHARS, help="prompts shorter than this (characters, "
      "chat template applied) are encoded inline: the thread hand-off costs more")
    a("--tokenize-max-pending", type=int, default=None, help="long prompts queued or encoding on the threads "
      "at most; beyond that a prompt is not tokenized and routes on load alone, without delay "
      f"(default: {PENDING_PER_THREAD} per thread; 0: every long prompt)")
    a("--index-blocks", type=int, default=200_000, help="block hashes the prefix index remembers")
    a("--session-capacity", type=int, default=100_000)
    a("--scrape-interval", type=float, default=1.0)
    a("--scrape-timeout", type=float, default=1.0)
    a("--metrics-path", default="/metrics", help="the daemons' metrics path")
    a("--hold-max", type=int, default=256, help="requests held while no replica is ready")
    a("--hold-timeout", type=float, default=30.0, help="seconds a request is held before a 503")
    a("--connect-timeout", type=float, default=3.0)
    a("--retry-after", type=int, default=1, help="Retry-After seconds on the router's own 503/429")
    a("--log-level", default="info")
    return p


def settings_from_args(ns: argparse.Namespace) -> RouterSettings:
    session = None if ns.session in ("", "off") else ns.session
    if session is not None and session != "user" and not (session.startswith("header:") and len(session) > 7):
        raise ValueError(f"--session: expected off, user or header:<Name>, got {ns.session!r}")
    picker = PickerConfig(prefix=ns.prefix, load=ns.load, session=session is not None, load_cap=ns.load_cap,
                          kv_full=ns.kv_full, hash_blocks=ns.hash_blocks, queue_weight=ns.queue_weight,
                          kv_weight=ns.kv_weight, slots=ns.replica_slots, spill_margin=ns.spill_margin,
                          spill_kv_margin=ns.spill_kv_margin, adapter=ns.adapter_affinity)
    proxy = ProxyConfig(hold_max=ns.hold_max, hold_timeout=ns.hold_timeout, connect_timeout=ns.connect_timeout,
                        retry_after=ns.retry_after)
    if ns.tokenize_threads < 0 or ns.tokenize_inline_chars < 0:
        raise ValueError("--tokenize-threads and --tokenize-inline-chars must be >= 0")
    if ns.tokenize_max_pending is not None and ns.tokenize_max_pending < 0:
        raise ValueError("--tokenize-max-pending must be >= 0")
    if not ns.models_interval > 0:
        raise ValueError("--models-interval must be > 0")
    if not ns.endpoints and not ns.service:
        raise ValueError("give --endpoints (static) or --service (EndpointSlice discovery)")
    return RouterSettings(host=ns.host, port=ns.port, endpoints=ns.endpoints, service=ns.service,
                          namespace=ns.namespace, port_name=ns.port_name, tokenizer=ns.tokenizer,
                          block_size=ns.block_size, picker=picker, proxy=proxy, index_blocks=ns.index_blocks,
                          session_source=session, session_capacity=ns.session_capacity,
                          scrape_interval=ns.scrape_interval, scrape_timeout=ns.scrape_timeout,
                          metrics_path=ns.metrics_path, models_interval=ns.models_interval,
                          tokenize_threads=ns.tokenize_threads,
                          tokenize_inline_chars=ns.tokenize_inline_chars,
                          tokenize_max_pending=ns.tokenize_max_pending)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        settings = settings_from_args(ns)
    except ValueError as exc:
        parser.error(str(exc))
    from kvpilot.common.log_setup import setup_logging  # JSON log lines, as the daemon's

    setup_logging(ns.log_level)
    return asyncio.run(serve(settings))
