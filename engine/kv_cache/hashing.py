"""Chained block hashing for prefix caching: a full block's hash covers its tokens and, through its
parent's hash, every token before it, so equal hashes mean equal prefixes."""
from __future__ import annotations

import hashlib


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def adapter_cache_root(name: str) -> int:
    """The prefix cache's root for a LoRA adapter's requests (their blocks hold its keys and
    values): the same in every process, as the router compares the ingresses' hashes."""
    return int.from_bytes(hashlib.sha256(f"lora:{name}".encode()).digest()[:8], "little")


def extend_block_hashes(block_hashes: list[int], token_ids: list[int], block_size: int,
                        num_tokens: int, root: int | None = None) -> list[int]:
    """Appends, in place, the hashes of the full blocks of token_ids[:num_tokens] not hashed yet;
    `root`: the first block's parent (a LoRA adapter's: its blocks never match another's)."""
    for start in range(len(block_hashes) * block_size, num_tokens - block_size + 1, block_size):
        parent = block_hashes[-1] if block_hashes else root
        block_hashes.append(hash_block(parent, tuple(token_ids[start:start + block_size])))
    return block_hashes
