"""The encoder, prefill and decode roles as Serve replicas: the workers themselves, plus membership in the replica
directory.

A replica publishes its engine card and stats every directory.PERIOD_S. A decode replica meets every prefill replica
it finds there before it serves (and each one Serve adds later, within a period), so an incompatible pair is refused
when they meet, not at the first transfer.

A prefill or encoder replica that Serve stops (a scale-down, a redeploy) leaves the directory, then waits until what it
leased (KV blocks, image embeddings) has been read or released, at most the lease (`drain`): Serve sends it no new
calls meanwhile, so no request re-prefills because of a scale-down. Its deployment's graceful_shutdown_timeout_s
leaves room for that (cluster/serving/app.py). When the whole application stops (`serve delete`, Ctrl-C on `serve
run`) nobody is left to read them, and it stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Callable, TypeVar

import ray
from ray import serve
from ray.serve.schema import ApplicationStatus

from cluster.serving.directory import PERIOD_S, Directory
from cluster.serving.nice import apply_nice
from cluster.routing.policy import replica_state
from decode.worker import DecodeWorker
from encoder.worker import EncoderWorker
from engine.multimodal.encoder import EncoderConfig
from engine.core.engine import EngineConfig
from engine.core.worker import EngineWorker
from engine.parallel.ranks import RankFailed
from protocol import PipeAddr
from prefill.worker import PrefillWorker
from replica.engine_replica import EngineReplica

log = logging.getLogger(__name__)


_POSTPROC_CALL_S = 2.0
DRAIN_MARGIN_S = 2.0  # past the lease: an expired lease is noticed at the engine's next look
_DRAIN_LOOK_S = 2.0
_DRAIN_POLL_S = 0.2
T = TypeVar("T")


async def drain(held: Callable[[], int], what: str, within_s: float, app: str) -> None:
    """Waits until held() (the replica's leases) is 0, at most within_s, unless application `app` is being deleted.
    Every look is bounded (_DRAIN_LOOK_S) and the first that fails or runs late ends the drain: it may leave leases
    unread (their requests re-prefill, as after a lost replica), never hold up a stop past its bound."""
    deadline, left = time.monotonic() + within_s, 0
    try:
        while (left := await _look(held)) and time.monotonic() < deadline:
            if await _look(lambda: _deleting(app)):
                return
            await asyncio.sleep(_DRAIN_POLL_S)
    except Exception as exc:  # the engine, Ray or Serve is going away: nothing left to wait for
        log.info("stopping without waiting for %s: %r", what, exc)
        return
    if left:
        log.warning("stopping with %d %s still held after %.0f s (their requests re-prefill or fail as after a lost "
                    "replica)", left, what, within_s)


async def _look(fn: Callable[[], T]) -> T:
    return await asyncio.wait_for(asyncio.to_thread(fn), _DRAIN_LOOK_S)


def _deleting(app: str) -> bool:
    """Whether Serve is deleting application `app` (or has: it is gone), as its controller says."""
    found = serve.status().applications.get(app)
    return found is None or found.status == ApplicationStatus.DELETING


def postproc_addrs(postprocs: list, timeout: float = 60.0) -> list[PipeAddr]:
    """The postproc workers' current pull pipes (a restarted worker has a new one)."""
    return ray.get([p.pull_pipe_addr.remote() for p in postprocs], timeout=timeout)


class Membership:
    """A background thread that keeps `worker` in the directory under `role`, meeting the replicas of `meets`, and
    follows the postproc workers to their new pipes when Ray restarts them."""

    def __init__(self, worker: EngineReplica | EncoderWorker, role: str, meets: str | None, postprocs: list):
        self.worker, self.role, self.meets, self.postprocs = worker, role, meets, postprocs
        replica = serve.get_replica_context().replica_id
        self.directory = Directory(replica.deployment_id.app_name)  # the replicas of this Serve application
        self.replica_id = replica.unique_id
        self._met: dict[str, str | None] = {}  # peer engine name -> None (met) or why it was refused
        self._counter = 0
        # What tend() last found, published by beat(): replaced whole, never mutated, so the two threads share it
        # safely (tend mutates _met; beat must not iterate it).
        self._card, self._stats, self._routing, self._peers = worker.card(), {}, None, ()
        self._stop = threading.Event()
        self.tend()  # before serving: known peers met, this replica visible
        self.beat()
        # Two threads: the heartbeat never waits on the engine loop or a busy postproc worker, so a replica under
        # load never looks dead to readers.
        self._threads = [threading.Thread(target=self._every_period, args=(fn,), name=f"raypd-{role}-{fn.__name__}",
                                          daemon=True) for fn in (self.beat, self.tend)]
        for thread in self._threads:
            thread.start()

    def tend(self) -> None:
        """The slow part: meet new peers, follow restarted postproc workers, read the engine's stats."""
        if self.meets is not None:
            self._meet_new()
        self._follow_postprocs()
        self._peers = tuple(name for name, why in self._met.items() if why is None)
        met = len(self._peers)
        self._stats = dict(self.worker.stats(), peers_met=met, peers_refused=len(self._met) - met)
        if isinstance(self.worker, EngineWorker):  # an encoder holds no prefix cache to route by
            self._routing = replica_state(self.role, *self.worker.cache_snapshot()).to_json()

    def beat(self) -> None:
        """Publish the entry (the counter moves; stats are the latest tend's)."""
        self._counter += 1
        self.directory.publish(self.role, self.replica_id, self._card, self._stats, self._counter, self._peers,
                               self._routing)

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

    def _follow_postprocs(self) -> None:
        for i, actor in enumerate(self.postprocs):
            try:
                addr = tuple(ray.get(actor.pull_pipe_addr.remote(), timeout=_POSTPROC_CALL_S))
            except Exception:  # down or restarting: its requests fail fast meanwhile (PostprocSender)
                continue
            if addr != tuple(self.worker.postproc_addrs[i]):
                log.warning("%s replica %s: postproc worker %d is back at a new pipe", self.role, self.replica_id, i)
                self.worker.reconnect_postproc(i, addr)

    def _every_period(self, fn) -> None:
        while not self._stop.wait(PERIOD_S):
            try:
                fn()
            except Exception as exc:  # the directory or the engine is briefly unavailable: keep trying
                log.warning("%s replica %s: directory %s failed: %s", self.role, self.replica_id, fn.__name__, exc)

    def leave(self) -> None:
        self._stop.set()
        try:
            self.directory.remove(self.role, self.replica_id)
        except Exception:  # Ray may already be going down; the entry goes stale on its own
            pass


def routing_stats(worker: EngineWorker, role: str) -> dict:
    """What the replica tells Serve's request routers (cluster/routing/request_router.py): its queued tokens, and its
    load and prefix-cache summary (cluster/routing/policy.py)."""
    keys, load = worker.cache_snapshot()
    return {"queued_tokens": load["queued_tokens"], **replica_state(role, keys, load).to_stats()}


class RayRanks:
    """For prefill and decode replicas: tensor-parallel ranks 1..N-1 as actors in the replica's placement group, and
    a replica that is gone as a whole when one of them is: Serve then replaces the group, and owners resume what was
    in flight here elsewhere, as for any lost replica (failing the requests instead would end them with an error)."""

    def _start_ranks(self, model_dir: str, config: EngineConfig):
        if config.tensor_parallel_size == 1:
            return None
        from cluster.serving.ranks import start_ray_ranks

        return start_ray_ranks(model_dir, config, serve.get_replica_context().replica_id.to_full_id_str())

    def check_health(self) -> None:
        ranks = self.loop.engine.ranks
        gone = ranks.exited() if ranks is not None else {}
        if gone:
            self._leave(RankFailed(f"tensor-parallel ranks gone: {gone}"))
        super().check_health()

    def _fail_all(self, exc: BaseException) -> None:
        if isinstance(exc, RankFailed):
            self._leave(exc)
        super()._fail_all(exc)

    def _leave(self, why: BaseException) -> None:
        log.error("this replica's engine lost a tensor-parallel rank (%s): the replica exits so that Serve replaces "
                  "it whole and its requests resume elsewhere", why)
        logging.shutdown()
        os._exit(1)


class PrefillReplica(RayRanks, PrefillWorker):
    def __init__(self, model_dir: str, config: EngineConfig, postprocs: list | None = None):
        apply_nice()  # before the engine starts its threads
        postprocs = list(postprocs or [])
        super().__init__(model_dir, config, postproc_addrs(postprocs))
        self._membership = Membership(self, "prefill", None, postprocs)

    def record_routing_stats(self) -> dict:
        return routing_stats(self, "prefill")

    async def __del__(self):  # Serve awaits it when it stops the replica
        if hasattr(self, "_membership"):
            self._membership.leave()
            config = self.loop.engine.config
            await drain(lambda: self.loop.call(lambda e: e.connector.stats().leases, timeout=_DRAIN_LOOK_S),
                        "KV leases", config.kv_lease_s + DRAIN_MARGIN_S, self._membership.directory.app)


class DecodeReplica(RayRanks, DecodeWorker):
    def __init__(self, model_dir: str, config: EngineConfig, postprocs: list | None = None):
        apply_nice()  # before the engine starts its threads
        postprocs = list(postprocs or [])
        # named in Accepted: direct starts find this replica by it
        name = serve.get_replica_context().replica_id.unique_id
        super().__init__(model_dir, config, postproc_addrs(postprocs), replica_name=name)
        self._membership = Membership(self, "decode", "prefill", postprocs)

    def record_routing_stats(self) -> dict:
        return routing_stats(self, "decode")

    def __del__(self):
        if hasattr(self, "_membership"):
            self._membership.leave()


class EncoderReplica(EncoderWorker):
    """Listed in the directory for its stats only: prefill workers reach its arena through the handles it makes."""

    def __init__(self, model_dir: str, config: EncoderConfig):
        apply_nice()
        super().__init__(model_dir, config)
        self._membership = Membership(self, "encoder", None, [])
        self._lease_s = config.lease_s

    async def __del__(self):  # Serve awaits it when it stops the replica
        if hasattr(self, "_membership"):
            self._membership.leave()
            await drain(lambda: self.engine.stats()["encoder_leases"], "embedding leases",
                        self._lease_s + DRAIN_MARGIN_S, self._membership.directory.app)
