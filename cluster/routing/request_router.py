"""Serve request routers for the prefill and decode roles (`router.policy` in the YAML).

Serve calls `record_routing_stats` on every replica each ROUTING_STATS_PERIOD_S and hands the latest report to the
router in each caller's process. Between reports a router adds what it has sent a replica and is still in flight, so a
burst does not all land on the same one. A router returns one replica per rank, best first: Serve sends to the first
whose queue is not full (within a rank it would pick by ongoing requests instead, undoing the ranking). Neither
router uses Serve's FIFOMixin: the replica chosen for a request must serve that request, not whichever is oldest.

- least_queued_tokens: the replica whose engine has the fewest queued tokens.
- prefix_aware: the replica with the lowest cost for this prompt (cluster/routing/policy.py: prompt tokens left to
  compute after its prefix-cache hit, plus its load), from each replica's Bloom filter of cached block keys.
"""

from __future__ import annotations

import random
import time

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import RequestRouter

from cluster.routing.policy import ReplicaState, prompt_block_keys, uncached_tokens
from protocol import Submit

ROUTING_STATS_PERIOD_S = 0.5
# A prompt's blocks count as cached where it was sent until a report of that replica shows them. Reports reach the
# routers through the Serve controller, seconds late on a busy machine; past this the blocks are taken for evicted.
_SENT_KEYS_TTL_S = 30.0


def _request_prompt(pending_request) -> tuple[list[int], str | None]:
    """(prompt token ids, cache salt) of a prefill/decode call (a serve(Submit) call; anything else: none)."""
    args = getattr(pending_request, "args", ()) or ()
    if not args or not isinstance(args[0], Submit):
        return [], None
    return args[0].prompt_token_ids, args[0].params.cache_salt


class _Sent:
    """Tokens a router sent each replica that the replica's latest report cannot show: sent after that report, and
    not yet completed (Serve calls on_request_completed for every request it dispatched)."""

    def __init__(self):
        self._requests: dict[str, tuple[str, int]] = {}  # request's internal id -> (replica id, tokens)
        # replica id -> its latest report, the object itself: a bare id() may be handed to a later report once the
        # one it named is freed, and that report would then pass for a seen one (its Bloom filter and load unread).
        self._reports: dict[str, object] = {}

    def add(self, replica: str, pending_request, tokens: int) -> None:
        self._requests[_internal_id(pending_request)] = (replica, tokens)

    def done(self, internal_request_id: str) -> None:
        self._requests.pop(internal_request_id, None)

    def report(self, replica: str, stats) -> bool:
        """Notes the replica's current report; True (and forgets what was sent before it) when it is a new one."""
        if self._reports.get(replica) is stats:
            return False
        self._reports[replica] = stats
        self._requests = {k: v for k, v in self._requests.items() if v[0] != replica}
        return True

    def tokens(self, replica: str) -> int:
        return sum(tokens for r, tokens in self._requests.values() if r == replica)


def _internal_id(pending_request) -> str:
    metadata = getattr(pending_request, "metadata", None)
    return getattr(metadata, "internal_request_id", None) or str(id(pending_request))


class LeastQueuedTokensRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._sent = _Sent()

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        ranked = sorted(candidate_replicas, key=self._load)
        if ranked and pending_request is not None:
            self._sent.add(str(ranked[0].replica_id), pending_request, len(_request_prompt(pending_request)[0]))
        return [[r] for r in ranked]

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._sent.done(internal_request_id)

    def _load(self, replica) -> int:
        key, stats = str(replica.replica_id), replica.routing_stats or {}
        self._sent.report(key, replica.routing_stats)
        return int(stats.get("queued_tokens", 0)) + self._sent.tokens(key)


class PrefixAwareRouter(RequestRouter):
    """Sends each prompt where it costs least: its uncached tokens there plus the replica's load (ties to the one
    that reuses more, then at random, so an idle pool spreads work). What is in flight to a replica counts as load
    until its next report, as the tokens it must compute there; the blocks of prompts sent there count as cached
    there until a report shows them (they will be by the time a follow-up runs), so a burst of one conversation
    stays together however late the reports come."""

    def initialize_state(self, **kwargs) -> None:
        self._states: dict[str, ReplicaState | None] = {}  # replica id -> its latest report, parsed
        self._sent = _Sent()
        self._sent_keys: dict[str, list[tuple[float, frozenset[bytes], bytes]]] = {}  # replica -> (when, keys, last)
        self._rng = random.Random()

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        ids, salt = _request_prompt(pending_request)
        now = time.monotonic()
        states = {str(r.replica_id): self._state(r) for r in candidate_replicas}
        block_size = next((s.block_size for s in states.values() if s is not None), None)
        keys = prompt_block_keys(ids, block_size, salt) if block_size and ids else []
        work = {key: self._work(key, state, keys, len(ids), now) for key, state in states.items()}
        # equal cost: the one that reuses more (less compute overall), then at random
        order = {key: (sum(w), w[0], self._rng.random()) for key, w in work.items()}
        ranked = sorted(candidate_replicas, key=lambda r: order[str(r.replica_id)])
        if ranked and pending_request is not None:
            best = str(ranked[0].replica_id)
            self._sent.add(best, pending_request, work[best][0])
            if keys:
                self._sent_keys.setdefault(best, []).append((now, frozenset(keys), keys[-1]))
        return [[r] for r in ranked]

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._sent.done(internal_request_id)

    def _state(self, replica) -> ReplicaState | None:
        key, stats = str(replica.replica_id), replica.routing_stats
        if self._sent.report(key, stats) or key not in self._states:
            state = self._states[key] = ReplicaState.from_stats(stats)
            if state is not None:  # what this report shows cached need not be remembered any longer
                self._sent_keys[key] = [sent for sent in self._sent_keys.get(key, ()) if sent[2] not in state.summary]
        return self._states[key]

    def _work(self, replica: str, state: ReplicaState | None, keys: list[bytes], num_tokens: int,
              now: float) -> tuple[int, int]:
        """(prompt tokens the replica would compute, its load in tokens); their sum is its cost."""
        recent = [sent for sent in self._sent_keys.get(replica, ()) if now - sent[0] < _SENT_KEYS_TTL_S]
        self._sent_keys[replica] = recent
        pending = self._sent.tokens(replica)
        if state is None:  # not reported yet: only what this router sent it is known
            return num_tokens, pending
        uncached = uncached_tokens(state, keys, num_tokens, frozenset().union(*(sent[1] for sent in recent)))
        return uncached, state.load_tokens + pending


_ROUTERS = {"least_queued_tokens": LeastQueuedTokensRouter, "prefix_aware": PrefixAwareRouter}


def router_config(policy: str) -> RequestRouterConfig | None:
    """The deployment option for a config's router.policy; None keeps Serve's default (power of two choices)."""
    router = _ROUTERS.get(policy)
    if router is None:
        return None
    return RequestRouterConfig(request_router_class=router, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
