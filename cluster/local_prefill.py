"""The owner's side of conditional disaggregation: whether a request is prefilled on its decode replica.

The ingress's directory watch hands it the decode replicas' routing states (load, prefix-cache summary) every second,
so deciding never waits on the store; cluster/routing_policy.choose_prefill decides from them. The view may be a
period old: then a prompt may be prefilled remotely that could have been local, or locally with fewer hits than
hoped. Either path gives the same tokens.
"""

from __future__ import annotations

from typing import Iterable

from cluster.directory import Entry
from cluster.routing_policy import PrefillChoice, ReplicaState, choose_prefill
from llmapi.result import RequestOutput


class LocalPrefill:
    """Callable on a request: True to prefill it on the decode replica, False for a prefill replica."""

    def __init__(self, max_local_prefill_tokens: int):
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self._states: list[ReplicaState] = []  # replaced whole, never mutated: readers need no lock

    def choose(self, result: RequestOutput) -> PrefillChoice:
        return choose_prefill(result.prompt_token_ids, result.sampling_params.cache_salt, self._states,
                              self.max_local_prefill_tokens)

    def __call__(self, result: RequestOutput) -> bool:
        return self.choose(result).local

    def update(self, decode_entries: Iterable[Entry]) -> None:
        """The decode replicas' latest directory entries (Directory.entries("decode"))."""
        states = (ReplicaState.from_json(e.routing) for e in decode_entries)
        self._states = [s for s in states if s is not None]

    @classmethod
    def for_config(cls, config, colocated: bool) -> LocalPrefill | None:
        """The policy of an ingress replica under `config` (a RaypdConfig); None when it never prefills locally
        (router.max_local_prefill_tokens 0, or colocated, where every request is local anyway)."""
        if colocated or config.router.max_local_prefill_tokens <= 0:
            return None
        return cls(config.router.max_local_prefill_tokens)
