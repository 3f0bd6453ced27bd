"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .spec_decode.config import SpeculativeConfig, parse_speculative_config, speculative_config_json

SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")  # auto: the model's dtype
DEVICES = ("auto", "cpu", "cuda")
# vLLM's --quantization names (compressed-tensors: its FP8 checkpoints), plus none: dequantize at load
QUANTIZATIONS = ("none", "gguf", "fp8", "compressed-tensors", "awq", "gptq")
BLOCK_SIZES = (8, 16, 32, 64, 128)
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")  # kvpilot.kernels.settings checks them too
DEFAULT_MODEL = "builtin://smollm2-135m"


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Field names follow vLLM's engine args."""

    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": "model URI: builtin://NAME, hf://org/name, pvc://claim/path or a local path"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "the name the engine reports the model under (default: the model URI)"})
    dtype: str = field(default="auto", metadata={
        "choices": DTYPES,
        "help": "weights and activations; auto: bf16 on GPUs that support it and CPUs with AMX or AVX512-BF16, "
                "else fp32"})
    device: str = field(default="auto", metadata={
        "choices": DEVICES, "help": "auto: cuda when available, else cpu"})
    quantization: str | None = field(default=None, metadata={
        "choices": QUANTIZATIONS,
        "help": "how the linear layers keep their weights; default: as the checkpoint has them (a .gguf file on "
                "its GGUF blocks, an HF checkpoint by its quantization_config, else float); none runs a .gguf "
                "model on its weights dequantized to dtype at load; fp8 also quantizes a float checkpoint at load"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "choices": KV_CACHE_DTYPES,
        "help": "KV cache storage; auto: the model's dtype. float16 under a float32 model halves the bytes a "
                "decode step reads and doubles the blocks a memory budget holds"})
    block_size: int = field(default=16, metadata={
        "choices": BLOCK_SIZES, "help": "tokens per KV cache block"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context length, prompt plus completion (default: the model's own limit, capped at 8192)"})
    max_num_seqs: int = field(default=256, metadata={
        "help": "sequences in the running batch at most"})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "tokens one scheduler step may process at most"})
    long_prefill_token_threshold: int = field(default=0, metadata={
        "help": "in a step that also decodes, each prompt chunk takes at most this many tokens, so a long "
                "prompt stalls running streams for several short steps instead of one long one (lower TPOT "
                "and inter-token latency, a little later first token for that prompt); 0: no cap"})
    kv_cache_memory: int | None = field(default=None, metadata={
        "help": "bytes for the KV cache, e.g. 20Gi or 256MiB. On CPU the cache's size (default 1 GiB); on a "
                "GPU a cap: the cache takes the smaller of this and what gpu_memory_utilization leaves"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "fraction of GPU memory the engine may use, KV cache included"})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "fixed number of KV blocks (overrides memory sizing; tests, benchmarks)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV blocks of prompt prefixes seen before"})
    scheduling_policy: str = field(default="fcfs", metadata={
        "choices": SCHEDULING_POLICIES, "help": "fcfs, or priority (ordered by the requests' 'priority' field)"})
    preemption_mode: str = field(default="recompute", metadata={
        "choices": PREEMPTION_MODES, "help": "what happens to a preempted sequence's KV blocks"})
    swap_space: float = field(default=1.0, metadata={
        "help": "GiB of CPU memory for swapped-out blocks"})
    seed: int = field(default=0, metadata={"help": "random seed of the engine"})
    speculative_config: dict[str, Any] | None = field(default=None, metadata={
        "help": "speculative decoding, as a JSON object with vLLM's keys: method (ngram or draft_model), "
                "num_speculative_tokens, prompt_lookup_min/prompt_lookup_max (ngram), model (draft_model: "
                "self:N for the target's first N layers, or a model with the same tokenizer) and "
                "disable_by_batch_size (no speculation above this many running sequences; default 8). "
                "E.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'. Exact: the output "
                "distribution is the model's own"})
    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters (PEFT format) beside the base model: a batch mixes the base and up to "
                "max_loras adapters"})
    max_loras: int = field(default=1, metadata={
        "help": "adapters in one batch at most; requests for others wait until a slot frees"})
    max_lora_rank: int = field(default=16, metadata={
        "help": "the largest adapter rank the engine loads (its device slots are sized for it)"})
    max_cpu_loras: int | None = field(default=None, metadata={
        "help": "adapters kept loaded in host memory, least recently used evicted first (default: max_loras; "
                "at least max_loras)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks that split each layer (query and KV heads, MLP columns, vocabulary), one process and one "
                "device each; their all-reduces run over NCCL on GPUs and gloo on CPUs"})
    pipeline_parallel_size: int = field(default=1, metadata={
        "help": "stages the layers are split into, one group of tensor_parallel_size ranks each; a step's "
                "sequences go through them in micro-batches. What carries a model across nodes"})
    nnodes: int | None = field(default=None, metadata={
        "help": "nodes (pods) the tensor_parallel_size * pipeline_parallel_size ranks span, the same number on "
                "each (default 1; in a LeaderWorkerSet, LWS_GROUP_SIZE)"})
    node_rank: int | None = field(default=None, metadata={
        "help": "this node's index among nnodes: 0 runs the engine core and the API server, the others only "
                "their ranks (default 0; in a LeaderWorkerSet, LWS_WORKER_INDEX)"})
    dist_init_addr: str | None = field(default=None, metadata={
        "help": "host:port where the ranks of several nodes meet (node 0 listens there; default: "
                "LWS_LEADER_ADDRESS:29500 in a LeaderWorkerSet; one node picks a free local port)"})
    distributed_timeout: float = field(default=300.0, metadata={
        "help": "seconds a rank waits on the others in a collective, or to start, before the engine counts "
                "them dead"})
    # kernel and host choices: resolved once at engine start (the kernels' KernelSettings, the runner's
    # threads and memory), never read per step
    attention_backend: str = field(default="auto", metadata={
        "choices": ATTENTION_BACKENDS,
        "help": "attention and KV-cache writes: auto picks triton for CUDA tensors, the native CPU kernels "
                "where they apply and the torch reference otherwise; triton, cpu or torch forces one"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "never capture CUDA graphs: every decode step on a GPU runs eagerly"})
    cpu_kernel: bool = field(default=True, metadata={
        "help": "build (with the system C compiler, on first use) and use the native CPU kernels: attention, "
                "KV writes, the model's row steps and small-batch GEMM; off: torch for all of them"})
    prepack_weights: bool = field(default=True, metadata={
        "help": "on the CPU, keep float32 (and, with AVX512-BF16 or AMX, bfloat16) GEMM weights in "
                "oneDNN's blocked layout instead of repacking them on every call"})
    small_batch_gemm: bool | None = field(default=None, metadata={
        "help": "on the CPU, keep panel copies of the float32 GEMM weights for steps of a few rows (the "
                "native panel GEMM). Default: when the copies take at most a tenth of physical memory. "
                "False also keeps float32 MoE experts dense (off the native MoE kernel, which reads panels)"})
    malloc_tuning: bool = field(default=True, metadata={
        "help": "on the CPU with glibc, keep freed activation buffers in the heap instead of unmapping them "
                "(the process keeps its peak activation memory after a burst)"})
    populate_kv: bool = field(default=True, metadata={
        "help": "on the CPU, map the KV cache's pages in on a background thread, paused while steps run; "
                "off: they fault in on first use"})
    num_threads: int | None = field(default=None, metadata={
        "help": "intra-op CPU threads of each rank (default: OMP_NUM_THREADS, else the CPUs this process may "
                "use, capped by a cgroup CPU limit, shared among the node's ranks)"})

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        for name in ("enforce_eager", "cpu_kernel", "prepack_weights", "malloc_tuning", "populate_kv",
                     "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.small_batch_gemm is not None and not isinstance(self.small_batch_gemm, bool):
            raise ValueError(f"small_batch_gemm must be true, false or None (auto), got {self.small_batch_gemm!r}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is not None and (isinstance(self.max_cpu_loras, bool) or not isinstance(
                self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")
        if isinstance(self.speculative_config, str):  # its JSON, as `--speculative-config` takes it
            self.speculative_config = speculative_config_json(self.speculative_config)
        parse_speculative_config(self.speculative_config)  # a bad one fails here, naming the key
        self._check_parallel()
        if self.num_threads is not None and (isinstance(self.num_threads, bool) or not isinstance(
                self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be an integer >= 1, got {self.num_threads!r}")

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.nnodes is not None and (isinstance(self.nnodes, bool) or not isinstance(self.nnodes, int)
                                        or self.nnodes < 1 or self.world_size % self.nnodes):
            raise ValueError(f"nnodes must be an integer >= 1 that divides tensor_parallel_size * "
                             f"pipeline_parallel_size ({self.world_size}), got {self.nnodes!r}")
        if self.node_rank is not None and (isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int)
                                           or not 0 <= self.node_rank < (self.nnodes or 1)):
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes or 1}), got {self.node_rank!r}")
        if self.dist_init_addr is not None:
            host, _, port = str(self.dist_init_addr).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout!r}")
        spec = self.speculative
        if self.world_size > 1 and spec is not None and spec.method != "ngram":
            raise ValueError(f"speculative_config method {spec.method!r} is not supported with "
                             "tensor_parallel_size or pipeline_parallel_size above 1 yet; ngram is")

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size * pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def cpu_loras(self) -> int:
        """Adapters the host-side LRU keeps: ``max_cpu_loras``, else ``max_loras``."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config``, checked; None when speculation is off."""
        return parse_speculative_config(self.speculative_config)
