"""kvpilot's inference engine: paged KV cache, continuous batching, real Hugging Face models."""

from .config import EngineConfig
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "EngineStats",
    "SamplingParams",
    "RequestOutputKind",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
]


def __getattr__(name: str):
    # The heavy parts (torch, transformers) load on first use, so config and params stay cheap to import.
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name in ("LLMEngine", "EngineStats"):
        from . import llm_engine

        return getattr(llm_engine, name)
    if name == "LoRARequest":
        from .lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(name)
