"""The engine's side of structured outputs: sequences held until their grammar compiles, and the
per-step masking of the constrained rows. LLMEngine creates one on its first constrained request."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterable
from typing import Any

import torch

from .bitmask import BatchMasker
from .compiler import shared_compiler
from .matcher import SequenceMatcher
from .spec import StructuredOutputSpec


class StructuredOutputs:
    """Compiles on a thread pool; the engine moves a held sequence into the scheduler once its
    grammar is ready, so the rest of the batch keeps decoding while it compiles."""

    def __init__(self, tokenizer: Any, width: int, stop_token_ids: Iterable[int]) -> None:
        self.width = width
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.compiler = shared_compiler(tokenizer, width, self.stop_token_ids)
        self.masker = BatchMasker(width)
        self.held: dict[str, tuple[Any, cf.Future]] = {}  # request_id -> (sequence, compile future)

    def hold(self, request_id: str, seq: Any, spec: StructuredOutputSpec) -> None:
        self.held[request_id] = (seq, self.compiler.submit(spec.validate()))

    def drop(self, request_id: str) -> Any | None:
        """Forget a held request (aborted); returns its sequence, if it was held."""
        entry = self.held.pop(request_id, None)
        return None if entry is None else entry[0]

    def take_done(self) -> tuple[list[Any], list[tuple[Any, BaseException]]]:
        """Held sequences whose grammar is ready (now carrying it), and those whose compile failed."""
        ready: list[Any] = []
        failed: list[tuple[Any, BaseException]] = []
        for rid, (seq, fut) in list(self.held.items()):
            if not fut.done():
                continue
            del self.held[rid]
            exc = fut.exception()
            if exc is not None:
                failed.append((seq, exc))
            else:
                seq.grammar = fut.result()
                ready.append(seq)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until some held compile finishes (only called when nothing else can run)."""
        if self.held:
            cf.wait([f for _, f in self.held.values()], timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def matcher(self, seq: Any) -> SequenceMatcher:
        if seq.matcher is None:
            seq.matcher = SequenceMatcher(seq.grammar, self.stop_token_ids)
        return seq.matcher

    def mask(self, logits: torch.Tensor, seqs: list[Any], prefixes: list[list[int]] | None = None) -> set[int]:
        """Mask row i of logits for each constrained seqs[i], in place, after syncing its matcher to
        its output tokens (a preempted sequence rolls back or replays). Returns the rows whose
        output left the grammar: the engine finishes those sequences instead of sampling them.

        ``prefixes[i]`` (speculative decoding): row i is the distribution after the output plus these draft
        tokens; the matcher advances over them for the row's mask and rolls back after. A row whose prefix
        the grammar refuses is left unmasked: the row before it cannot sample that draft, so the
        verification never reaches it."""
        rows: list[int] = []
        failed: set[int] = set()
        bitmask = self.masker.rows_buffer(logits.shape[0])
        for i, seq in enumerate(seqs):
            if seq.grammar is None:
                continue
            m = self.matcher(seq)
            if not m.sync(seq.output_token_ids):
                failed.add(i)
                continue
            prefix = prefixes[i] if prefixes is not None else ()
            advanced = m.try_advance(list(prefix)) if prefix else 0
            if advanced == len(prefix) and m.fill_bitmask(bitmask, i):
                rows.append(i)
            m.rollback(advanced)
        if rows:
            self.masker.apply_filled(logits, rows)
        return failed
