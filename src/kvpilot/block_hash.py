"""Prefix-cache block hashes: SHA-256 chained over (parent hash, token ids, extra keys).

The engine keys its prefix cache with these and the router computes the same values to route a
prompt to the replica that already holds its blocks, so the hash must not depend on the process
(Python's hash() is salted per process) and must resist crafted collisions (a collision would
serve one tenant's KV cache to another). Every field is length-prefixed, so distinct inputs never
encode to the same bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

# Parent of the first block: a fixed 32-byte value, so every hashed parent has the same length.
ROOT_HASH: BlockHash = hashlib.sha256(b"kvpilot.block_hash.v1").digest()

_TAG_STR = b"s"
_TAG_INT = b"i"
_TAG_BYTES = b"b"


def _encode_extra(key: object) -> bytes:
    # Only types with a process-independent encoding are allowed (no repr() of arbitrary objects).
    if isinstance(key, str):
        tag, data = _TAG_STR, key.encode("utf-8")
    elif isinstance(key, bool) or not isinstance(key, int | bytes):
        raise TypeError(f"extra hash keys must be str, int or bytes, got {type(key).__name__}")
    elif isinstance(key, int):
        tag, data = _TAG_INT, str(key).encode("ascii")
    else:
        tag, data = _TAG_BYTES, key
    return tag + struct.pack("<I", len(data)) + data


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra: tuple = ()) -> BlockHash:
    """Hash of one full block; equal hashes mean equal prefixes up to and including this block."""
    h = hashlib.sha256(ROOT_HASH if parent is None else parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(struct.pack("<I", len(extra)))
    for key in extra:
        h.update(_encode_extra(key))
    return h.digest()


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, extra: tuple = ()) -> list[BlockHash]:
    """Chained hashes of every full block of a prompt (a partial tail block has none).

    `extra` (e.g. a tenant's cache salt) is mixed into the first block only; the chain carries it
    into every later one.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra if i == 0 else ())
        hashes.append(parent)
    return hashes
