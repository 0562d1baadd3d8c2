"""NixlConnector: the KV connector of engines that exchange KV over NIXL (prefill and decode roles).

Prefill side: a context-only request's prompt blocks stay allocated (the scheduler holds them) under a lease until the
reader's signed release arrives or the lease ends. Decode side: a generation-only request READs those blocks into its
own, then reads the blocks' generation numbers, and the release rides on that second read; a number that changed means
the block was freed and reused during the read, so the request re-prefills locally instead of decoding from foreign KV.
Expired leases, dead peers and transfer timeouts take the same way out: the decode side recomputes the prompt, and the
request still completes with the same tokens.

A draft model's pool (speculative decoding) is exposed by a second transport, an agent of its own: a handle's draft
blocks are read whole into the reader's draft pool alongside the target's, their generation numbers checked the same
way, before the release (which frees both) is sent. A failed draft read fails the import like a failed target read.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import torch

from engine.kv.kv_cache import KVCache
from engine.kv.head_reads import CancelRead, RankImport, ReadOrder
from engine.kv.kv_connector import ConnectorEvents, ConnectorStats, EngineCard, ImportPlan, KVConnector
from engine.kv.kv_handle import DraftKV, KVHandle, compatibility_problems, open_release, release_message
from engine.kv.kv_transfer import BLOCKS, GENERATIONS, NixlTransport, PeerDisconnected, ReadHandle, TransferError
from engine.core.request import Sequence
from engine.parallel.ranks import RankGroup

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
    """A generation-only request whose prompt KV is on its way from a prefill engine: each rank of this engine reads
    its heads (rank 0 here, the others told by a ReadOrder), then rank 0 reads the blocks' generation numbers."""

    plan: ImportPlan
    key: int
    deadline: float  # time.monotonic()
    started: float
    reads: RankImport | None = None  # rank 0's
    waiting: set[int] = field(default_factory=set)  # the other ranks still reading
    error: str | None = None  # why a rank's read failed
    bytes_read: int = 0
    read: ReadHandle | None = None  # the generations' read
    draft_reads: list[ReadHandle] = field(default_factory=list)  # the draft pool's blocks, then its generations
    stage: str = "blocks"  # then "generations"


class NixlConnector(KVConnector):
    per_rank_kv = True

    def __init__(self, lease_seconds: float, transfer_timeout_s: float, cluster_key: bytes | None):
        self._key = cluster_key
        self.transfer_timeout_s = transfer_timeout_s
        self.leases = LeaseTable(lease_seconds, cluster_key)
        self._imports: dict[Sequence, KVImport] = {}
        self._by_key: dict[int, KVImport] = {}
        self._keys = itertools.count(1)
        self._ranks: RankGroup | None = None
        self._rank_infos: tuple[bytes, ...] = ()
        self._failed: list[tuple[Sequence, str]] = []  # imports that failed before any read, reported at next poll
        self._peers: set[str] = set()
        self._stats = ConnectorStats()
        self.transport: NixlTransport | None = None
        self.draft_transport: NixlTransport | None = None  # the draft model's pool, when the engine has one

    def register_kv_cache(self, kv_cache: KVCache, generations: torch.Tensor, fingerprint: str,
                          ranks: RankGroup | None = None) -> None:
        self._layout, self._fingerprint, self._generations = kv_cache.layout, fingerprint, generations
        self._ranks = ranks
        self._rank_infos = ranks.kv_transports if ranks is not None else ()
        if len(self._rank_infos) != self._layout.tp_size - 1:
            raise ValueError(f"{self._layout.tp_size} tensor-parallel ranks but {len(self._rank_infos)} other ranks "
                             "expose their KV pools")
        self.transport = NixlTransport(f"raypd-{uuid.uuid4().hex[:12]}", kv_cache, generations=generations)

    def register_draft_cache(self, kv_cache: KVCache, generations: torch.Tensor, fingerprint: str) -> None:
        self._draft = (kv_cache.layout, fingerprint, generations)
        self.draft_transport = NixlTransport(f"{self.transport.name}-draft", kv_cache, generations=generations)

    # ---- meeting peers ----
    def card(self) -> EngineCard:
        return EngineCard(self.transport.name, self.transport.metadata(), self._layout, self._fingerprint,
                          self._rank_infos)

    def meet(self, card: EngineCard) -> None:
        if card.name in self._peers:
            return
        problems = compatibility_problems(self._layout, self._fingerprint, card.layout, card.fingerprint)
        if len(card.rank_transport_infos) != card.layout.tp_size - 1:
            problems.append(f"it has {card.layout.tp_size} ranks but names {len(card.rank_transport_infos) + 1} "
                            "ranks' transports")
        if problems:
            raise ValueError(f"engine {card.name!r} is incompatible with this one: " + "; ".join(problems))
        self.transport.connect(card.name, card.transport_info)
        self._peers.add(card.name)

    def _unmeet_if_lost(self, error: Exception, name: str) -> None:
        """A peer the transport dropped as gone (PeerDisconnected) is met again by its next handle: after a
        partition heals, the same, still running, prefill engine is read from again instead of re-prefilled forever."""
        if isinstance(error, PeerDisconnected):
            self._peers.discard(name)

    def open_handle(self, opaque_state: bytes) -> KVHandle:
        handle = KVHandle.open(opaque_state, self._key)
        try:
            self._meet_owner(handle)
        except TransferError as e:  # start_import reports it; the request re-prefills
            log.info("prefill engine %r unreachable: %s", handle.agent, e)
        return handle

    def _meet_owner(self, handle: KVHandle) -> None:
        self.meet(EngineCard(handle.agent, handle.transport_info, handle.layout, handle.fingerprint,
                             handle.rank_transport_infos))

    # ---- prefill side ----
    def hold(self, request_id, block_ids, num_tokens, first_logprobs, first_top_logprobs, mm_items=(),
             group_starts=None, draft=None) -> bytes:
        lease_id, deadline = self.leases.hold(request_id)
        handle = KVHandle(
            ctx_request_id=request_id, agent=self.transport.name, transport_info=self.transport.metadata(),
            block_ids=tuple(block_ids), generations=tuple(self._generations[list(block_ids)].tolist()), num_tokens=num_tokens,
            layout=self._layout, fingerprint=self._fingerprint, lease_deadline=deadline, lease_id=lease_id,
            first_logprobs=tuple(first_logprobs), first_top_logprobs=tuple(first_top_logprobs),
            mm_items=tuple((tuple(i.content_hash), i.offset, i.length) for i in mm_items),
            rank_transport_infos=self._rank_infos, group_starts=tuple(group_starts or ()),
            draft=self._draft_kv(*draft) if draft is not None and self.draft_transport is not None else None,
        )
        return handle.sign(self._key)

    def _draft_kv(self, block_ids: list[int], group_starts: list[int]) -> DraftKV:
        layout, fingerprint, generations = self._draft
        t = self.draft_transport
        return DraftKV(t.name, t.metadata(), layout, fingerprint, tuple(block_ids),
                       tuple(generations[list(block_ids)].tolist()), tuple(group_starts))

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
        imp = self._imports[plan.seq] = KVImport(plan, next(self._keys), now + self.transfer_timeout_s, now)
        self._by_key[imp.key] = imp
        try:
            if not plan.remote_blocks:  # every block was in this engine's prefix cache: nothing to read
                self.release_unread(handle)
                imp.stage = "done"
                return
            if handle.agent not in self._peers:
                self._meet_owner(handle)  # again: the peer may be reachable now
            if plan.draft_local:
                imp.draft_reads.append(self._start_draft_read(plan, BLOCKS))
            order = ReadOrder(imp.key, handle.layout, handle.transports, plan.remote_blocks, plan.local_blocks)
            imp.reads = RankImport(self.transport, self._layout, 0, order)
            if self._ranks is not None:
                with self._ranks.guard():
                    self._ranks.send(order)
                imp.waiting = set(range(1, self._ranks.size))
        except (TransferError, ValueError) as e:
            self._forget(imp)
            self._failed.append((plan.seq, str(e)))
            self._unmeet_if_lost(e, handle.agent)

    def _start_draft_read(self, plan: ImportPlan, region: str) -> ReadHandle:
        """Reads the handle's draft blocks (or their generation numbers) into our draft pool (or its scratch)."""
        if self.draft_transport is None:
            raise ValueError("this engine has no draft pool to read a draft's KV into")
        draft = plan.handle.draft
        self.draft_transport.connect(draft.agent, draft.transport_info)  # idempotent
        return self.draft_transport.start_read(draft.agent, plan.draft_remote, plan.draft_local, b"", region=region)

    def _forget(self, imp: KVImport) -> None:
        """Stops every read of the import still running, on every rank, and drops it."""
        self._imports.pop(imp.plan.seq, None)
        self._by_key.pop(imp.key, None)
        if imp.reads is not None:
            imp.reads.cancel()
        if imp.read is not None:
            self.transport.cancel(imp.read)
        for read in imp.draft_reads:
            self.draft_transport.cancel(read)
        if imp.waiting:
            with self._ranks.guard():
                self._ranks.send(CancelRead(imp.key))
            imp.waiting.clear()

    def cancel_import(self, seq: Sequence) -> None:
        imp = self._imports.get(seq)
        if imp is not None:
            self._forget(imp)
        self._failed = [(s, why) for s, why in self._failed if s is not seq]

    def release_unread(self, handle: KVHandle) -> None:
        try:
            if handle.agent not in self._peers:
                self._meet_owner(handle)
            self.transport.send_notification(handle.agent, release_message(handle.lease_id, self._key))
        except TransferError as e:  # the lease ends on its own
            self._unmeet_if_lost(e, handle.agent)
            log.info("could not release context request %d early: %s", handle.ctx_request_id, e)

    # ---- polling ----
    def poll(self) -> ConnectorEvents:
        ended = self.leases.released(self.transport.poll_notifications()) + self.leases.expired()
        self._hear_ranks()
        done, self._failed = list(self._failed), []
        for seq, imp in list(self._imports.items()):
            outcome = self._advance(imp)
            if outcome is not False:
                self._forget(imp)
                done.append((seq, outcome))
        return ConnectorEvents(tuple(done), tuple(ended))

    def _hear_ranks(self) -> None:
        """The other ranks' reads that ended since the last poll."""
        if self._ranks is None or not self._by_key:
            return
        for done in self._ranks.reports():
            imp = self._by_key.get(done.key)
            if imp is None or done.rank not in imp.waiting:  # cancelled meanwhile
                continue
            imp.waiting.discard(done.rank)
            imp.bytes_read += done.bytes_read
            if done.error is not None:
                imp.error = imp.error or f"tensor-parallel rank {done.rank}: {done.error}"

    def _advance(self, imp: KVImport) -> str | None | bool:
        """False while in flight; None when the KV is in place and valid; else the reason it is not (the import's
        reads still running are stopped by the caller)."""
        if imp.stage == "done":
            return None
        handle = imp.plan.handle
        if time.monotonic() > imp.deadline:
            return f"reading the prompt KV from {handle.agent!r} took longer than {self.transfer_timeout_s} s"
        if imp.error is not None:
            return imp.error
        try:
            if imp.stage == "blocks":
                if not imp.reads.poll() or imp.waiting or not self._draft_read(imp):
                    return False
                imp.bytes_read += imp.reads.bytes_read
                # Every rank has its heads: now the blocks' generations, the draft's first (the release that rides
                # on the target's frees both).
                imp.stage = "draft generations" if imp.draft_reads else "generations"
                if imp.draft_reads:
                    imp.bytes_read += len(imp.plan.draft_local) * imp.plan.handle.draft.layout.block_bytes
                    imp.draft_reads.append(self._start_draft_read(imp.plan, GENERATIONS))
            if imp.stage == "draft generations":
                if not self._draft_read(imp):
                    return False
                imp.stage = "generations"
            if imp.read is None:
                p = imp.plan
                imp.read = self.transport.start_read(handle.agent, p.remote_blocks, p.local_blocks,
                                                     release_message(handle.lease_id, self._key), region=GENERATIONS)
            if not self.transport.poll(imp.read):  # a few bytes: usually done at once, so no extra step
                return False
        except TransferError as e:
            self._unmeet_if_lost(e, handle.agent)
            return str(e)
        return self._validate(imp)

    def _draft_read(self, imp: KVImport) -> bool:
        """Whether the draft's latest read (if any) has completed."""
        return not imp.draft_reads or self.draft_transport.poll(imp.draft_reads[-1])

    def _validate(self, imp: KVImport) -> str | None:
        p = imp.plan
        seen = self.transport.generation_scratch[list(p.local_blocks)].tolist()
        made = dict(zip(p.handle.block_ids, p.handle.generations))  # each block's generation when the lease began
        expected = [made[b] for b in p.remote_blocks]
        if seen != expected or not self._draft_valid(p):
            return (f"KV blocks of context request {p.handle.ctx_request_id} were reused on {p.handle.agent!r} "
                    "while being read (lease ended)")
        self._stats.kv_bytes_read += imp.bytes_read
        self._stats.last_import_s = time.monotonic() - imp.started
        return None

    def _draft_valid(self, p: ImportPlan) -> bool:
        if not p.draft_local:
            return True
        made = dict(zip(p.handle.draft.block_ids, p.handle.draft.generations))
        seen = self.draft_transport.generation_scratch[list(p.draft_local)].tolist()
        return seen == [made[b] for b in p.draft_remote]

    def stats(self) -> ConnectorStats:
        s = self._stats
        return ConnectorStats(s.kv_bytes_read, s.last_import_s, len(self.leases), self.leases.rejected,
                              self.leases.unknown, {"kv_leases_expired": self.leases.expired_count})

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self.draft_transport is not None:
            self.draft_transport.close()
