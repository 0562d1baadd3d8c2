"""Disaggregation inside one engine: leases on the prefill side, KV imports on the decode side.

Prefill: a context-only request's prompt blocks stay allocated under a lease until the decode side's release
notification arrives or the lease ends. Decode: a generation-only request READs those blocks into its own, then reads
the blocks' generation numbers; a number that changed means the block was freed and reused during the read, so the
request re-prefills locally instead of decoding from foreign KV. Expired leases, dead peers and transfer timeouts
take the same way out: the decode side recomputes the prompt, and the request still completes with the same tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.kv_handle import KVHandle
from engine.kv_transfer import KVTransport, ReadHandle, TransferError
from engine.request import Sequence
from engine.scheduler import Scheduler

log = logging.getLogger(__name__)

RELEASE = b"raypd.release:"
# A lease with less than this left is not read: the read could outlive it.
LEASE_MARGIN_S = 1.0


def release_message(ctx_request_id: int) -> bytes:
    return RELEASE + str(ctx_request_id).encode()


class LeaseTable:
    """Prefill side: blocks of finished context-only requests, held for the decode side to read."""

    def __init__(self, scheduler: Scheduler, lease_seconds: float):
        self.scheduler = scheduler
        self.lease_seconds = lease_seconds
        self._held: dict[int, tuple[Sequence, float]] = {}  # ctx request id -> (sequence, monotonic deadline)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, ctx_request_id: int, seq: Sequence) -> float:
        """Keeps seq's blocks past its end; returns the lease deadline on this host's wall clock."""
        self.scheduler.detach(seq)
        self._held[ctx_request_id] = (seq, time.monotonic() + self.lease_seconds)
        return time.time() + self.lease_seconds

    def release(self, ctx_request_id: int) -> None:
        """Frees the request's blocks. Idempotent: a late or repeated release does nothing."""
        entry = self._held.pop(ctx_request_id, None)
        if entry is not None:
            self.scheduler.block_manager.free(entry[0])

    def on_notifications(self, notifications: dict[str, list[bytes]]) -> None:
        for messages in notifications.values():
            for message in messages:
                if message.startswith(RELEASE) and message[len(RELEASE):].isdigit():
                    self.release(int(message[len(RELEASE):]))

    def expire(self) -> None:
        now = time.monotonic()
        for ctx_id in [c for c, (_, deadline) in self._held.items() if deadline <= now]:
            log.warning("KV lease of context request %d expired before the decode side released it", ctx_id)
            self.release(ctx_id)


@dataclass(eq=False)
class KVImport:
    """A generation-only request whose prompt KV is on its way from a prefill engine."""

    seq: Sequence
    handle: KVHandle
    deadline: float  # time.monotonic()
    read: ReadHandle | None = None
    stage: str = "blocks"  # then "generations"
    started: float = 0.0  # when the first read was posted


class KVImporter:
    """Decode side: reads prompt blocks named by KV handles into this engine's pool, without blocking the loop."""

    def __init__(self, block_manager: BlockManager, transport: KVTransport, timeout_s: float):
        self.block_manager = block_manager
        self.transport = transport
        self.timeout_s = timeout_s
        self.waiting: list[KVImport] = []  # no free blocks yet
        self.active: list[KVImport] = []
        self.bytes_read = 0  # KV bytes of completed, validated imports
        self.last_import_s = 0.0  # duration of the latest one, first read posted to validated

    def add(self, seq: Sequence, handle: KVHandle) -> None:
        self.waiting.append(KVImport(seq, handle, time.monotonic() + self.timeout_s))

    def cancel(self, seq: Sequence) -> None:
        """Drops seq's import (the request was aborted); the caller frees its blocks."""
        for imp in [i for i in self.waiting + self.active if i.seq is seq]:
            if imp.read is not None:
                self.transport.cancel(imp.read)
            (self.waiting if imp in self.waiting else self.active).remove(imp)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.active)

    def poll(self) -> list[tuple[Sequence, str | None]]:
        """Advances every import; returns the finished ones with None (KV in place) or why they must re-prefill."""
        done = self._start_waiting()
        for imp in list(self.active):
            outcome = self._advance(imp)
            if outcome is not False:
                self.active.remove(imp)
                done.append((imp.seq, outcome))
        return done

    def _start_waiting(self) -> list[tuple[Sequence, str | None]]:
        failed = []
        for imp in list(self.waiting):
            left = imp.handle.lease_deadline - time.time()
            if left < LEASE_MARGIN_S:
                self.waiting.remove(imp)
                failed.append((imp.seq, f"the KV lease of context request {imp.handle.ctx_request_id} had "
                                        f"{left:.1f} s left, too little to read it"))
                continue
            if not self.block_manager.can_allocate(imp.seq, imp.handle.num_tokens):
                continue  # stays waiting; its lease check above decides when waiting is pointless
            self.block_manager.allocate(imp.seq, imp.handle.num_tokens)
            self.waiting.remove(imp)
            self.active.append(imp)
            try:
                imp.started = time.monotonic()
                imp.read = self._read(imp, "blocks", b"")
            except (TransferError, ValueError) as e:
                self.active.remove(imp)
                failed.append((imp.seq, str(e)))
        return failed

    def _read(self, imp: KVImport, region: str, notif: bytes) -> ReadHandle:
        local = imp.seq.block_table[: len(imp.handle.block_ids)]
        return self.transport.start_read(imp.handle.agent, imp.handle.block_ids, local, notif, region=region)

    def _advance(self, imp: KVImport) -> str | None | bool:
        """False while in flight; None when the KV is in place and valid; else the reason it is not."""
        try:
            if time.monotonic() > imp.deadline:
                self.transport.cancel(imp.read)
                return f"reading the prompt KV from {imp.handle.agent!r} took longer than {self.timeout_s} s"
            if not self.transport.poll(imp.read):
                return False
            if imp.stage == "blocks":
                imp.stage = "generations"
                imp.read = self._read(imp, "generations", release_message(imp.handle.ctx_request_id))
                if not self.transport.poll(imp.read):  # a few bytes: usually done at once, so no extra step
                    return False
        except TransferError as e:
            return str(e)
        return self._validate(imp)

    def _validate(self, imp: KVImport) -> str | None:
        local = imp.seq.block_table[: len(imp.handle.block_ids)]
        seen = self.transport.generation_scratch[local].tolist()
        if seen != list(imp.handle.generations):
            return (f"KV blocks of context request {imp.handle.ctx_request_id} were reused on {imp.handle.agent!r} "
                    "while being read (lease ended)")
        self.bytes_read += len(local) * imp.handle.layout.block_bytes
        self.last_import_s = time.monotonic() - imp.started
        return None
