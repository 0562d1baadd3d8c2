"""The encoder's arena as a cache: LRU eviction of unleased entries only, lease ends (signed release over real NIXL, or
deadline), generations bumped on refill."""

from __future__ import annotations

import time

import pytest
import torch

from engine.multimodal.encoder_cache import EncoderCache, EncoderCacheFull
from engine.kv.kv_handle import release_message
from engine.kv.kv_transfer import NixlTransport

A, B, C = ((i,) * 8 for i in range(1, 4))


@pytest.fixture
def cache():
    c = EncoderCache(2, 4, 8, torch.float32, lease_s=30.0, key=None)
    yield c
    c.close()


def test_lru_evicts_the_least_recently_used_unleased_entry(cache):
    lease, _ = cache.new_lease()
    slot_a, slot_b = cache.allocate(A, lease), cache.allocate(B, lease)
    assert cache.generations.tolist() == [1, 1]
    cache.end_lease(lease)
    assert cache.lookup(A) == slot_a  # A is now the most recently used
    lease, _ = cache.new_lease()
    assert cache.allocate(C, lease) == slot_b  # B goes
    assert cache.lookup(B) is None and cache.lookup(A) == slot_a and cache.stats.evictions == 1
    assert cache.generations[slot_b] == 2  # a reader of B's old handle sees the refill


def test_leased_entries_are_never_evicted(cache):
    lease, _ = cache.new_lease()
    cache.allocate(A, lease)
    cache.allocate(B, lease)
    other, _ = cache.new_lease()
    with pytest.raises(EncoderCacheFull, match="leased"):
        cache.allocate(C, other)
    cache.pin(other, cache.lookup(A))  # a second lease on A: ending the first frees only B
    cache.end_lease(lease)
    assert cache.allocate(C, other) != cache.lookup(A)


def test_leases_end_at_their_deadline():
    cache = EncoderCache(1, 4, 8, torch.float32, lease_s=0.05, key=None)
    try:
        lease, wall_deadline = cache.new_lease()
        assert wall_deadline == pytest.approx(time.time() + 0.05, abs=0.05)
        cache.allocate(A, lease)
        time.sleep(0.1)
        cache.poll()
        assert cache.num_leases == 0 and cache.stats.expired == 1
        assert cache.allocate(B, cache.new_lease()[0]) == 0
    finally:
        cache.close()


def test_only_signed_releases_end_a_lease(cache):
    lease, _ = cache.new_lease()
    cache.allocate(A, lease)
    with NixlTransport("reader", torch.zeros(2, 4, 8)) as reader:
        reader.connect(cache.transport.name, cache.transport.metadata())
        reader.send_notification(cache.transport.name, release_message(lease, b"not the cluster key" * 2))
        reader.send_notification(cache.transport.name, release_message(lease, None))
        deadline = time.monotonic() + 10
        while cache.num_leases and time.monotonic() < deadline:
            cache.poll()
            time.sleep(0.01)
    assert cache.num_leases == 0 and cache.stats.releases == 1 and cache.stats.releases_rejected == 1
