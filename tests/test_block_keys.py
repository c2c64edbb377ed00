"""Prefix-cache keys are cryptographic digests, identical in every process, and lookups still compare tokens.

A pair of prompts whose Python `hash()` chains collide cannot be built cheaply (64 bits), so these tests
show the key IS the BLAKE2b digest of the documented input instead, and that nothing per-process enters it.
"""

import hashlib
import os
import struct
import subprocess
import sys

from pagedchat.engine.kv.block_pool import BlockPool, chain_hash

TOKENS = tuple(range(100, 116))


def _expected(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    data = (parent or bytes(32)) + struct.pack(f"<{len(tokens)}I", *tokens)
    return hashlib.blake2b(data, digest_size=32, person=b"pagedchat-kv-v1").digest()


def test_key_is_the_blake2b_digest_of_parent_and_tokens():
    first = chain_hash(None, TOKENS)
    assert first == _expected(None, TOKENS) and len(first) == 32
    second = chain_hash(first, TOKENS)
    assert second == _expected(first, TOKENS) and second != first
    # the same block after a different prefix is a different key
    assert chain_hash(chain_hash(None, TOKENS[::-1]), TOKENS) != second


def test_keys_are_identical_across_processes_and_hash_seeds():
    code = ("from pagedchat.engine.kv.block_pool import chain_hash; "
            f"print(chain_hash(chain_hash(None, {TOKENS!r}), {TOKENS!r}).hex())")
    outputs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, check=True).stdout.strip() for seed in ("1", "2")}
    assert outputs == {chain_hash(chain_hash(None, TOKENS), TOKENS).hex()}


def test_lookup_compares_tokens_even_when_keys_match():
    pool = BlockPool(num_blocks=4, block_size=16)
    block = pool.allocate()
    key = pool.register(block, None, TOKENS)
    assert pool.lookup(None, TOKENS) == (block, key)
    other = tuple(range(200, 216))
    pool.hash_to_block[chain_hash(None, other)] = block  # a forged collision: same key, other tokens
    assert pool.lookup(None, other) is None
