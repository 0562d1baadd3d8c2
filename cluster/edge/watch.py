"""What an ingress replica learns from the replica directory every second, in the background so that /health and
/metrics never wait: each role's replicas and stats, the decode replicas conditional disaggregation and direct starts
weigh, whether a role is missing or the server is draining (admission sheds then); and it publishes its own entry,
with what its /health would answer, for cluster.serving.health."""

from __future__ import annotations

import asyncio
from typing import Callable

from cluster.edge.checks import Admission
from cluster.owner.owner import RequestOwner
from cluster.routing.local_prefill import LocalPrefill
from cluster.serving.directory import Directory

WATCH_S = 1.0
DRAINING_KEY = b"draining/"  # + app name, in the replica directory's namespace: set by `raypd serve` on SIGTERM


class DirectoryWatch:
    """roles: the roles this deployment has; problem: what the replica's /health would answer."""

    def __init__(self, app_name: str, replica_id: str, roles: list[str], admission: Admission, owner: RequestOwner,
                 local_prefill: LocalPrefill | None, problem: Callable[[], str | None]):
        self._app_name, self._replica_id, self._roles = app_name, replica_id, roles
        self._admission, self._owner, self._local_prefill, self._problem = admission, owner, local_prefill, problem
        self._directory = Directory(app_name)
        self.role_stats: dict[str, dict[str, float]] = {}
        self._seen_live: set[str] = set()
        self._published = 0

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.look)
            except Exception:  # the directory is briefly unreachable: keep the last view
                pass
            await asyncio.sleep(WATCH_S)

    def look(self) -> None:
        self.role_stats = {role: self._directory.totals(role) for role in self._roles}
        direct = self._owner.direct
        decode = self._directory.entries("decode") if self._local_prefill or direct else []
        if self._local_prefill is not None:
            self._local_prefill.update(decode)
        if direct is not None:
            direct.update(decode)
        self._seen_live.update(role for role, stats in self.role_stats.items() if stats["replicas"])
        # A role counts as missing once it has been seen and is gone; before its first replica registers, Serve
        # itself holds requests until one is up.
        missing = [role for role in self._seen_live if not self.role_stats[role]["replicas"]]
        self._admission.degraded = f"the {' and '.join(missing)} role has no live replica" if missing else None
        # Any engine can serve a whole request: only with no replica of any role left is there nothing to serve on.
        closed = "no prefill or decode replica is live" if len(missing) == len(self._roles) else None
        if self._directory.flag(DRAINING_KEY + self._app_name.encode()):
            closed = "the server is shutting down"
        self._admission.closed = closed
        self._published += 1
        self._directory.publish("ingress", self._replica_id, None, {"in_flight": self._admission.requests},
                                self._published, problem=self._problem())
