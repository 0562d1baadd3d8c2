"""The owner's side of conditional disaggregation: whether a request is prefilled on its decode replica.

A background thread keeps the decode replicas' routing states (load, prefix-cache summary) from the replica directory,
so deciding never waits on the store; cluster/routing_policy.choose_prefill decides from them. The view may be a
period old: then a prompt may be prefilled remotely that could have been local, or locally with fewer hits than
hoped. Either path gives the same tokens.
"""

from __future__ import annotations

import logging
import threading

from cluster.directory import PERIOD_S, Directory
from cluster.routing_policy import PrefillChoice, ReplicaState, choose_prefill
from llmapi.result import RequestOutput

log = logging.getLogger(__name__)


class LocalPrefill:
    """Callable on a request: True to prefill it on the decode replica, False for a prefill replica."""

    def __init__(self, directory: Directory, max_local_prefill_tokens: int, period_s: float = PERIOD_S):
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self._directory = directory
        self._states: list[ReplicaState] = []  # replaced whole, never mutated: readers need no lock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), name="raypd-local-prefill", daemon=True)
        self._thread.start()

    def choose(self, result: RequestOutput) -> PrefillChoice:
        return choose_prefill(result.prompt_token_ids, result.sampling_params.cache_salt, self._states,
                              self.max_local_prefill_tokens)

    def __call__(self, result: RequestOutput) -> bool:
        return self.choose(result).local

    def refresh(self) -> None:
        states = (ReplicaState.from_json(e.routing) for e in self._directory.entries("decode"))
        self._states = [s for s in states if s is not None]

    def _run(self, period_s: float) -> None:
        while True:
            try:
                self.refresh()
            except Exception as exc:  # the store is briefly unreachable: decide from the last view meanwhile
                log.warning("local prefill: cannot read the decode replicas' states: %s", exc)
            if self._stop.wait(period_s):
                return

    def close(self) -> None:
        self._stop.set()

    @classmethod
    def for_config(cls, config, colocated: bool) -> LocalPrefill | None:
        """The policy of a Serve ingress replica under `config` (a RaypdConfig); None when it never prefills locally
        (router.max_local_prefill_tokens 0, or colocated, where every request is local anyway)."""
        if colocated or config.router.max_local_prefill_tokens <= 0:
            return None
        from ray import serve

        app = serve.get_replica_context().replica_id.deployment_id.app_name
        return cls(Directory(app), config.router.max_local_prefill_tokens)
