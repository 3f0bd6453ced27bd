"""ModelRunner: owns the paged KV cache and turns a list of sequences into one flattened forward pass.

``execute`` takes one ``SeqBatchEntry`` per scheduled sequence (decodes: one token; prefill chunks:
several), builds the varlen batch tensors with numpy (no per-token Python), runs the model and
returns float32 logits for the entries that need sampling.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvpilot.kernels import ops as kernels

from . import cuda_graphs, host_malloc
from .config import EngineConfig
from .loader import LoadedModel
from .lora.request import LoRARequest
from .models import AttentionMetadata, LoRABatch, OutputRows

if TYPE_CHECKING:
    from .lora.manager import LoRAManager

logger = logging.getLogger(__name__)

GiB = 1 << 30
_DEFAULT_CPU_KV_BYTES = 1 * GiB
_KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of ``EngineConfig.kv_cache_dtype``; "auto" is the model's dtype."""
    if name == "auto":
        return model_dtype
    if name not in _KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {sorted(_KV_CACHE_DTYPES)}, got {name!r}")
    return _KV_CACHE_DTYPES[name]


def gpu_kv_budget(*, free: int, total: int, gpu_memory_utilization: float, reserved: int,
                  kv_cache_memory: int | None) -> tuple[int, str]:
    """KV-cache bytes on a GPU with ``free`` of ``total`` bytes free (weights already loaded), and the
    setting that bounds them: what ``gpu_memory_utilization`` of the device leaves after the memory in
    use (our weights, other processes, the CUDA context) and ``reserved`` (the activation peak), capped
    by ``kv_cache_memory`` when it is set. The cap only lowers the budget: it never claims memory the
    utilization fraction does not leave, so two engines can share a GPU by fraction or by bytes."""
    left = max(0, int(total * gpu_memory_utilization) - (total - free) - reserved)
    fraction = f"gpu_memory_utilization={gpu_memory_utilization}"
    if kv_cache_memory is not None and kv_cache_memory < left:
        return kv_cache_memory, f"kv_cache_memory={kv_cache_memory}, under the {left} bytes {fraction} leaves"
    if kv_cache_memory is not None:
        return left, f"{fraction}, under kv_cache_memory={kv_cache_memory}"
    return left, fraction


@dataclass
class SeqBatchEntry:
    token_ids: list[int]  # the tokens to compute this step (decode: 1 token; prefill chunk: several)
    start_pos: int  # absolute position of token_ids[0] (== tokens of this seq already in the KV cache)
    block_table: list[int]  # the sequence's KV block ids, covering at least start_pos + len(token_ids) slots
    compute_logits: bool  # True when the last token of this chunk needs sampling
    # with compute_logits, logits for this many positions at the chunk's end: 1 + its drafts for a
    # sequence verifying drafts (each draft and the token after the last one are sampled)
    num_logits: int = 1
    # prompt logprobs: the prompt token that follows each of the chunk's first len(...) positions;
    # the runner scores them (see ModelRunner.last_prompt_logprobs)
    prompt_targets: list[int] | None = None
    prompt_top_k: int = 0
    lora_request: LoRARequest | None = None  # the entry's adapter (None: the base model)


@dataclass
class PromptLogprobs:
    """Raw-logit log-probabilities of one entry's prompt targets (vLLM scores prompts before any
    sampling processing), plus each position's top_k alternatives."""

    logprobs: list[float]
    ranks: list[int]  # 1-based rank of each target
    top: list[list[tuple[int, float]]]


@dataclass
class PipelineStats:
    """One rank's cumulative pipeline time (``ModelRunner.pipeline_stats``): seconds computing (its layers,
    and the logits on the last stage) against seconds blocked in the transfers between stages, the bubble."""

    compute_s: float = 0.0
    recv_wait_s: float = 0.0  # waiting for the previous stage's hidden states (the results, on the driver)
    send_wait_s: float = 0.0  # waiting for the next stage to take ours
    steps: int = 0
    micro_batches: int = 0

    @property
    def bubble(self) -> float:
        """The share of this rank's pipeline time spent waiting."""
        total = self.compute_s + self.recv_wait_s + self.send_wait_s
        return (self.recv_wait_s + self.send_wait_s) / total if total else 0.0


_PROMPT_LOGPROB_ROWS = 256  # rows of full-vocabulary logits at a time: bounds the memory a long prompt needs


def _cgroup_cpu_limit() -> int | None:
    """CPUs allowed by the cgroup v2 quota (a pod's CPU limit), rounded up; None when unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, -(-int(quota) // int(period)))


def cpu_threads(num_threads: int | None = None) -> int:
    """Intra-op threads: ``num_threads`` (the engine's), else OMP_NUM_THREADS, else the CPUs this process
    may use (affinity, capped by a cgroup CPU limit; torch's own default counts physical cores only)."""
    if num_threads is not None:
        return num_threads
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) >= 1:
        return int(value)
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    return min(n, limit) if limit else n


def _configure_cpu_threads(num_threads: int | None) -> None:
    """With OpenMP the setting belongs to the calling thread, so the runner applies it in whichever
    thread runs the model."""
    n = cpu_threads(num_threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        # what the caches store; the kernels convert on write and cast to the model's dtype on read
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size
        self.parallel = loaded.parallel
        # this rank's share: the layers of its pipeline stage, the KV heads of its tensor rank
        self.num_layers: int = getattr(self.model, "num_local_layers", self.model.num_layers)
        self.num_kv_heads: int = getattr(self.model, "num_local_kv_heads", self.model.num_kv_heads)
        self.head_dim: int = self.model.head_dim
        self.vocab_size: int = self.model.vocab_size
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.cpu_k_caches: list[torch.Tensor] = []
        self.cpu_v_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.num_cpu_blocks = 0
        self._threads_set_for: int | None = None  # thread whose intra-op pool we sized
        self._graphs: cuda_graphs.DecodeGraphs | None = None  # CUDA only, built by warmup()
        self.warmed_up = False
        self.kv_population: host_malloc.PagePopulation | None = None  # maps the CPU KV cache in (init_kv_cache)
        self.last_prompt_logprobs: dict[int, PromptLogprobs] = {}  # of the latest execute()
        self.lora: LoRAManager | None = None  # the adapters' slots, set by the engine with enable_lora
        # pipeline parallelism: a step's entries go through the stages in this many micro-batches (at most
        # one per entry), and the time each rank computed and waited
        self.micro_batches = self.parallel.pp_size
        self.pipeline_stats = PipelineStats()
        self._ensure_threads()

    def enable_lora(self) -> None:
        """Adapter slots in the model's linear layers (this rank's part of each), and the manager of them."""
        from .lora.manager import LoRAManager

        self.lora = LoRAManager(self.config, self.model, dtype=self.dtype, device=self.device)

    def _ensure_threads(self) -> None:
        if self.device.type == "cpu" and self._threads_set_for != threading.get_ident():
            _configure_cpu_threads(self.config.num_threads)
            self._threads_set_for = threading.get_ident()

    # ------------------------------------------------------------------ memory

    @property
    def kv_bytes_per_block(self) -> int:
        """K and V of one block across this rank's layers and KV heads, in the KV cache dtype."""
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in itertools.chain(self.model.parameters(), self.model.buffers()):
            # tensors sharing memory (an unpacked tied LM head is the embedding table) count once;
            # a packed oneDNN tensor has no strided storage to compare
            key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total

    def num_blocks_for_budget(self) -> int:
        """KV blocks that fit the memory budget (or ``config.num_kv_blocks``); logs the budget."""
        per_block = self.kv_bytes_per_block
        if self.config.num_kv_blocks is not None:
            num_blocks, source = self.config.num_kv_blocks, "num_kv_blocks"
        elif self.device.type == "cuda":
            budget, source = self._cuda_kv_budget()
            num_blocks = budget // per_block
        else:
            budget = self.config.kv_cache_memory or _DEFAULT_CPU_KV_BYTES
            num_blocks, source = budget // per_block, f"kv_cache_memory={budget}"
        num_blocks = int(num_blocks)
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({source}) holds no block of {per_block} bytes; give the cache more memory"
            )
        blocks_per_seq = -(-self.loaded.max_model_len // self.block_size)
        p = self.parallel
        logger.info(
            "%smemory budget (%s): weights %.1f MiB, KV cache %s (%s model), %d bytes/block (%d tokens), "
            "%d blocks = %.1f MiB (%d tokens), max %d concurrent seqs at max_model_len=%d",
            f"rank {p.rank} (tp {p.tp_rank}/{p.tp_size}, pp {p.pp_rank}/{p.pp_size}) " if p.world_size > 1 else "",
            source,
            self.weight_bytes / 2**20,
            str(self.kv_dtype).removeprefix("torch."),
            str(self.dtype).removeprefix("torch."),
            per_block,
            self.block_size,
            num_blocks,
            num_blocks * per_block / 2**20,
            num_blocks * self.block_size,
            num_blocks // blocks_per_seq,
            self.loaded.max_model_len,
        )
        return num_blocks

    def _cuda_kv_budget(self) -> tuple[int, str]:
        """KV-cache bytes on this GPU and what bounds them: see ``gpu_kv_budget``."""
        free, total = torch.cuda.mem_get_info(self.device)
        cfg = self.config
        hidden = self.model.hidden_size
        elem = torch.empty((), dtype=self.dtype).element_size()
        inter = self._local_inter(elem)
        tokens = cfg.max_num_batched_tokens
        # live at once in one layer: residual, normed input, qkv, attention out, gate_up, activation
        act = tokens * (4 * hidden + 3 * hidden + 3 * inter) * elem
        logits = min(cfg.max_num_seqs, tokens) * self.vocab_size * (4 + elem) * 2
        return gpu_kv_budget(free=free, total=total, gpu_memory_utilization=cfg.gpu_memory_utilization,
                             reserved=act + logits, kv_cache_memory=cfg.kv_cache_memory)

    def _local_inter(self, elem: int) -> int:
        """This rank's widest MLP intermediate per row: its slice of a dense layer's, top_k experts' slices
        for a MoE layer."""
        layers = getattr(self.model, "layers", None)
        if layers is None:
            return int(self.model.config.intermediate_size)
        return max((layer.moe.row_bytes(elem) // (2 * elem) if getattr(layer, "moe", None) is not None
                    else layer.local_inter for layer in layers), default=0)

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """Allocate per-layer K and V ``[num_blocks, block_size, kv_heads, head_dim]`` in the KV cache dtype
        (+ a CPU pool for swap, same dtype: swapping copies blocks as they are)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k_caches = [self._zeros(shape) for _ in range(self.num_layers)]
        self.v_caches = [self._zeros(shape) for _ in range(self.num_layers)]
        self.num_blocks = num_blocks
        self.cpu_k_caches, self.cpu_v_caches = [], []
        if num_cpu_blocks > 0:
            cpu_shape = (num_cpu_blocks, *shape[1:])
            pin = self.device.type == "cuda"
            self.cpu_k_caches = [
                torch.zeros(cpu_shape, dtype=self.kv_dtype, pin_memory=pin) for _ in range(self.num_layers)
            ]
            self.cpu_v_caches = [
                torch.zeros(cpu_shape, dtype=self.kv_dtype, pin_memory=pin) for _ in range(self.num_layers)
            ]
        self.num_cpu_blocks = num_cpu_blocks
        self.model.bind_kv_caches(self.k_caches, self.v_caches)
        if self.device.type == "cpu":
            # after the caches, so that they are fresh zero pages (see _zeros)
            host_malloc.keep_freed_memory(self.config.malloc_tuning)
            self.kv_population = host_malloc.PagePopulation.start(
                [(t.data_ptr(), t.numel() * t.element_size()) for t in self.k_caches + self.v_caches],
                enabled=self.config.populate_kv)

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed cache tensor. On the CPU through calloc: under glibc's default mmap threshold a large
        block is fresh zero pages, where torch.zeros would write the whole KV budget at start (0.4 s per
        GiB, 2-4 s on a VM with fresh memory); init_kv_cache maps them in on a background thread
        (host_malloc.PagePopulation)."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        raw = np.zeros((*shape[:-1], shape[-1] * elem), dtype=np.uint8)
        return torch.from_numpy(raw).view(self.kv_dtype)

    # ------------------------------------------------------------------ block moves

    def _pairs(self, pairs: list[tuple[int, int]]) -> torch.Tensor:
        return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src → dst in every layer."""
        if pairs:
            kernels.copy_blocks(self.k_caches, self.v_caches, self._pairs(pairs).to(self.device))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block → CPU block, every layer."""
        self._swap("swap_out", pairs, (self.k_caches, self.v_caches), (self.cpu_k_caches, self.cpu_v_caches))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """CPU block → device block, every layer."""
        swapped = self._swap("swap_in", pairs, (self.cpu_k_caches, self.cpu_v_caches), (self.k_caches, self.v_caches))
        if swapped and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _swap(self, what: str, pairs: list[tuple[int, int]], src: tuple[list[torch.Tensor], list[torch.Tensor]],
              dst: tuple[list[torch.Tensor], list[torch.Tensor]]) -> bool:
        """Copy blocks src → dst ((k, v) caches per layer) in every layer; False when there was nothing to do."""
        if not pairs:
            return False
        if not self.cpu_k_caches:
            raise RuntimeError(f"{what} needs a CPU block pool: init_kv_cache(..., num_cpu_blocks > 0)")
        m = self._pairs(pairs)
        for l in range(self.num_layers):  # noqa: E741
            kernels.swap_blocks(src[0][l], dst[0][l], m)
            kernels.swap_blocks(src[1][l], dst[1][l], m)
        return True

    # ------------------------------------------------------------------ forward

    def _prepare(
        self, entries: list[SeqBatchEntry]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray, OutputRows | None, LoRABatch | None]:
        """Flatten the batch: ids, positions, metadata, the rows whose logits are wanted and, where those
        are not all the rows and no entry scores its prompt (which needs every row), them as ``OutputRows``
        for the model's last layer; and the rows' adapters when any entry has one."""
        n = len(entries)
        bs = self.block_size
        q_lens = np.fromiter((len(e.token_ids) for e in entries), dtype=np.int64, count=n)
        starts = np.fromiter((e.start_pos for e in entries), dtype=np.int64, count=n)
        if (q_lens < 1).any() or (starts < 0).any():
            raise ValueError("every entry needs at least one token and start_pos >= 0")
        total = int(q_lens.sum())
        ids = np.fromiter(itertools.chain.from_iterable(e.token_ids for e in entries), dtype=np.int64, count=total)
        if ids.min() < 0 or ids.max() >= self.vocab_size:  # on CUDA a bad id is an unrecoverable device assert
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        ctx = starts + q_lens
        max_ctx = int(ctx.max())
        if max_ctx > self.loaded.max_model_len:
            raise ValueError(f"a sequence reaches {max_ctx} tokens, more than max_model_len={self.loaded.max_model_len}")

        # positions: start_pos of the token's sequence + its offset within the chunk
        seq_of_tok = np.repeat(np.arange(n), q_lens)
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts - qsl[:-1], q_lens)

        # block tables, padded with 0: scatter the concatenated tables through a row-major mask
        bt_lens = np.fromiter((len(e.block_table) for e in entries), dtype=np.int64, count=n)
        need = (ctx + bs - 1) // bs
        if (bt_lens < need).any():
            i = int(np.argmax(bt_lens < need))
            raise ValueError(f"entry {i}: block_table has {bt_lens[i]} blocks, needs {need[i]} for {ctx[i]} tokens")
        width = int(bt_lens.max())
        flat = np.fromiter(
            itertools.chain.from_iterable(e.block_table for e in entries), dtype=np.int64, count=int(bt_lens.sum())
        )
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks})")
        table = np.zeros((n, width), dtype=np.int64)
        table[np.arange(width)[None, :] < bt_lens[:, None]] = flat
        slots = table[seq_of_tok, positions // bs] * bs + positions % bs
        block_tables = np.ascontiguousarray(table[:, : int(need.max())], dtype=np.int32)

        want = np.fromiter((e.compute_logits for e in entries), dtype=bool, count=n)
        logit_rows, row_entry = self._logit_rows(entries, want, qsl, q_lens)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(block_tables).to(dev, non_blocking=True),
            context_lens=torch.from_numpy(ctx.astype(np.int32)).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev, non_blocking=True),
            max_query_len=int(q_lens.max()),
            max_context_len=max_ctx,
        )
        input_ids = torch.from_numpy(ids).to(dev, non_blocking=True)
        pos = torch.from_numpy(positions).to(dev, non_blocking=True)
        output_rows = None
        if logit_rows.size < total and not any(e.prompt_targets for e in entries):
            # each row attends as a one-token query over its own causal context: a verified draft row
            # sees the tokens up to itself, the last row of a chunk the whole context
            ctx_out = positions[logit_rows] + 1
            output_rows = OutputRows(
                rows=torch.from_numpy(logit_rows).to(dev, non_blocking=True),
                meta=AttentionMetadata(
                    slot_mapping=torch.from_numpy(slots[logit_rows]).to(dev, non_blocking=True),
                    block_tables=torch.from_numpy(np.ascontiguousarray(block_tables[row_entry])).to(
                        dev, non_blocking=True),
                    context_lens=torch.from_numpy(ctx_out.astype(np.int32)).to(dev, non_blocking=True),
                    query_start_loc=torch.arange(ctx_out.size + 1, dtype=torch.int32, device=dev),
                    max_query_len=1,
                    max_context_len=int(ctx_out.max()) if ctx_out.size else 1,
                ),
            )
        lora = None
        if self.lora is not None:
            lora = self.lora.batch([e.lora_request for e in entries], q_lens,
                                   None if output_rows is None else row_entry)
        return input_ids, pos, meta, logit_rows, output_rows, lora

    @staticmethod
    def _logit_rows(entries: list[SeqBatchEntry], want: np.ndarray, qsl: np.ndarray,
                    q_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows whose logits are returned, in order (each wanted entry's last ``num_logits`` rows), and
        the entry of each."""
        counts = np.fromiter((e.num_logits if e.compute_logits else 0 for e in entries), dtype=np.int64,
                             count=len(entries))
        if ((counts > q_lens) | (want & (counts < 1))).any():
            raise ValueError("num_logits must be in [1, len(token_ids)]")
        entry_of_row = np.repeat(np.arange(len(entries)), counts)
        if entry_of_row.size == int(want.sum()):  # one row per sampling entry: its last
            return qsl[1:][want] - 1, entry_of_row
        # row r of entry i: its end minus the rows after r (counts[i] - 1 down to 0)
        first = np.cumsum(counts) - counts
        back = counts[entry_of_row] - 1 - (np.arange(entry_of_row.size) - first[entry_of_row])
        return qsl[1:][entry_of_row] - 1 - back, entry_of_row

    @torch.inference_mode()
    def execute(self, entries: list[SeqBatchEntry]) -> torch.Tensor | None:
        """One forward pass over all entries; float32 logits ``[rows, vocab]``: for each entry with
        compute_logits, in order, its last ``num_logits`` positions. Over several ranks every rank runs it
        with the same entries; the logits and ``last_prompt_logprobs`` come back on the driver (global rank
        0), None and {} on the others."""
        if not self.k_caches:
            raise RuntimeError("init_kv_cache must run before execute")
        if self.parallel.pp_size > 1:
            return self._execute_pipeline(entries)
        if not entries:
            return self._no_logits()
        self._ensure_threads()
        input_ids, positions, meta, rows, output_rows, lora = self._prepare(entries)
        hidden = None
        if self._graphs is not None and output_rows is None and meta.max_query_len == 1 and lora is None:
            hidden = self._graphs.run(input_ids, positions, meta)  # None: no bucket fits, run eagerly
        if hidden is None:  # with output_rows: those rows only
            hidden = self.model(input_ids, positions, meta, output_rows, lora) if lora is not None \
                else self.model(input_ids, positions, meta, output_rows)
        self.last_prompt_logprobs = self._prompt_logprobs(entries, hidden)  # none asked when output_rows is set
        if output_rows is None and rows.size != hidden.shape[0]:  # every row came back: keep the sampled ones
            hidden = hidden.index_select(0, torch.from_numpy(rows).to(self.device))
        if rows.size == 0:
            return self._no_logits()
        return self.model.compute_logits(hidden)  # None on tensor ranks other than 0

    def _no_logits(self) -> torch.Tensor | None:
        if not self.parallel.is_driver:
            return None
        return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------------ pipeline parallelism

    def _micro_batch_ranges(self, entries: list[SeqBatchEntry]) -> list[tuple[int, int]]:
        """``(start, stop)`` of up to ``micro_batches`` runs of contiguous entries, as even in tokens as the
        entries allow (every rank sees the same entries, so every rank cuts the same way)."""
        n = len(entries)
        k = max(1, min(self.micro_batches, n))
        if k == 1:
            return [(0, n)]
        cum = np.cumsum(np.fromiter((len(e.token_ids) for e in entries), dtype=np.int64, count=n))
        total = int(cum[-1])
        bounds = [0]
        for j in range(1, k):
            target = total * j / k
            cut = int(np.searchsorted(cum, target)) + 1  # the first cut whose entries reach target tokens
            if cut - 1 > bounds[-1] and target - cum[cut - 2] < cum[cut - 1] - target:
                cut -= 1  # stopping one entry short is closer
            bounds.append(min(max(cut, bounds[-1] + 1), n - (k - j)))  # every micro-batch keeps an entry
        bounds.append(n)
        return list(itertools.pairwise(bounds))

    def _execute_pipeline(self, entries: list[SeqBatchEntry]) -> torch.Tensor | None:
        """``execute`` on one rank of a pipeline: each micro-batch's hidden states from the previous stage (or
        the embedding), this stage's layers, on to the next stage, which runs it while this one takes the next
        micro-batch (GPipe's forward). The last stage computes the logits and prompt logprobs; its tensor rank 0
        sends them to the driver once the step's micro-batches are through (sent as they came, they would
        wait on a driver still sending the step's later micro-batches)."""
        p = self.parallel
        stats = self.pipeline_stats
        self.last_prompt_logprobs = {}
        if not entries:
            return self._no_logits()
        self._ensure_threads()
        prev = None if p.is_first_stage else p.rank_of(p.pp_rank - 1, p.tp_rank)
        nxt = None if p.is_last_stage else p.rank_of(p.pp_rank + 1, p.tp_rank)
        ranges = self._micro_batch_ranges(entries)
        parts: list[torch.Tensor] = []
        scored: dict[int, PromptLogprobs] = {}
        for start, stop in ranges:
            batch = entries[start:stop]
            input_ids, positions, meta, rows, output_rows, lora = self._prepare(batch)
            hidden = None
            if prev is not None:
                hidden = torch.empty((input_ids.shape[0], self.model.hidden_size), dtype=self.dtype,
                                     device=self.device)
                t0 = time.perf_counter()
                p.recv(hidden, prev)
                stats.recv_wait_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            out = self.model(input_ids, positions, meta, output_rows, lora, hidden=hidden)
            if nxt is not None:
                t1 = time.perf_counter()
                stats.compute_s += t1 - t0
                p.send(out, nxt)
                stats.send_wait_s += time.perf_counter() - t1
                continue
            scored.update((start + i, lp) for i, lp in self._prompt_logprobs(batch, out).items())
            if output_rows is None and rows.size != out.shape[0]:
                out = out.index_select(0, torch.from_numpy(rows).to(self.device))
            if rows.size:
                logits = self.model.compute_logits(out)
                if logits is not None:  # a copy unless it is the last: compute_logits may reuse its buffer
                    parts.append(logits if stop == len(entries) else logits.clone())
            stats.compute_s += time.perf_counter() - t0
        stats.steps += 1
        stats.micro_batches += len(ranges)

        num_rows = sum(e.num_logits for e in entries if e.compute_logits)
        scores = any(e.prompt_targets for e in entries)
        if p.rank == p.output_rank:
            t0 = time.perf_counter()
            if num_rows:
                p.send(torch.cat(parts) if len(parts) > 1 else parts[0], 0)
            if scores:
                p.send_object(scored, 0)
            stats.send_wait_s += time.perf_counter() - t0
            return None
        if not p.is_driver:
            return None
        logits = torch.empty((num_rows, self.vocab_size), dtype=torch.float32, device=self.device)
        t0 = time.perf_counter()
        if num_rows:
            p.recv(logits, p.output_rank)
        if scores:
            self.last_prompt_logprobs = p.recv_object(p.output_rank)
        stats.recv_wait_s += time.perf_counter() - t0
        return logits

    def _prompt_logprobs(self, entries: list[SeqBatchEntry], hidden: torch.Tensor) -> dict[int, PromptLogprobs]:
        """Entry index -> its prompt targets' logprobs, for the entries that asked (prompt_targets); {} on the
        tensor ranks other than 0, which only take part in the logits' gathers."""
        out: dict[int, PromptLogprobs] = {}
        offset = 0
        for i, e in enumerate(entries):
            if e.prompt_targets:
                scored = self._score_rows(hidden, offset, e.prompt_targets, e.prompt_top_k)
                if scored is not None:
                    out[i] = scored
            offset += len(e.token_ids)
        return out

    def _score_rows(self, hidden: torch.Tensor, start: int, targets: list[int], k: int) -> PromptLogprobs | None:
        res, mine = PromptLogprobs([], [], []), True
        for a in range(0, len(targets), _PROMPT_LOGPROB_ROWS):
            tgt = torch.tensor(targets[a : a + _PROMPT_LOGPROB_ROWS], device=self.device)
            logits = self.model.compute_logits(hidden[start + a : start + a + tgt.numel()])
            if logits is None:  # another tensor rank: its part of the gather is done
                mine = False
                continue
            logits = logits.float()
            lse = torch.logsumexp(logits, dim=-1)
            chosen = logits.gather(1, tgt[:, None])
            res.logprobs += (chosen.squeeze(1) - lse).tolist()
            res.ranks += ((logits > chosen).sum(dim=-1) + 1).tolist()
            if k > 0:
                vals, ids = logits.topk(min(k, logits.shape[1]), dim=-1)
                res.top += [list(zip(r_ids, r_vals, strict=True)) for r_ids, r_vals
                            in zip(ids.tolist(), (vals - lse[:, None]).tolist(), strict=True)]
            else:
                res.top += [[] for _ in range(tgt.numel())]
        return res if mine else None

    def wait_for_kv_cache_mapped(self, num_blocks: int | None = None) -> None:
        """Return once the background thread has mapped in the CPU KV cache's first ``num_blocks`` blocks
        (None: all of them); at once when none runs (GPU caches, populate_kv off)."""
        if self.kv_population is not None:
            block_bytes = self.k_caches[0][0].numel() * self.k_caches[0].element_size()
            self.kv_population.wait(None if num_blocks is None else num_blocks * block_bytes)

    def pause_kv_cache_mapping_while(self, busy: Callable[[], bool]) -> None:
        """The rest of the CPU KV cache maps in only while ``busy()`` is false (see PagePopulation)."""
        if self.kv_population is not None:
            self.kv_population.pause_while(busy)

    def warmup(self) -> None:
        """One tiny forward through block 0 (its contents are scratch until the engine writes it)."""
        n = min(4, self.loaded.max_model_len - 1)  # a prefill, then one decode after it (blocks hold >= 8)
        if n >= 1:
            self.execute([SeqBatchEntry(token_ids=[0] * n, start_pos=0, block_table=[0], compute_logits=True)])
        self.execute([SeqBatchEntry(token_ids=[0], start_pos=n, block_table=[0], compute_logits=True)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.capture_cuda_graphs()
        self.warmed_up = True

    def capture_cuda_graphs(self) -> None:
        """Decode graphs per batch-size bucket (see cuda_graphs); a failed capture leaves eager mode."""
        if not cuda_graphs.enabled(self.device, self.config.enforce_eager) or self._graphs is not None:
            return
        if self.parallel.world_size > 1:  # the graphs would capture collectives; several ranks run eagerly
            return
        sizes = cuda_graphs.capture_sizes(self.config.max_num_seqs)
        max_blocks = -(-self.loaded.max_model_len // self.block_size)
        graphs = cuda_graphs.DecodeGraphs(self.model, sizes, max_blocks, self.loaded.max_model_len, self.device)
        try:
            graphs.capture()
        except RuntimeError as e:  # e.g. a kernel that syncs during capture: run eagerly, say why
            logger.warning("CUDA graph capture failed (%s); decode runs eagerly", e)
            return
        self._graphs = graphs
