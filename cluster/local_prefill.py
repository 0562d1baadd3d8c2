"""The owner's side of conditional disaggregation: whether a request is prefilled on its decode replica.

Two reasons, each with its own threshold (0: off):
- little to compute (router.max_local_prefill_tokens): the ingress's directory watch hands it the decode replicas'
  routing states (load, prefix-cache summary) every second, so deciding never waits on the store;
  cluster/routing_policy.choose_prefill decides from them. The view may be a period old: then a prompt may be
  prefilled remotely that could have been local, or locally with fewer hits than hoped.
- a backed-up prefill role (router.max_prefill_backlog_tokens): the owner counts the prompt tokens of its own requests
  waiting at prefill replicas for their first token, exact and current; at the threshold a new prompt is prefilled on
  its decode replica, as NVIDIA Dynamo's disaggregated router does past its prefill queue limit.
Either path gives the same tokens.
"""

from __future__ import annotations

from typing import Iterable

from cluster.directory import Entry
from cluster.routing_policy import PrefillChoice, ReplicaState, choose_prefill
from llmapi.result import RequestOutput


class LocalPrefill:
    """Callable on a request and the owner's prefill backlog: True to prefill it on the decode replica, False for a
    prefill replica."""

    def __init__(self, max_local_prefill_tokens: int, max_prefill_backlog_tokens: int = 0):
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.max_prefill_backlog_tokens = max_prefill_backlog_tokens
        self._states: list[ReplicaState] = []  # replaced whole, never mutated: readers need no lock

    def choose(self, result: RequestOutput, backlog_tokens: int = 0) -> PrefillChoice:
        """backlog_tokens: prompt tokens of the owner's requests still waiting at prefill replicas."""
        choice = choose_prefill(result.prompt_token_ids, result.sampling_params.cache_salt, self._states,
                                self.max_local_prefill_tokens)
        if not choice.local and 0 < self.max_prefill_backlog_tokens <= backlog_tokens:
            return PrefillChoice(True, choice.tokens_to_prefill)
        return choice

    def __call__(self, result: RequestOutput, backlog_tokens: int = 0) -> bool:
        return self.choose(result, backlog_tokens).local

    def update(self, decode_entries: Iterable[Entry]) -> None:
        """The decode replicas' latest directory entries (Directory.entries("decode"))."""
        states = (ReplicaState.from_json(e.routing) for e in decode_entries)
        self._states = [s for s in states if s is not None]

    @classmethod
    def for_config(cls, config, colocated: bool) -> LocalPrefill | None:
        """The policy of an ingress replica under `config` (a RaypdConfig); None when it never prefills locally
        (both thresholds 0, or colocated, where every request is local anyway)."""
        router = config.router
        if colocated or (router.max_local_prefill_tokens <= 0 and router.max_prefill_backlog_tokens <= 0):
            return None
        return cls(router.max_local_prefill_tokens, router.max_prefill_backlog_tokens)
