"""Serve request routers for the prefill and decode roles (`router.policy` in the YAML).

Serve calls `record_routing_stats` on every replica each ROUTING_STATS_PERIOD_S and hands the latest report to the
router in each caller's process. Between reports a router adds what it has sent a replica itself, so a burst does not
all land on the same one. A router returns one replica per rank, best first: Serve sends to the first whose queue is
not full (within a rank it would pick by ongoing requests instead, undoing the ranking). Neither router uses Serve's
FIFOMixin: the replica chosen for a request must serve that request, not whichever is oldest.

- least_queued_tokens: the replica whose engine has the fewest queued tokens.
- prefix_aware: the replica with the lowest cost for this prompt (cluster/routing_policy.py: prompt tokens left to
  compute after its prefix-cache hit, plus its load), from each replica's Bloom filter of cached block keys.
"""

from __future__ import annotations

import time

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import RequestRouter

from cluster.routing_policy import ReplicaState, prompt_block_keys, replica_cost

ROUTING_STATS_PERIOD_S = 0.5
_SENT_TTL_S = 4 * ROUTING_STATS_PERIOD_S  # a prompt sent this recently may not be in its replica's report yet


def _request_prompt(pending_request) -> tuple[list[int], str | None]:
    """(prompt token ids, cache salt) of a prefill/decode call: (request id, prompt ids, sampling params, ...)."""
    args = getattr(pending_request, "args", ()) or ()
    ids = args[1] if len(args) > 1 and isinstance(args[1], list) else []
    salt = getattr(args[2], "cache_salt", None) if len(args) > 2 else None
    return ids, salt


class LeastQueuedTokensRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._sent: dict[str, int] = {}  # replica id -> tokens sent to it since its last report
        self._report: dict[str, int] = {}  # replica id -> id() of the stats that report was

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        ranked = sorted(candidate_replicas, key=self._load)
        if ranked and pending_request is not None:
            key = str(ranked[0].replica_id)
            self._sent[key] = self._sent.get(key, 0) + len(_request_prompt(pending_request)[0])
        return [[r] for r in ranked]

    def _load(self, replica) -> int:
        key, stats = str(replica.replica_id), replica.routing_stats or {}
        if self._report.get(key) != id(stats):  # a fresh report already counts what was sent before it
            self._report[key], self._sent[key] = id(stats), 0
        return int(stats.get("queued_tokens", 0)) + self._sent[key]


class PrefixAwareRouter(RequestRouter):
    """Sends each prompt where it costs least: its uncached tokens there plus the replica's load. Tokens sent to a
    replica count as its load until its next report; the blocks of prompts sent in the last _SENT_TTL_S count as
    cached there (they will be by the time a follow-up runs), so a burst of one conversation stays together."""

    def initialize_state(self, **kwargs) -> None:
        self._states: dict[str, tuple[int, ReplicaState | None]] = {}  # replica id -> (id() of its stats, parsed)
        self._sent_tokens: dict[str, int] = {}  # replica id -> tokens sent to it since its last report
        self._sent_keys: dict[str, list[tuple[float, frozenset[bytes]]]] = {}  # replica id -> (when, block keys)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        ids, salt = _request_prompt(pending_request)
        now = time.monotonic()
        states = {str(r.replica_id): self._state(r) for r in candidate_replicas}
        block_size = next((s.block_size for s in states.values() if s is not None), None)
        keys = prompt_block_keys(ids, block_size, salt) if block_size and ids else []
        costs = {key: self._cost(key, state, keys, len(ids), now) for key, state in states.items()}
        ranked = sorted(candidate_replicas, key=lambda r: costs[str(r.replica_id)])
        if ranked and pending_request is not None:
            best = str(ranked[0].replica_id)
            self._sent_tokens[best] = self._sent_tokens.get(best, 0) + len(ids)
            self._sent_keys.setdefault(best, []).append((now, frozenset(keys)))
        return [[r] for r in ranked]

    def _state(self, replica) -> ReplicaState | None:
        key, stats = str(replica.replica_id), replica.routing_stats
        seen = self._states.get(key)
        if seen is None or seen[0] != id(stats):  # a fresh report: it counts what was sent before it
            seen = self._states[key] = (id(stats), ReplicaState.from_stats(stats))
            self._sent_tokens[key] = 0
        return seen[1]

    def _cost(self, replica: str, state: ReplicaState | None, keys: list[bytes], num_tokens: int, now: float) -> int:
        sent = [(t, k) for t, k in self._sent_keys.get(replica, ()) if now - t < _SENT_TTL_S]
        self._sent_keys[replica] = sent
        pending = self._sent_tokens.get(replica, 0)
        if state is None:  # not reported yet: only what this router sent it is known
            return num_tokens + pending
        return replica_cost(state, keys, num_tokens, pending, frozenset().union(*(k for _, k in sent)))


_ROUTERS = {"least_queued_tokens": LeastQueuedTokensRouter, "prefix_aware": PrefixAwareRouter}


def router_config(policy: str) -> RequestRouterConfig | None:
    """The deployment option for a config's router.policy; None keeps Serve's default (power of two choices)."""
    router = _ROUTERS.get(policy)
    if router is None:
        return None
    return RequestRouterConfig(request_router_class=router, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
