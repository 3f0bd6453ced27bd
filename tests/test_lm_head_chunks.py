"""A large LM head without panel copies (bfloat16 here) is packed in vocabulary chunks: its logits match the
dense product, including the rows past a chunk's slice of rows and the last, shorter chunk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpilot.daemon.engine import EngineConfig
from kvpilot.daemon.engine.loader import load_model
from kvpilot.daemon.engine.models import decoder
from kvpilot.daemon.engine.models.linear import prepack_supported
from tests.support.hf_parity import save_tiny

VOCAB = decoder._HEAD_CHUNK_ROWS + 4464  # noqa: SLF001 - one whole chunk and a shorter one


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_head_matches_the_dense_product(tmp_path: Path, tied: bool) -> None:
    if not prepack_supported(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no oneDNN bfloat16 on this CPU: the head is not packed")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    hf = save_tiny(cfg, LlamaForCausalLM, tmp_path, lambda _name: False)
    head = hf.lm_head.weight.detach().to(torch.bfloat16).float()
    model = load_model(EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cpu")).model
    assert len(model.lm_head_chunks) == 2 and model.lm_head is None
    hidden = torch.randn(200, 64).to(torch.bfloat16)  # past one slice of rows of the first chunk
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    want = hidden.float() @ head.T
    assert logits.shape == (200, VOCAB) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=2e-2, atol=2e-2)
