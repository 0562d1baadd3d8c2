"""The prefill role: context-only requests. Computes a prompt's KV and first token(s); the blocks wait under a lease
for a decode replica to read them. An owner that leaves after the hand-off sends Abort, which ends the lease; a call
cancelled before the owner got the hand-off ends the lease here. Its engine serves whole requests too: the owner's way
out when no decode replica is up. A thin adapter of the role-neutral EngineReplica."""

from __future__ import annotations

from engine.core.engine import EngineConfig
from protocol import PipeAddr
from replica.engine_replica import EngineReplica

KINDS = ("context_only", "context_and_generation")


class PrefillWorker(EngineReplica):
    def __init__(self, model_dir: str, config: EngineConfig, postproc_addrs: list[PipeAddr] | None = None,
                 host: str | None = None, replica_name: str | None = None):
        super().__init__(model_dir, config, postproc_addrs, host, KINDS, replica_name)
