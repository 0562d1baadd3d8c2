"""Prefix-cache keys of full KV blocks: a chain, so a block's key stands for every token before it as well.

key(block i) = blake2b(key(block i-1), the block's token ids, extra keys). The extra keys are what else decides
the block's KV besides its tokens: the request's `cache_salt` (on the first block, so it flows down the chain and
isolates a tenant's entries) and each image whose positions overlap the block, as (content hash, offset in the
prompt), so the same text with another image never hits. Keys are 16-byte digests: deterministic across processes
(replicas can compare them) and wide enough that a collision, which would serve another prompt's KV, is not a risk.
"""

from __future__ import annotations

import hashlib
from array import array

from engine.core.request import EngineRequest, Sequence

_ROOT = b"raypd.block.v1"


def block_key(parent: bytes | None, tokens: list[int], extra: tuple = ()) -> bytes:
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(repr(extra).encode())
    return h.digest()


def extra_keys(request: EngineRequest, block_index: int, block_size: int) -> tuple:
    """What besides its tokens decides this block's KV (see the module docstring)."""
    start, end = block_index * block_size, (block_index + 1) * block_size
    extra = tuple((item.content_hash, item.offset) for item in request.mm_items
                  if item.offset < end and item.offset + item.length > start)
    if block_index == 0 and request.cache_salt is not None:
        extra = (("salt", request.cache_salt),) + extra
    return extra


def update_block_hashes(seq: Sequence, block_size: int) -> list[bytes]:
    """Extends seq.block_hashes to cover every full block of its tokens; returns them."""
    hashes = seq.block_hashes
    for i in range(len(hashes), seq.num_tokens // block_size):
        tokens = seq.token_ids[i * block_size:(i + 1) * block_size]
        hashes.append(block_key(hashes[-1] if hashes else None, tokens, extra_keys(seq.request, i, block_size)))
    return hashes


def image_safe_prefix(request: EngineRequest, num_tokens: int) -> int:
    """The longest prefix of at most num_tokens tokens that does not end inside an image's positions."""
    for item in sorted(request.mm_items, key=lambda i: -i.offset):
        if item.offset < num_tokens < item.offset + item.length:
            num_tokens = item.offset
    return num_tokens
