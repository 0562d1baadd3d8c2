"""NixlConnector: the KV connector of engines that exchange KV over NIXL (prefill and decode roles).

Prefill side: a context-only request's prompt blocks stay allocated (the scheduler holds them) under a lease until the
reader's signed release arrives or the lease ends. Decode side: a generation-only request READs those blocks into its
own, then reads the blocks' generation numbers, and the release rides on that second read; a number that changed means
the block was freed and reused during the read, so the request re-prefills locally instead of decoding from foreign KV.
Expired leases, dead peers and transfer timeouts take the same way out: the decode side recomputes the prompt, and the
request still completes with the same tokens.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass

import torch

from engine.kv.kv_cache import KVCache
from engine.kv.kv_connector import ConnectorEvents, ConnectorStats, EngineCard, ImportPlan, KVConnector
from engine.kv.kv_handle import KVHandle, compatibility_problems, open_release, release_message
from engine.kv.kv_transfer import GENERATIONS, NixlTransport, ReadHandle, TransferError
from engine.core.request import Sequence

log = logging.getLogger(__name__)

# A lease with less than this left is not read: the read could outlive it.
LEASE_MARGIN_S = 1.0


class LeaseTable:
    """Prefill side: the deadline of each held request's blocks, and the checks on release messages."""

    def __init__(self, lease_seconds: float, key: bytes | None):
        self.lease_seconds = lease_seconds
        self._key = key
        self._by_lease: dict[str, tuple[int, float]] = {}  # lease id -> (request id, monotonic deadline)
        self._by_request: dict[int, str] = {}
        self.rejected = 0
        self.unknown = 0
        self.expired_count = 0

    def __len__(self) -> int:
        return len(self._by_lease)

    def hold(self, request_id: int) -> tuple[str, float]:
        """A new lease: (its id, its deadline on this host's wall clock)."""
        lease_id = os.urandom(16).hex()
        self._by_lease[lease_id] = (request_id, time.monotonic() + self.lease_seconds)
        self._by_request[request_id] = lease_id
        return lease_id, time.time() + self.lease_seconds

    def end(self, request_id: int) -> bool:
        lease_id = self._by_request.pop(request_id, None)
        if lease_id is None:
            return False
        del self._by_lease[lease_id]
        return True

    def released(self, notifications: dict[str, list[bytes]]) -> list[int]:
        """Request ids whose leases the notifications validly release; bad or stale ones are counted, not obeyed."""
        ended = []
        for messages in notifications.values():
            for message in messages:
                lease_id = open_release(message, self._key)
                entry = self._by_lease.get(lease_id) if lease_id is not None else None
                if lease_id is None:
                    self.rejected += 1
                elif entry is None:
                    self.unknown += 1
                elif self.end(entry[0]):
                    ended.append(entry[0])
        if self.rejected or self.unknown:
            log.debug("release messages dropped so far: %d bad signature, %d unknown lease", self.rejected,
                      self.unknown)
        return ended

    def expired(self) -> list[int]:
        now = time.monotonic()
        ended = [rid for rid, deadline in self._by_lease.values() if deadline <= now]
        for rid in ended:
            log.warning("KV lease of context request %d expired before the decode side released it", rid)
            self.end(rid)
        self.expired_count += len(ended)
        return ended


@dataclass(eq=False)
class KVImport:
    """A generation-only request whose prompt KV is on its way from a prefill engine."""

    plan: ImportPlan
    deadline: float  # time.monotonic()
    started: float
    read: ReadHandle | None = None
    stage: str = "blocks"  # then "generations"


class NixlConnector(KVConnector):
    def __init__(self, lease_seconds: float, transfer_timeout_s: float, cluster_key: bytes | None):
        self._key = cluster_key
        self.transfer_timeout_s = transfer_timeout_s
        self.leases = LeaseTable(lease_seconds, cluster_key)
        self._imports: dict[Sequence, KVImport] = {}
        self._failed: list[tuple[Sequence, str]] = []  # imports that failed before any read, reported at next poll
        self._peers: set[str] = set()
        self._stats = ConnectorStats()
        self.transport: NixlTransport | None = None

    def register_kv_cache(self, kv_cache: KVCache, generations: torch.Tensor, fingerprint: str) -> None:
        self._layout, self._fingerprint, self._generations = kv_cache.layout, fingerprint, generations
        self.transport = NixlTransport(f"raypd-{uuid.uuid4().hex[:12]}", kv_cache, generations=generations)

    # ---- meeting peers ----
    def card(self) -> EngineCard:
        return EngineCard(self.transport.name, self.transport.metadata(), self._layout, self._fingerprint)

    def meet(self, card: EngineCard) -> None:
        if card.name in self._peers:
            return
        problems = compatibility_problems(self._layout, self._fingerprint, card.layout, card.fingerprint)
        if problems:
            raise ValueError(f"engine {card.name!r} is incompatible with this one: " + "; ".join(problems))
        self.transport.connect(card.name, card.transport_info)
        self._peers.add(card.name)

    def open_handle(self, opaque_state: bytes) -> KVHandle:
        handle = KVHandle.open(opaque_state, self._key)
        try:
            self._meet_owner(handle)
        except TransferError as e:  # start_import reports it; the request re-prefills
            log.info("prefill engine %r unreachable: %s", handle.agent, e)
        return handle

    def _meet_owner(self, handle: KVHandle) -> None:
        self.meet(EngineCard(handle.agent, handle.transport_info, handle.layout, handle.fingerprint))

    # ---- prefill side ----
    def hold(self, request_id, block_ids, num_tokens, first_logprobs, first_top_logprobs, mm_items=()) -> bytes:
        lease_id, deadline = self.leases.hold(request_id)
        handle = KVHandle(
            ctx_request_id=request_id, agent=self.transport.name, transport_info=self.transport.metadata(),
            block_ids=tuple(block_ids), generations=tuple(self._generations[list(block_ids)].tolist()), num_tokens=num_tokens,
            layout=self._layout, fingerprint=self._fingerprint, lease_deadline=deadline, lease_id=lease_id,
            first_logprobs=tuple(first_logprobs), first_top_logprobs=tuple(first_top_logprobs),
            mm_items=tuple((tuple(i.content_hash), i.offset, i.length) for i in mm_items),
        )
        return handle.sign(self._key)

    def end_lease(self, request_id: int) -> bool:
        return self.leases.end(request_id)

    # ---- decode side ----
    def start_import(self, plan: ImportPlan) -> None:
        handle = plan.handle
        left = handle.lease_deadline - time.time()
        if left < LEASE_MARGIN_S:
            self._failed.append((plan.seq, f"the KV lease of context request {handle.ctx_request_id} had "
                                           f"{left:.1f} s left, too little to read it"))
            return
        now = time.monotonic()
        imp = self._imports[plan.seq] = KVImport(plan, now + self.transfer_timeout_s, now)
        try:
            if not plan.remote_blocks:  # every block was in this engine's prefix cache: nothing to read
                self.release_unread(handle)
                imp.stage = "done"
                return
            if handle.agent not in self._peers:
                self._meet_owner(handle)  # again: the peer may be reachable now
            imp.read = self._read(imp, "blocks", b"")
        except (TransferError, ValueError) as e:
            del self._imports[plan.seq]
            self._failed.append((plan.seq, str(e)))

    def cancel_import(self, seq: Sequence) -> None:
        imp = self._imports.pop(seq, None)
        if imp is not None and imp.read is not None:
            self.transport.cancel(imp.read)
        self._failed = [(s, why) for s, why in self._failed if s is not seq]

    def release_unread(self, handle: KVHandle) -> None:
        try:
            if handle.agent not in self._peers:
                self._meet_owner(handle)
            self.transport.send_notification(handle.agent, release_message(handle.lease_id, self._key))
        except TransferError as e:  # the lease ends on its own
            log.info("could not release context request %d early: %s", handle.ctx_request_id, e)

    def _read(self, imp: KVImport, region: str, notif: bytes) -> ReadHandle:
        p = imp.plan
        return self.transport.start_read(p.handle.agent, p.remote_blocks, p.local_blocks, notif, region=region)

    # ---- polling ----
    def poll(self) -> ConnectorEvents:
        ended = self.leases.released(self.transport.poll_notifications()) + self.leases.expired()
        done, self._failed = list(self._failed), []
        for seq, imp in list(self._imports.items()):
            outcome = self._advance(imp)
            if outcome is not False:
                del self._imports[seq]
                done.append((seq, outcome))
        return ConnectorEvents(tuple(done), tuple(ended))

    def _advance(self, imp: KVImport) -> str | None | bool:
        """False while in flight; None when the KV is in place and valid; else the reason it is not."""
        if imp.stage == "done":
            return None
        handle = imp.plan.handle
        try:
            if time.monotonic() > imp.deadline:
                self.transport.cancel(imp.read)
                return f"reading the prompt KV from {handle.agent!r} took longer than {self.transfer_timeout_s} s"
            if not self.transport.poll(imp.read):
                return False
            if imp.stage == "blocks":
                imp.stage = "generations"
                imp.read = self._read(imp, GENERATIONS, release_message(handle.lease_id, self._key))
                if not self.transport.poll(imp.read):  # a few bytes: usually done at once, so no extra step
                    return False
        except TransferError as e:
            return str(e)
        return self._validate(imp)

    def _validate(self, imp: KVImport) -> str | None:
        p = imp.plan
        seen = self.transport.generation_scratch[list(p.local_blocks)].tolist()
        made = dict(zip(p.handle.block_ids, p.handle.generations))  # each block's generation when the lease began
        expected = [made[b] for b in p.remote_blocks]
        if seen != expected:
            return (f"KV blocks of context request {p.handle.ctx_request_id} were reused on {p.handle.agent!r} "
                    "while being read (lease ended)")
        self._stats.kv_bytes_read += len(p.local_blocks) * p.handle.layout.block_bytes
        self._stats.last_import_s = time.monotonic() - imp.started
        return None

    def stats(self) -> ConnectorStats:
        s = self._stats
        return ConnectorStats(s.kv_bytes_read, s.last_import_s, len(self.leases), self.leases.rejected,
                              self.leases.unknown, {"kv_leases_expired": self.leases.expired_count})

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
