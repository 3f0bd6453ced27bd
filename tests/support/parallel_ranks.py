"""Running a model's ranks as real processes on the CPU: ``run_ranks`` spawns ``tp * pp`` processes that join
one gloo group, load their shard of each model folder through ``load_model(..., parallel=ctx)``, run the same
``SeqBatchEntry`` steps through a ``ModelRunner`` each (as the executor does), and hand back what the driver
(global rank 0) returned; ``run_single`` runs the same steps in this process, the reference. Several folders
share one group of processes: starting them is most of a run's time on a small machine."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvpilot.daemon.engine.runner import PipelineStats, PromptLogprobs, SeqBatchEntry

BLOCK = 16
NUM_BLOCKS = 24
MAX_LEN = 128


@dataclass
class StepResult:
    logits: torch.Tensor | None
    prompt_logprobs: dict[int, PromptLogprobs]


@dataclass
class RankRun:
    """What the driver got per step, and every rank's pipeline stats and what each returned."""

    steps: list[StepResult]
    stats: dict[int, PipelineStats] = field(default_factory=dict)
    returned_none: dict[int, bool] = field(default_factory=dict)  # rank -> every step's logits were None
    any_prompt_logprobs: dict[int, bool] = field(default_factory=dict)  # rank -> some step left prompt logprobs


def engine_config(folder: Path) -> Any:
    """The engine settings every rank and the reference run with: float32, one thread, a small fixed cache."""
    from kvpilot.daemon.engine.config import EngineConfig

    return EngineConfig(model=str(folder), dtype="float32", device="cpu", num_threads=1, block_size=BLOCK,
                        num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_LEN, populate_kv=False)


def _run_steps(runner: Any, steps: list[list[SeqBatchEntry]]) -> list[StepResult]:
    out = []
    for entries in steps:
        logits = runner.execute(entries)
        out.append(StepResult(None if logits is None else logits.clone(), dict(runner.last_prompt_logprobs)))
    return out


def run_single(folder: Path, steps: list[list[SeqBatchEntry]]) -> list[StepResult]:
    """The steps in this process, on one rank: the reference."""
    from kvpilot.daemon.engine.loader import load_model
    from kvpilot.daemon.engine.runner import ModelRunner

    config = engine_config(folder)
    runner = ModelRunner(config, load_model(config))
    runner.init_kv_cache(NUM_BLOCKS)
    return _run_steps(runner, steps)


def _rank_main(rank: int, tp: int, pp: int, port: int, folders: list[str], steps: list[list[SeqBatchEntry]],
               micro_batches: int | None, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        from kvpilot.daemon.engine.executor.distributed import init_parallel, shutdown_parallel
        from kvpilot.daemon.engine.loader import load_model
        from kvpilot.daemon.engine.runner import ModelRunner

        ctx = init_parallel(tp_size=tp, pp_size=pp, rank=rank, init_method=f"tcp://127.0.0.1:{port}",
                            device=torch.device("cpu"), timeout_s=60)
        runs = []
        try:
            for folder in folders:
                config = engine_config(Path(folder))
                runner = ModelRunner(config, load_model(config, parallel=ctx))
                if micro_batches is not None:
                    runner.micro_batches = micro_batches
                runner.init_kv_cache(NUM_BLOCKS)
                done = _run_steps(runner, steps)
                if not ctx.is_driver:  # only whether it returned logits: no need to ship them back
                    done = [StepResult(None if s.logits is None else torch.empty(0), s.prompt_logprobs)
                            for s in done]
                runs.append((done, runner.pipeline_stats))
        finally:
            shutdown_parallel()
        results.put((rank, None, runs))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with it
        results.put((rank, traceback.format_exc(), None))


def run_ranks(folders: list[Path], steps: list[list[SeqBatchEntry]], *, tp: int, pp: int = 1,
              micro_batches: int | None = None, timeout_s: float = 120.0) -> list[RankRun]:
    """The steps on ``tp * pp`` spawned ranks, for each folder in turn; per folder, the driver's results. A
    rank that fails or hangs fails the call (the others are killed after ``timeout_s``)."""
    from kvpilot.daemon.engine.executor.distributed import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    world = tp * pp
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, tp, pp, port, [str(f) for f in folders], steps, micro_batches, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, list[tuple[list[StepResult], PipelineStats]]] = {}
    try:
        while len(got) < world:
            try:
                rank, error, runs = results.get(timeout=timeout_s)
            except queue_mod.Empty:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(got))} gave no result in {timeout_s}s") \
                    from None
            if error is not None:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            got[rank] = runs
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    out = []
    for i in range(len(folders)):
        run = RankRun(steps=got[0][i][0])
        for rank, runs in got.items():
            done, run.stats[rank] = runs[i]
            run.returned_none[rank] = all(s.logits is None for s in done)
            run.any_prompt_logprobs[rank] = any(s.prompt_logprobs for s in done)
        out.append(run)
    return out
