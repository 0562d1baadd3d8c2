"""The decode role: generation-only requests, whose prompt KV is read from a prefill replica over NIXL, then decoded
with continuous batching; and whole requests (colocated mode, and the owner's way out when no prefill replica is up).
A thin adapter of the role-neutral EngineReplica."""

from __future__ import annotations

from engine.core.engine import EngineConfig
from protocol import PipeAddr
from replica.engine_replica import EngineReplica

KINDS = ("generation_only", "context_and_generation")


class DecodeWorker(EngineReplica):
    def __init__(self, model_dir: str, config: EngineConfig, postproc_addrs: list[PipeAddr] | None = None,
                 host: str | None = None, replica_name: str | None = None):
        super().__init__(model_dir, config, postproc_addrs, host, KINDS, replica_name)
