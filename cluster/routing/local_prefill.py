"""The owner's side of conditional disaggregation: whether a request is prefilled on its decode replica.

Three reasons, each with its own setting (0 or false: off):
- little to compute (router.max_local_prefill_tokens): the ingress's directory watch hands it the decode replicas'
  routing states (load, prefix-cache summary) every second, so deciding never waits on the store;
  cluster.routing.policy.choose_prefill decides from them. The view may be a period old: then a prompt may be
  prefilled remotely that could have been local, or locally with fewer hits than hoped.
- a backed-up prefill role (router.max_prefill_backlog_tokens): the owner counts the prompt tokens of its own requests
  waiting at prefill replicas for their first token, exact and current; at the threshold a new prompt is prefilled on
  its decode replica, as NVIDIA Dynamo's disaggregated router does past its prefill queue limit.
- an idle ingress (router.local_prefill_when_idle): a prompt that arrives while its ingress replica serves no other
  request finds no decode step of its to hold up; prefilled where it decodes, it skips the prefill hop, the KV
  transfer and a prefill engine that has idled (cold: on a Sapphire Rapids VM the same matmuls ran 40-60% slower
  after a few hundred ms of rest). Like the backlog, what other ingress replicas run on the decode replicas is not seen.
Either path gives the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from cluster.serving.directory import Entry
from cluster.routing.policy import PrefillChoice, ReplicaState, choose_prefill
from llmapi.result import RequestOutput


@dataclass(frozen=True)
class OwnerLoad:
    """What an owner serves when a new request arrives (the new one not counted)."""

    serving: int  # requests, at any stage
    prefill_backlog_tokens: int  # prompt tokens of those waiting at prefill replicas for their first token


class LocalPrefill:
    """Callable on a request and its owner's load: True to prefill it on the decode replica, False for a prefill
    replica."""

    def __init__(self, max_local_prefill_tokens: int, max_prefill_backlog_tokens: int = 0,
                 when_idle: bool = False):
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.max_prefill_backlog_tokens = max_prefill_backlog_tokens
        self.when_idle = when_idle
        self._states: list[ReplicaState] = []  # replaced whole, never mutated: readers need no lock

    def choose(self, result: RequestOutput, load: OwnerLoad) -> PrefillChoice:
        choice = choose_prefill(result.prompt_token_ids, result.sampling_params.cache_salt, self._states,
                                self.max_local_prefill_tokens)
        busy = 0 < self.max_prefill_backlog_tokens <= load.prefill_backlog_tokens
        if not choice.local and (busy or (self.when_idle and load.serving == 0)):
            return PrefillChoice(True, choice.tokens_to_prefill)
        return choice

    def __call__(self, result: RequestOutput, load: OwnerLoad) -> bool:
        return self.choose(result, load).local

    def update(self, decode_entries: Iterable[Entry]) -> None:
        """The decode replicas' latest directory entries (Directory.entries("decode"))."""
        states = (ReplicaState.from_json(e.routing) for e in decode_entries)
        self._states = [s for s in states if s is not None]

    @classmethod
    def for_config(cls, config, colocated: bool) -> LocalPrefill | None:
        """The policy of an ingress replica under `config` (a RaypdConfig); None when it never prefills locally
        (every rule off, or colocated, where every request is local anyway)."""
        router = config.router
        if colocated or (router.max_local_prefill_tokens <= 0 and router.max_prefill_backlog_tokens <= 0
                         and not router.local_prefill_when_idle):
            return None
        return cls(router.max_local_prefill_tokens, router.max_prefill_backlog_tokens, router.local_prefill_when_idle)
