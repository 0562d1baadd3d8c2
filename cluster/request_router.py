"""Serve request router for the prefill and decode roles: least queued tokens first.

Each replica reports its engine's queued tokens (Serve calls `record_routing_stats` on it every
ROUTING_STATS_PERIOD_S); a request goes to the replica with the fewest, ties to Serve's order. Between reports the
router adds the prompt tokens it has sent a replica itself, so a burst does not all land on the same one.
"""

from __future__ import annotations

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, RequestRouter

ROUTING_STATS_PERIOD_S = 0.5


class LeastQueuedTokensRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._sent: dict[str, int] = {}  # replica id -> tokens sent to it since its last report
        self._report: dict[str, int] = {}  # replica id -> id() of the stats that report was

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        ranked = sorted(candidate_replicas, key=self._load)
        if ranked and pending_request is not None:
            key = str(ranked[0].replica_id)
            self._sent[key] = self._sent.get(key, 0) + _request_tokens(pending_request)
        return [ranked]

    def _load(self, replica) -> int:
        key, stats = str(replica.replica_id), replica.routing_stats or {}
        if self._report.get(key) != id(stats):  # a fresh report already counts what was sent before it
            self._report[key], self._sent[key] = id(stats), 0
        return int(stats.get("queued_tokens", 0)) + self._sent[key]


def _request_tokens(pending_request) -> int:
    """Prompt length of a prefill/decode call: its third positional argument is the prompt's token ids."""
    args = getattr(pending_request, "args", ()) or ()
    return len(args[1]) if len(args) > 1 and isinstance(args[1], list) else 0


def router_config(policy: str) -> RequestRouterConfig | None:
    """The deployment option for a config's router.policy; None keeps Serve's default (power of two choices)."""
    if policy != "least_queued_tokens":
        return None
    return RequestRouterConfig(request_router_class=LeastQueuedTokensRouter,
                               request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
