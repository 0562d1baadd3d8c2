"""Router: picks a worker for a request, least queued tokens first (as this owner sees them)."""

from __future__ import annotations

from typing import Any


class Router:
    """Tracks the tokens this owner has in flight on each worker; ties go to the earlier worker."""

    def __init__(self, workers: list[Any], role: str):
        if not workers:
            raise ValueError(f"no {role} workers: at least one is needed")
        self.role = role
        self.workers = list(workers)
        self._queued = [0] * len(self.workers)

    def pick(self, cost: int, exclude: tuple[int, ...] = ()) -> int:
        """Index of the least loaded worker (not in exclude); its load grows by cost until release()."""
        choices = [i for i in range(len(self.workers)) if i not in exclude]
        if not choices:
            raise RuntimeError(f"no {self.role} worker left to try")
        best = min(choices, key=lambda i: self._queued[i])
        self._queued[best] += cost
        return best

    def release(self, index: int, cost: int) -> None:
        self._queued[index] -= cost

    def queued(self) -> list[int]:
        return list(self._queued)
