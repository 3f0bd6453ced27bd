"""The daemon's commands, `kvpilot serve` and `kvpilot generate`. The `kvpilot` script itself (kvpilot/cli.py)
hands them here; `python -m kvpilot.daemon.cli serve ...` runs them without it."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from kvpilot.version import __version__

from .args import add_serve_arguments, parse_size, resolve_serve_args
from .engine.config import DEFAULT_MODEL


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The daemon's `kvpilot` parser and its `serve` subparser (which resolves flags against KVPILOT_*
    variables)."""
    p = argparse.ArgumentParser(prog="kvpilot", description="Kubernetes-native LLM serving.")
    p.add_argument("--version", action="version", version=f"kvpilot {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the OpenAI-compatible daemon",
                           description="Serve a model over an OpenAI-compatible HTTP API. Every flag can also be "
                                       "set as an environment variable KVPILOT_<FLAG> (e.g. KVPILOT_PORT, "
                                       "KVPILOT_MAX_NUM_SEQS); flags win.")
    add_serve_arguments(serve)
    gen = sub.add_parser("generate", help="generate text once with the offline engine and print it")
    gen.add_argument("prompt", help="the prompt ('-' reads it from stdin)")
    gen.add_argument("--model", default=DEFAULT_MODEL)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--kv-cache-memory", type=parse_size, default=None)
    return p, serve


def generate(ns: argparse.Namespace) -> int:
    """`kvpilot generate`: one generation with the offline engine, printed."""
    from .engine.sampling_params import SamplingParams

    prompt = sys.stdin.read() if ns.prompt == "-" else ns.prompt
    try:
        params = SamplingParams(n=ns.n, max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                                top_k=ns.top_k, seed=ns.seed, stop=ns.stop)
    except ValueError as exc:
        print(f"kvpilot generate: {exc}", file=sys.stderr)
        return 2
    kwargs = {"dtype": ns.dtype}
    if ns.max_model_len is not None:
        kwargs["max_model_len"] = ns.max_model_len
    if ns.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = ns.kv_cache_memory
    from .engine import LLM  # torch and the model load only now

    llm = LLM(model=ns.model, **kwargs)
    try:
        if ns.chat:
            outputs = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
        else:
            outputs = llm.generate([prompt], params, use_tqdm=False)
    except ValueError as exc:
        print(f"kvpilot generate: {exc}", file=sys.stderr)
        return 2
    texts = [o.text for o in outputs[0].outputs]
    print("\n---\n".join(texts) if len(texts) > 1 else texts[0])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`serve ...` or `generate ...` (the command first, as `kvpilot` gives it)."""
    parser, serve_parser = build_parser()
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if ns.command is None:
        parser.print_help()
        return 2
    if ns.command == "generate":
        return generate(ns)
    args = resolve_serve_args(ns, serve_parser)
    from kvpilot.common.log_setup import setup_logging

    from .server import serve

    setup_logging(args.log_level)
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
