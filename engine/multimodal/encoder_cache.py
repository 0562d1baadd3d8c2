"""The encoder's embedding arena, which is also its cache.

One tensor of fixed-size slots, (num_slots, tokens_per_image, hidden), registered with NIXL once: a LLaVA image
always makes tokens_per_image embeddings, so one image is one slot and a reader reads one descriptor per image. An
entry is keyed by the image's content hash (pixels + processor + model), so the same image again is a hit and is not
encoded twice.

Leases: handing out a handle leases its slot until the reader's signed release arrives (over NIXL, as for KV) or the
lease ends. A leased slot is never evicted; an unleased one stays cached and is evicted least recently used first, only
when a new image needs its slot. Each slot has a generation number, bumped before it is refilled, exposed to readers
as a second region: a reader that read a refilled slot sees the change and refuses the bytes.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.kv.kv_handle import open_release
from engine.kv.kv_transfer import NixlTransport

log = logging.getLogger(__name__)


class EncoderCacheFull(RuntimeError):
    """Every slot is leased: nothing can be evicted for a new image until a reader releases one or a lease ends."""


@dataclass
class CacheStats:
    encodes: int = 0  # images encoded (cache misses)
    hits: int = 0  # images served from the cache
    evictions: int = 0
    releases: int = 0  # leases ended by a reader's release
    expired: int = 0  # leases ended by their deadline
    releases_rejected: int = 0  # release messages whose signature failed


@dataclass
class _Lease:
    slots: tuple[int, ...]
    deadline: float  # time.monotonic()


class EncoderCache:
    """Not thread-safe: its owner (engine/multimodal/encoder.py's EncoderEngine) calls it from one thread at a time."""

    def __init__(self, num_slots: int, tokens_per_image: int, hidden_size: int, dtype: torch.dtype,
                 lease_s: float, key: bytes | None, device: str | torch.device = "cpu"):
        if num_slots < 1:
            raise ValueError(f"the encoder cache needs at least one slot, got {num_slots}")
        self.lease_s = lease_s
        self._key = key
        # (slots, tokens, hidden), where the encoder computes: NIXL reads VRAM as well as DRAM
        self.arena = torch.zeros((num_slots, tokens_per_image, hidden_size), dtype=dtype, device=device)
        self.generations = torch.zeros(num_slots, dtype=torch.int64)  # (slots,): bumped before each refill
        self.transport = NixlTransport(f"raypd-enc-{uuid.uuid4().hex[:12]}", self.arena, self.generations)
        self._entries: OrderedDict[tuple[int, ...], int] = OrderedDict()  # hash -> slot, least recently used first
        self._hash_of: dict[int, tuple[int, ...]] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, set[str]] = {}  # slot -> leases holding it
        self._leases: dict[str, _Lease] = {}
        self.stats = CacheStats()

    @property
    def num_slots(self) -> int:
        return self.arena.shape[0]

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def lookup(self, content_hash: tuple[int, ...]) -> int | None:
        """The slot holding this image's embeddings, marked most recently used; None if not cached."""
        slot = self._entries.get(content_hash)
        if slot is not None:
            self._entries.move_to_end(content_hash)
        return slot

    def new_lease(self) -> tuple[str, float]:
        """An empty lease: (its id, its deadline on this host's wall clock). pin() adds slots to it."""
        lease_id = os.urandom(16).hex()
        self._leases[lease_id] = _Lease((), time.monotonic() + self.lease_s)
        return lease_id, time.time() + self.lease_s

    def pin(self, lease_id: str, slot: int) -> None:
        lease = self._leases[lease_id]
        lease.slots += (slot,)
        self._pins.setdefault(slot, set()).add(lease_id)

    def allocate(self, content_hash: tuple[int, ...], lease_id: str) -> int:
        """A slot for a new image, pinned under the lease and bumped to a new generation (write it next): a free
        one, else the least recently used unpinned entry's. Raises EncoderCacheFull."""
        slot = self._free.pop() if self._free else self._evict()
        self.generations[slot] += 1  # before the data changes: a reader that raced sees it
        self._entries[content_hash] = slot
        self._hash_of[slot] = content_hash
        self.pin(lease_id, slot)
        return slot

    def _evict(self) -> int:
        for content_hash, slot in self._entries.items():  # least recently used first
            if not self._pins.get(slot):
                del self._entries[content_hash]
                del self._hash_of[slot]
                self.stats.evictions += 1
                return slot
        raise EncoderCacheFull(f"all {self.num_slots} encoder cache slots are leased to readers; retry when a "
                               "prefill has read its embeddings (or raise the encoder's cache size)")

    def discard(self, content_hash: tuple[int, ...]) -> None:
        """Forgets an entry whose slot was allocated but never written (its encode failed); the slot is free again."""
        slot = self._entries.pop(content_hash, None)
        if slot is not None:
            del self._hash_of[slot]
            self._free.append(slot)

    def end_lease(self, lease_id: str) -> bool:
        """Unpins the lease's slots (they stay cached). Idempotent; True if it was held."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for slot in lease.slots:
            pins = self._pins.get(slot)
            if pins is not None:
                pins.discard(lease_id)
                if not pins:
                    del self._pins[slot]
        return True

    def poll(self) -> None:
        """Ends the leases readers released (signed messages only) and those past their deadline."""
        for messages in self.transport.poll_notifications().values():
            for message in messages:
                lease_id = open_release(message, self._key)
                if lease_id is None:
                    self.stats.releases_rejected += 1
                elif self.end_lease(lease_id):
                    self.stats.releases += 1
        now = time.monotonic()
        for lease_id in [i for i, lease in self._leases.items() if lease.deadline <= now]:
            self.end_lease(lease_id)
            self.stats.expired += 1

    def close(self) -> None:
        self.transport.close()
