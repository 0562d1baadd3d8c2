"""Routing decisions as plain functions of what replicas publish (no Ray, no Serve): how much of a prompt a replica
would still have to compute, which replica is cheapest, and whether a prompt is prefilled on the decode replica that
will decode it (no KV transfer) or on a prefill replica.

Each prefill and decode replica publishes a ReplicaState: its load in tokens and a PrefixSummary, a Bloom filter of
the prefix-cache keys its engine holds. A router computes the prompt's block keys itself with the engine's own
functions (engine/kv/block_hash.py, deterministic across processes), so a key in a summary names the same block. The
view is advice only: a stale entry or a false positive costs a cache miss, never a wrong answer, because the engine's
own lookup decides what is reused.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from engine.kv.block_hash import update_block_hashes
from engine.core.request import EngineRequest, Sequence
from llmapi.sampling_params import SamplingParams

KEY_BYTES = 16  # engine/kv/block_hash.py's digest size
BITS_PER_KEY = 10  # with NUM_PROBES probes: ~1% false positives, 10 bits a block (a 4096-block pool: 5 KiB)
NUM_PROBES = 7
MIN_BITS = 1024
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class PrefixSummary:
    """A Bloom filter of block keys. Keys are blake2b digests, so their two 64-bit halves already are independent
    uniform hashes; probe i is h1 + i * h2 (double hashing) modulo the bit count, a power of two."""

    bits: bytes

    @classmethod
    def of(cls, keys: bytes) -> PrefixSummary:
        """keys: 16-byte keys, concatenated (BlockManager.cached_keys())."""
        if len(keys) % KEY_BYTES:
            raise ValueError(f"keys: {len(keys)} bytes is not a whole number of {KEY_BYTES}-byte keys")
        n = len(keys) // KEY_BYTES
        m = max(MIN_BITS, 1 << max(0, n * BITS_PER_KEY - 1).bit_length())
        halves = np.frombuffer(keys, dtype="<u8").reshape(n, 2)  # (n, 2)
        steps = np.arange(NUM_PROBES, dtype=np.uint64)  # (NUM_PROBES,)
        # uint64 arithmetic wraps, as the & _MASK64 of __contains__ does
        probes = (halves[:, :1] + steps * (halves[:, 1:] | np.uint64(1))) & np.uint64(m - 1)  # (n, NUM_PROBES)
        bits = np.zeros(m // 8, dtype=np.uint8)
        np.bitwise_or.at(bits, (probes >> np.uint64(3)).ravel(),
                         np.left_shift(1, probes & np.uint64(7)).astype(np.uint8).ravel())
        return cls(bits.tobytes())

    def __contains__(self, key: bytes) -> bool:
        m = len(self.bits) * 8
        h1 = int.from_bytes(key[:8], "little")
        h2 = int.from_bytes(key[8:KEY_BYTES], "little") | 1
        for i in range(NUM_PROBES):
            p = ((h1 + i * h2) & _MASK64) & (m - 1)
            if not self.bits[p >> 3] >> (p & 7) & 1:
                return False
        return True

    def hit_blocks(self, keys: list[bytes]) -> int:
        """How many leading keys are (probably) cached: the engine reuses only an unbroken run from the start."""
        for i, key in enumerate(keys):
            if key not in self:
                return i
        return len(keys)


EMPTY = PrefixSummary.of(b"")


@dataclass(frozen=True)
class ReplicaState:
    """What one replica publishes for routing. load_tokens: work it has accepted and not done, in tokens (prefill:
    prompt tokens still to compute; decode: tokens still to generate plus the KV tokens its running sequences attend
    over each step)."""

    load_tokens: int
    block_size: int
    summary: PrefixSummary = EMPTY

    def to_stats(self) -> dict:
        """As a routing-stats dict (Serve's record_routing_stats); from_stats reads it back."""
        return {"load_tokens": self.load_tokens, "block_size": self.block_size, "prefix_summary": self.summary.bits}

    @classmethod
    def from_stats(cls, stats: dict | None) -> ReplicaState | None:
        """None when the replica has not reported yet (or reports something else)."""
        try:
            summary = PrefixSummary(bytes(stats["prefix_summary"]))
            state = cls(int(stats["load_tokens"]), int(stats["block_size"]), summary)
        except (KeyError, TypeError, ValueError):
            return None
        size = len(summary.bits)  # a power of two, at least MIN_BITS bits: __contains__ masks by it
        return state if state.block_size >= 1 and size >= MIN_BITS // 8 and size & (size - 1) == 0 else None

    def to_json(self) -> dict:
        """As JSON-safe values (the replica directory stores JSON, never pickle)."""
        return dict(self.to_stats(), prefix_summary=base64.b64encode(self.summary.bits).decode())

    @classmethod
    def from_json(cls, data: dict | None) -> ReplicaState | None:
        try:
            return cls.from_stats(dict(data, prefix_summary=base64.b64decode(data["prefix_summary"])))
        except (KeyError, TypeError, ValueError):
            return None


def prompt_block_keys(prompt_token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """The prefix-cache keys of the prompt's full blocks, exactly as an engine computes them (text prompts: images'
    keys are not known here, so such a prompt's blocks after an image just miss)."""
    request = EngineRequest(0, list(prompt_token_ids), SamplingParams(), cache_salt=cache_salt)
    return list(update_block_hashes(Sequence(0, request, 0, request.prompt_token_ids), block_size))


def cached_tokens(state: ReplicaState, keys: list[bytes], num_tokens: int,
                  also_cached: frozenset[bytes] = frozenset()) -> int:
    """Prompt tokens the replica would find cached (its summary, or also_cached: blocks a router has just sent it).
    The engine always computes the last prompt token (its logits are needed), so a hit covers at most the full
    blocks before it."""
    usable = keys[:max(0, num_tokens - 1) // state.block_size]
    run = 0
    while run < len(usable) and (usable[run] in also_cached or usable[run] in state.summary):
        run += 1
    return run * state.block_size


def uncached_tokens(state: ReplicaState, keys: list[bytes], num_tokens: int,
                    also_cached: frozenset[bytes] = frozenset()) -> int:
    """Prompt tokens the replica would compute (prefill) or read (decode import) after its cache hit."""
    return num_tokens - cached_tokens(state, keys, num_tokens, also_cached)


def replica_cost(state: ReplicaState, keys: list[bytes], num_tokens: int, pending_tokens: int = 0,
                 pending_keys: frozenset[bytes] = frozenset()) -> int:
    """Tokens the replica must get through before this prompt is done: what it would compute of the prompt after
    its cache hit, plus its load, plus what a router sent it that its last report cannot show yet."""
    return uncached_tokens(state, keys, num_tokens, pending_keys) + state.load_tokens + pending_tokens


@dataclass(frozen=True)
class PrefillChoice:
    local: bool  # prefill on the decode replica (no KV transfer); else on a prefill replica
    tokens_to_prefill: int  # prompt tokens the best decode replica would compute after its cache hit


def choose_prefill(prompt_token_ids: list[int], cache_salt: str | None, decode_states: list[ReplicaState],
                   max_local_prefill_tokens: int) -> PrefillChoice:
    """Conditional disaggregation: a prompt whose uncached part on the decode replica that holds most of it is under
    max_local_prefill_tokens is prefilled there, saving the prefill hop and the KV transfer; a longer one is
    prefilled remotely, where it does not stall the decode batch. 0 disables local prefill."""
    n = len(prompt_token_ids)
    if max_local_prefill_tokens <= 0:
        return PrefillChoice(False, n)
    keys: dict[int, list[bytes]] = {}  # per block size (one, unless replicas disagree mid-redeploy)
    best = 0
    for state in decode_states:
        if state.block_size not in keys:
            keys[state.block_size] = prompt_block_keys(prompt_token_ids, state.block_size, cache_salt)
        best = max(best, cached_tokens(state, keys[state.block_size], n))
    left = n - best
    return PrefillChoice(left < max_local_prefill_tokens, left)


def replica_state(role: str, keys: bytes, load: dict[str, int]) -> ReplicaState:
    """A replica's state from its engine's cached keys and load (EngineWorker.cache_snapshot). A prefill replica's
    load is the prompt tokens it still has to compute; a decode replica's the tokens it still has to generate plus
    the KV tokens its sequences hold (each step attends over them, and a full pool preempts)."""
    if role == "prefill":
        tokens = load["uncomputed_tokens"]
    else:
        tokens = load["queued_tokens"] + load["kv_blocks_in_use"] * load["block_size"]
    return ReplicaState(tokens, load["block_size"], PrefixSummary.of(keys))
