"""Tensor and pipeline parallelism on the CPU: the 96-request workload of bench/peers.py on one process of
2 threads, against tensor parallel 2 and pipeline parallel 2 with one thread per rank, on the same 2 cores.

SmolLM2-135M's 9 query / 3 KV heads do not split over 2 ranks, so the default model is its converted weights
under a config of 6 / 2 heads of 96 (the same projections, FLOPs and KV bytes; the text is meaningless,
which greedy decoding with EOS ignored does not mind). ``--model builtin://gemma3-270m`` splits as it is.

Each configuration runs in a fresh process (its ranks are processes it spawns), alternating single / tp2 /
pp2 for ``--repeats`` rounds so that drift on this shared machine hits them alike, each warm
(``peers.warm_up_kvpilot``) before its timed run. Greedy, EOS ignored: every run computes the same tokens.
Float32 on dequantized weights by default: the setting of the peers benchmark, and one where a rank's
share of a GEMM runs the same kernels as the whole (``--dtype``; ``--quantization gguf`` with a GGUF --model).

Besides tokens/s and the ratio to the single process:
- tp2: the time every rank spends in the tensor-parallel collectives (all-reduce, all-gather, the logits'
  gather) against its ``ModelRunner.execute`` time. Every rank records its calls (the ranks are spawned
  processes: a ``sitecustomize`` on their PYTHONPATH installs the same timers there, no engine file
  changes); matching the k-th collective across ranks splits it into the transfer (the faster side's time,
  where the other had already arrived) and the wait for the slower rank.
- pp2: each rank's ``pipeline_stats()`` over the timed run (computing against waiting: the bubble) and the
  micro-batches per step.
- every process's threads that burned CPU during the timed run (a rank using more threads than intended).

Usage: python bench/parallel.py [--repeats 2] [--threads 2] [--configs single,tp2,pp2] [--model URI]
       [--dtype float32|bfloat16] [--quantization none|gguf] [--quick]
Writes bench/results/parallel.json (--quick: 24 requests, 1 round, parallel_quick.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from host import cpu_name  # noqa: E402
from peers import make_workload, warm_up_kvpilot  # noqa: E402

MODEL = "builtin://smollm2-135m"
# SmolLM2-135M's 9 query and 3 KV heads do not divide by 2: the default runs its weights (dequantized) with the
# same 576-wide attention cut into 6 heads of 96 (2 KV heads): the same GEMMs, FLOPs and KV bytes, split by 2
REHEADED = "smollm2-135m-6x96"
CONFIGS: dict[str, tuple[int, int]] = {"single": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}  # (tensor, pipeline)
TRACE_ENV = "KVPILOT_BENCH_TRACE_DIR"
# imported by every Python process started with this folder on PYTHONPATH; only the spawned ranks
# (multiprocessing's "--multiprocessing-fork" children) install the timers
SITECUSTOMIZE = f"""\
import os, sys
if os.environ.get({TRACE_ENV!r}) and "--multiprocessing-fork" in sys.argv:
    sys.path.insert(0, {str(REPO / "bench")!r})
    import parallel
    parallel.install_trace(os.environ[{TRACE_ENV!r}])
"""


def reheaded_model(folder: Path) -> Path:
    """SmolLM2-135M's converted checkpoint (links to its files) under a config of 6 query and 2 KV heads of
    96: the projections keep their shapes, only the attention's head split changes."""
    from kvpilot.common.model_source import resolve_model_path

    source = resolve_model_path(MODEL)
    cfg = json.loads((source / "config.json").read_text())
    width, kv_width = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    cfg.update(num_attention_heads=6, num_key_value_heads=2, head_dim=96)
    assert (width, kv_width) == (6 * 96, 2 * 96), (width, kv_width)
    folder.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json" and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


# ---------------------------------------------------------------------------- per-rank timers


def install_trace(out_dir: str) -> None:
    """Time every tensor-parallel collective and ``ModelRunner.execute`` in this process, as (start, seconds)
    on the system-wide monotonic clock; the records go to ``out_dir/rank<N>.json`` whenever the driver asks
    the ranks for ``pipeline_stats`` (a worker rank leaves by ``os._exit``: no exit hook would run)."""
    from kvpilot.daemon.engine.executor.rank_ops import RankOps
    from kvpilot.daemon.engine.models.parallel import ParallelContext
    from kvpilot.daemon.engine.runner import ModelRunner

    coll: list[tuple[float, float]] = []
    execs: list[tuple[float, float]] = []

    def timed(fn: Any, into: list[tuple[float, float]]) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into.append((t0, time.perf_counter() - t0))
        return wrapper

    for name in ("all_reduce", "all_gather", "gather_to_first"):
        setattr(ParallelContext, name, timed(getattr(ParallelContext, name), coll))
    ModelRunner.execute = timed(ModelRunner.execute, execs)
    apply = RankOps.apply

    def apply_and_dump(self: Any, message: tuple[Any, ...]) -> Any:
        if message[0] == "pipeline_stats":
            path = Path(out_dir) / f"rank{self.parallel.rank}.json"
            path.write_text(json.dumps({"pid": os.getpid(), "collectives": coll, "execute": execs}))
        return apply(self, message)

    RankOps.apply = apply_and_dump


def collective_share(trace_dir: Path, window: tuple[float, float], wall_s: float) -> dict[str, Any]:
    """The ranks' collective time against their execute time over the timed run ``window``."""
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(trace_dir.glob("rank*.json"))}
    t0, t1 = window

    def inside(records: list[list[float]]) -> list[float]:
        return [dt for start, dt in records if t0 <= start <= t1]

    out: dict[str, Any] = {"ranks": {}}
    for rank, rec in sorted(ranks.items()):
        coll, execs = inside(rec["collectives"]), inside(rec["execute"])
        out["ranks"][rank] = {"collective_s": sum(coll), "collective_calls": len(coll), "execute_s": sum(execs),
                              "steps": len(execs), "share_of_execute": sum(coll) / sum(execs) if execs else None,
                              "share_of_wall": sum(coll) / wall_s}
    lists = [ranks[r]["collectives"] for r in sorted(ranks)]
    if len(lists) > 1 and len({len(x) for x in lists}) == 1:  # every rank makes the same collectives in order
        pairs = [calls for calls in zip(*lists, strict=True) if t0 <= calls[0][0] <= t1]
        transfer = sum(min(dt for _, dt in calls) for calls in pairs)
        out["transfer_s"] = transfer  # the call on the rank that came last: the exchange itself
        for rank in out["ranks"].values():
            rank["waiting_for_other_rank_s"] = rank["collective_s"] - transfer
        out["transfer_share_of_execute_rank0"] = transfer / out["ranks"][0]["execute_s"]
    else:
        out["unmatched"] = [len(x) for x in lists]
    return out


# ---------------------------------------------------------------------------- threads


def thread_cpu(pids: list[int]) -> dict[str, tuple[str, float]]:
    """CPU seconds so far of every thread of ``pids``: "pid/tid" -> (thread name, seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[str, float]] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            out[f"{pid}/{tid}"] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    return out


def busy_threads(before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]], wall_s: float,
                 pids: dict[int, str]) -> dict[str, Any]:
    """Per process: its CPU seconds over the run, and the threads busy more than 5% of it."""
    out: dict[str, Any] = {}
    for pid, label in pids.items():
        threads = [(after[k][0], after[k][1] - before.get(k, ("", 0.0))[1]) for k in after
                   if k.startswith(f"{pid}/")]
        busy = sorted(((name, round(s, 2)) for name, s in threads if s > 0.05 * wall_s), key=lambda x: -x[1])
        out[label] = {"pid": pid, "cpu_s": round(sum(s for _, s in threads), 2), "threads": len(threads),
                      "busy_threads": busy}
    return out


def wait_until_idle(pids: list[int], limit_s: float = 30.0) -> float:
    """Seconds until ``pids`` burn under 0.05 CPU s per 0.5 s: the worker ranks' KV caches map in on a
    background thread the driver's ``wait_for_kv_cache_mapped`` does not wait for."""
    t0 = time.perf_counter()
    prev = sum(s for _, s in thread_cpu(pids).values())
    while time.perf_counter() - t0 < limit_s:
        time.sleep(0.5)
        now = sum(s for _, s in thread_cpu(pids).values())
        if now - prev < 0.05:
            break
        prev = now
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- one run


def child(config: str, args: argparse.Namespace, trace_dir: Path | None) -> dict[str, Any]:
    """One timed run of ``config`` in this fresh process."""
    import multiprocessing

    import torch

    tp, pp = CONFIGS[config]
    per_rank = max(1, args.threads // (tp * pp))
    torch.set_num_threads(per_rank)
    if trace_dir is not None:
        install_trace(str(trace_dir))  # the driver's rank; the workers install theirs in sitecustomize

    from kvpilot.daemon.engine import LLM, SamplingParams

    work = make_workload("w96")[: args.requests]
    t0 = time.perf_counter()
    llm = LLM(args.model_path, dtype=args.dtype, quantization=args.quantization, max_num_seqs=256,
              max_num_batched_tokens=2048, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=per_rank)
    start_s = time.perf_counter() - t0
    try:
        kv_mapped_wait_s = warm_up_kvpilot(llm, work[0][0])
        workers = {p.pid: p.name for p in multiprocessing.active_children()}
        idle_wait_s = wait_until_idle(list(workers))
        runner = llm.engine.runner
        stats_before = runner.pipeline_stats() if pp > 1 else None
        pids = {os.getpid(): "driver", **{pid: name for pid, name in workers.items()}}
        cpu_before = thread_cpu(list(pids))
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
        t_start = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
        t_end = time.perf_counter()
        sec = t_end - t_start
        cpu_after = thread_cpu(list(pids))
        tok = sum(len(r.outputs[0].token_ids) for r in res)
        out: dict[str, Any] = {
            "seconds": sec, "output_tokens": tok, "output_tokens_per_s": tok / sec, "start_s": start_s,
            "kv_mapped_wait_s": kv_mapped_wait_s, "worker_idle_wait_s": idle_wait_s, "threads_per_rank": per_rank,
            "torch_threads_driver": torch.get_num_threads(),
            "threads": busy_threads(cpu_before, cpu_after, sec, pids),
            "output_digests": [hashlib.sha1(str(list(r.outputs[0].token_ids)).encode()).hexdigest()[:12]
                               for r in res],
            "weight_bytes": llm.engine.loaded.weight_bytes,
        }
        if tp * pp > 1:
            out["rank_weight_bytes"] = runner.rank_weight_bytes
            stats_after = runner.pipeline_stats()  # also has every rank write its trace
            if trace_dir is not None:
                out["collectives"] = collective_share(trace_dir, (t_start, t_end), sec)
            if stats_before is not None:
                out["pipeline"] = pipeline_delta(stats_before, stats_after, runner.runner.micro_batches)
        return out
    finally:
        llm.engine.shutdown()


def pipeline_delta(before: list[Any], after: list[Any], micro_batches: int) -> dict[str, Any]:
    """Each rank's pipeline time over the timed run (``after`` - ``before``, both cumulative)."""
    ranks = {}
    for rank, (b, a) in enumerate(zip(before, after, strict=True)):
        compute, recv, send = a.compute_s - b.compute_s, a.recv_wait_s - b.recv_wait_s, a.send_wait_s - b.send_wait_s
        steps, mbs = a.steps - b.steps, a.micro_batches - b.micro_batches
        total = compute + recv + send
        ranks[rank] = {"compute_s": compute, "recv_wait_s": recv, "send_wait_s": send, "steps": steps,
                       "micro_batches": mbs, "micro_batches_per_step": mbs / steps if steps else None,
                       "bubble": (recv + send) / total if total else 0.0}
    return {"micro_batches_setting": micro_batches, "ranks": ranks}


# ---------------------------------------------------------------------------- the rounds


def run_child(config: str, args: argparse.Namespace, site_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", config, "--model-path", args.model_path, "--threads", str(args.threads), "--dtype", args.dtype,
           "--quantization", args.quantization, "--requests", str(args.requests)]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="kvpilot-trace-") as trace:
        if config == "tp2":
            cmd += ["--trace-dir", trace]
            env[TRACE_ENV] = trace
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site_dir), env.get("PYTHONPATH")]))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{config} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rate = {k: statistics.median(r["output_tokens_per_s"] for r in v) for k, v in runs.items() if v}
    out: dict[str, Any] = {"median_output_tokens_per_s": rate,
                           "median_seconds": {k: statistics.median(r["seconds"] for r in v)
                                              for k, v in runs.items() if v}}
    single = runs.get("single", [])
    for config in ("tp2", "pp2"):
        if single and runs.get(config):
            out[f"{config}_vs_single"] = rate[config] / rate["single"]
            # the same round's runs, side by side in time
            out[f"{config}_vs_single_per_round"] = [b["output_tokens_per_s"] / a["output_tokens_per_s"]
                                                    for a, b in zip(single, runs[config], strict=False)]
            ref = single[0]["output_digests"]
            out[f"{config}_outputs_identical_to_single"] = statistics.mean(
                x == y for x, y in zip(ref, runs[config][0]["output_digests"], strict=True))
    if runs.get("tp2"):
        share = [r["collectives"]["ranks"] for r in runs["tp2"] if "collectives" in r]
        out["tp2_collective_share_of_execute"] = {
            rank: statistics.median(s[rank]["share_of_execute"] for s in share) for rank in share[0]} if share else None
        transfer = [r["collectives"].get("transfer_share_of_execute_rank0") for r in runs["tp2"]]
        if all(t is not None for t in transfer):
            out["tp2_transfer_share_of_execute"] = statistics.median(transfer)
    if runs.get("pp2"):
        ranks = [r["pipeline"]["ranks"] for r in runs["pp2"]]
        out["pp2_bubble"] = {rank: statistics.median(s[rank]["bubble"] for s in ranks) for rank in ranks[0]}
        out["pp2_micro_batches_per_step"] = ranks[0][next(iter(ranks[0]))]["micro_batches_per_step"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="the single process's threads, split over the ranks")
    ap.add_argument("--configs", default="single,tp2,pp2")
    ap.add_argument("--model", default=REHEADED,
                    help=f"{REHEADED} (SmolLM2-135M re-headed to split by 2), or a model URI (builtin://gemma3-270m "
                         "splits by 2 as it is)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--quantization", default="none", choices=("none", "gguf"),
                    help="none: weights dequantized at load; gguf: the model's own Q4_1 blocks")
    ap.add_argument("--requests", type=int, default=96, help="the first N requests of the w96 workload")
    ap.add_argument("--quick", action="store_true", help="24 requests, 1 round, parallel_quick.json")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", choices=tuple(CONFIGS), help=argparse.SUPPRESS)
    ap.add_argument("--trace-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args, args.trace_dir)))
        return
    if args.quick:
        args.requests, args.repeats = 24, 1
    if args.model == REHEADED and args.quantization != "none":
        ap.error(f"{REHEADED} runs the converted float weights: --quantization none only")
    out = args.out or REPO / "bench/results" / ("parallel_quick.json" if args.quick else "parallel.json")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}; choose from {list(CONFIGS)}")

    import torch

    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvpilot-site-") as site:
        (Path(site) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        args.model_path = str(reheaded_model(Path(site) / REHEADED)) if args.model == REHEADED else args.model
        for i in range(args.repeats):  # alternating, so drift hits every configuration alike
            for config in configs:
                runs[config].append(run_child(config, args, Path(site)))
                r = runs[config][-1]
                print(f"round {i + 1} {config}: {r['output_tokens_per_s']:.1f} tok/s ({r['seconds']:.1f} s)",
                      flush=True)
    summary = summarize(runs)
    for v in runs.values():
        for r in v:  # compared in summarize, not kept
            del r["output_digests"]
    result = {
        "model": args.model, "dtype": args.dtype, "quantization": args.quantization, "workload": "w96",
        "requests": args.requests, "repeats": args.repeats, "threads": args.threads,
        "configs": {c: {"tensor_parallel_size": CONFIGS[c][0], "pipeline_parallel_size": CONFIGS[c][1],
                        "num_threads_per_rank": max(1, args.threads // (CONFIGS[c][0] * CONFIGS[c][1]))}
                    for c in configs},
        "host": {"cpu": cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version(), "torch": torch.__version__,
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "bench_wall_s": time.perf_counter() - t0,
        **summary, "runs": runs,
        "command": "python bench/parallel.py " + " ".join(sys.argv[1:]),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "configs")}, indent=2))


if __name__ == "__main__":
    main()
