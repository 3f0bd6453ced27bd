"""Prefix-cache block hashes: chained SHA-256, stable across processes, shared by engine and router."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpilot.block_hash import ROOT_HASH, hash_block_tokens, hash_prompt_blocks


def test_hash_chain_depends_on_parent():
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(b"\x01" * 32, [1, 2]) != hash_block_tokens(b"\x02" * 32, [1, 2])
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(ROOT_HASH, [1, 2])


def test_hash_is_sha256_sized_and_depends_on_every_field():
    base = hash_block_tokens(None, [1, 2, 3])
    assert isinstance(base, bytes) and len(base) == 32
    assert hash_block_tokens(None, [1, 2, 4]) != base
    assert hash_block_tokens(None, [1, 2, 3], ("salt",)) != base
    assert hash_block_tokens(None, [1, 2, 3], ("salt",)) != hash_block_tokens(None, [1, 2, 3], ("other",))
    # Length prefixes: moving a value between fields never gives the same bytes.
    assert hash_block_tokens(None, [1, 2], ()) != hash_block_tokens(None, [1], (2,))
    assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))
    assert hash_block_tokens(None, [1], (1,)) != hash_block_tokens(None, [1], ("1",))


def test_extra_keys_must_have_a_stable_encoding():
    assert hash_block_tokens(None, [1], (b"raw", 7, "s"))
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (1.5,))
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (True,))


def test_hash_prompt_blocks_full_blocks_only_and_extra_on_the_first():
    tokens = list(range(10))
    hashes = hash_prompt_blocks(tokens, 4)
    assert len(hashes) == 2  # the 2-token tail has no hash
    assert hashes[0] == hash_block_tokens(None, tokens[:4])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
    salted = hash_prompt_blocks(tokens, 4, ("tenant",))
    assert salted[0] == hash_block_tokens(None, tokens[:4], ("tenant",))
    assert salted[1] == hash_block_tokens(salted[0], tokens[4:8])  # carried by the chain, not re-mixed
    assert all(a != b for a, b in zip(hashes, salted, strict=True))
    assert hash_prompt_blocks(tokens[:3], 4) == []
    with pytest.raises(ValueError, match="block_size"):
        hash_prompt_blocks(tokens, 0)


_CHILD = (
    "from kvpilot.block_hash import hash_prompt_blocks;"
    "print(','.join(h.hex() for h in hash_prompt_blocks(list(range(1000, 1040)), 16, ('tenant-a',))))"
)


def test_same_prompt_hashes_identically_in_two_processes():
    results = []
    for seed in ("1", "2"):  # Python's own hash() would differ between these two
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
        results.append(proc.stdout.strip())
    assert results[0] == results[1]
    here = ",".join(h.hex() for h in hash_prompt_blocks(list(range(1000, 1040)), 16, ("tenant-a",)))
    assert results[0] == here
