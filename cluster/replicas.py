"""The prefill and decode roles as Serve replicas: the workers themselves, plus membership in the replica directory.

A replica publishes its engine card and stats every directory.PERIOD_S. A decode replica meets every prefill replica
it finds there before it serves (and each one Serve adds later, within a period), so an incompatible pair is refused
when they meet, not at the first transfer.
"""

from __future__ import annotations

import logging
import threading

from ray import serve

from cluster.directory import PERIOD_S, Directory
from cluster.routing_policy import replica_state
from decode.worker import DecodeWorker
from engine.engine import EngineConfig
from engine.worker import EngineWorker
from postproc.pipes import PipeAddr
from prefill.worker import PrefillWorker

log = logging.getLogger(__name__)


class Membership:
    """A background thread that keeps `worker` in the directory under `role`, meeting the replicas of `meets`."""

    def __init__(self, worker: EngineWorker, role: str, meets: str | None):
        self.worker, self.role, self.meets = worker, role, meets
        replica = serve.get_replica_context().replica_id
        self.directory = Directory(replica.deployment_id.app_name)  # the replicas of this Serve application
        self.replica_id = replica.unique_id
        self._met: dict[str, str | None] = {}  # peer engine name -> None (met) or why it was refused
        self._counter = 0
        self._stop = threading.Event()
        self.refresh()  # before serving: known peers met, this replica visible
        self._thread = threading.Thread(target=self._run, name=f"raypd-{role}-directory", daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        if self.meets is not None:
            self._meet_new()
        self._counter += 1
        refused = sum(1 for why in self._met.values() if why)
        stats = dict(self.worker.stats(), peers_met=len(self._met) - refused, peers_refused=refused)
        met = tuple(name for name, why in self._met.items() if why is None)
        routing = replica_state(self.role, *self.worker.cache_snapshot()).to_json()
        self.directory.publish(self.role, self.replica_id, self.worker.card(), stats, self._counter, met, routing)

    def _meet_new(self) -> None:
        for entry in self.directory.entries(self.meets):
            if entry.card is None or entry.card.name in self._met:
                continue
            try:
                self.worker.meet(entry.card)
                self._met[entry.card.name] = None
            except ValueError as exc:  # incompatible: refused now, named in the log, never read from
                self._met[entry.card.name] = str(exc)
                log.error("%s replica %s refuses %s replica %s: %s", self.role, self.replica_id, self.meets,
                          entry.replica_id, exc)
            except Exception as exc:  # unreachable for now: try again next period
                log.warning("could not meet %s replica %s yet: %s", self.meets, entry.replica_id, exc)

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            try:
                self.refresh()
            except Exception as exc:  # the directory or the engine is briefly unavailable: keep trying
                log.warning("%s replica %s: directory refresh failed: %s", self.role, self.replica_id, exc)

    def leave(self) -> None:
        self._stop.set()
        try:
            self.directory.remove(self.role, self.replica_id)
        except Exception:  # Ray may already be going down; the entry goes stale on its own
            pass


def routing_stats(worker: EngineWorker, role: str) -> dict:
    """What the replica tells Serve's request routers (cluster/request_router.py): its queued tokens, and its load
    and prefix-cache summary (cluster/routing_policy.py)."""
    keys, load = worker.cache_snapshot()
    return {"queued_tokens": load["queued_tokens"], **replica_state(role, keys, load).to_stats()}


class PrefillReplica(PrefillWorker):
    def __init__(self, model_dir: str, config: EngineConfig):
        super().__init__(model_dir, config)
        self._membership = Membership(self, "prefill", None)

    def record_routing_stats(self) -> dict:
        return routing_stats(self, "prefill")

    def __del__(self):
        if hasattr(self, "_membership"):
            self._membership.leave()


class DecodeReplica(DecodeWorker):
    def __init__(self, model_dir: str, config: EngineConfig, postproc_addrs: list[PipeAddr] | None = None):
        super().__init__(model_dir, config, postproc_addrs)
        self._membership = Membership(self, "decode", "prefill")

    def record_routing_stats(self) -> dict:
        return routing_stats(self, "decode")

    def __del__(self):
        if hasattr(self, "_membership"):
            self._membership.leave()
