"""The replica directory: each prefill and decode replica announces itself in Ray's GCS key-value store with its
engine card (how to reach its KV) and its latest stats, and refreshes the entry every PERIOD_S.

Readers never wait on a replica: decode replicas find the prefill replicas to meet here (when they start, and as
Serve adds more), and the ingress sums each role's stats for /metrics from it. Entries carry a counter bumped on
every refresh; a reader counts an entry as live while it sees the counter move within STALE_S on its own clock, so
clocks that differ between nodes do not matter, and a replica that was killed drops out on its own.
Entries are JSON (never pickle): anyone on the cluster can write this store.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass

from ray.experimental import internal_kv

from engine.kv.kv_cache import KVLayout
from engine.kv.kv_connector import EngineCard

PERIOD_S = 1.0
STALE_S = 5.0
_NAMESPACE = "raypd"


@dataclass(frozen=True)
class Entry:
    role: str
    replica_id: str
    card: EngineCard | None
    stats: dict[str, float]
    counter: int
    peers: tuple[str, ...] = ()  # engine names of the replicas it has met
    routing: dict | None = None  # its load and prefix-cache summary (cluster/routing_policy.ReplicaState.to_json)
    problem: str | None = None  # an ingress replica's answer to /health: None when it can serve


def _key(app: str, role: str, replica_id: str = "") -> bytes:
    return f"replicas/{app}/{role}/{replica_id}".encode()


def _card_json(card: EngineCard | None) -> dict | None:
    if card is None:
        return None
    return {"name": card.name, "transport_info": base64.b64encode(card.transport_info).decode(),
            "layout": vars(card.layout), "fingerprint": card.fingerprint,
            "rank_transport_infos": [base64.b64encode(i).decode() for i in card.rank_transport_infos],
            "speculation": card.speculation}


def _card(data: dict | None) -> EngineCard | None:
    if data is None:
        return None
    return EngineCard(data["name"], base64.b64decode(data["transport_info"]), KVLayout(**data["layout"]),
                      data["fingerprint"], tuple(base64.b64decode(i) for i in data.get("rank_transport_infos", ())),
                      data.get("speculation"))


class Directory:
    """One application's replicas. Readers keep what they have seen, to tell live entries from stale ones."""

    def __init__(self, app: str = "raypd"):
        self.app = app
        self._seen: dict[bytes, tuple[int, float]] = {}  # key -> (counter, when it last moved, our clock)

    def publish(self, role: str, replica_id: str, card: EngineCard | None, stats: dict[str, float],
                counter: int, peers: tuple[str, ...] = (), routing: dict | None = None,
                problem: str | None = None) -> None:
        body = {"card": _card_json(card), "stats": stats, "counter": counter, "peers": list(peers),
                "routing": routing, "problem": problem}
        internal_kv._internal_kv_put(_key(self.app, role, replica_id), json.dumps(body), namespace=_NAMESPACE)

    def flag(self, name: bytes) -> bool:
        """Whether a flag (e.g. draining) is set for this application."""
        return internal_kv._internal_kv_exists(name, namespace=_NAMESPACE)

    def set_flag(self, name: bytes, on: bool = True) -> None:
        if on:
            internal_kv._internal_kv_put(name, b"1", namespace=_NAMESPACE)
        else:
            internal_kv._internal_kv_del(name, namespace=_NAMESPACE)

    def remove(self, role: str, replica_id: str) -> None:
        internal_kv._internal_kv_del(_key(self.app, role, replica_id), namespace=_NAMESPACE)

    def entries(self, role: str, stale_s: float = STALE_S) -> list[Entry]:
        """The role's live replicas (an entry is live until its counter has not moved for stale_s)."""
        now, live = time.monotonic(), []
        for key in internal_kv._internal_kv_list(_key(self.app, role), namespace=_NAMESPACE):
            raw = internal_kv._internal_kv_get(key, namespace=_NAMESPACE)
            if raw is None:
                continue
            try:
                body = json.loads(raw)
                entry = Entry(role, key.decode().rsplit("/", 1)[1], _card(body["card"]), dict(body["stats"]),
                              int(body["counter"]), tuple(body.get("peers", ())), body.get("routing"),
                              body.get("problem"))
            except (ValueError, KeyError, TypeError):
                continue  # not written by a replica of ours
            counter, moved = self._seen.get(key, (None, now))
            if counter != entry.counter:
                moved = now
            self._seen[key] = (entry.counter, moved)
            if now - moved < stale_s:
                live.append(entry)
        return live

    def totals(self, role: str) -> dict[str, float]:
        """The role's stats summed over its live replicas, and how many there are (`replicas`)."""
        entries = self.entries(role)
        total: dict[str, float] = {"replicas": float(len(entries))}
        for entry in entries:
            for name, value in entry.stats.items():
                total[name] = total.get(name, 0.0) + float(value)
        return total
