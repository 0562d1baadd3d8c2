"""FCFS scheduler with a per-step token budget: chunked prefill, continuous batching, preemption by recompute, prefix
caching, and the waiting-for-KV queue of disaggregated decoding.

Every sequence is in exactly one queue (DESIGN.md, "Engine"): waiting, waiting for KV (a remote read of its prompt is
in flight; it holds its blocks and counts against max_num_seqs), running, or finished (`held` keeps the blocks of a
finished context-only request while a KV lease lasts). Admission is the same for all: a prefix-cache lookup, then
blocks; a generation-only request's admission starts its import instead of a prefill. Preemption takes any admitted
sequence back to waiting, imports included (the read is cancelled).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from engine.kv.block_hash import image_safe_prefix, update_block_hashes
from engine.kv.block_manager import BlockManager
from engine.kv.kv_connector import ConnectorEvents, ImportPlan, KVConnector
from engine.core.request import Sequence, SeqStatus
from engine.spec.drafter import Drafter

log = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """What runs this step: (sequence, number of new tokens to compute), in flat-batch order."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class CacheStats:
    query_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of those, found in the cache


class Scheduler:
    def __init__(self, block_manager: BlockManager, connector: KVConnector, max_num_batched_tokens: int,
                 max_num_seqs: int, drafter: Drafter | None = None):
        self.block_manager = block_manager
        self.drafter = drafter  # speculative decoding: drafts a decoding sequence's next tokens (None: off)
        self.connector = connector
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.waiting_for_kv: list[Sequence] = []
        self.running: list[Sequence] = []
        self.held: dict[int, Sequence] = {}  # request id -> finished context-only sequence under a KV lease
        self.num_preemptions = 0
        self.num_reprefills = 0  # imports that failed, so the prompt was computed here
        self.cache_stats = CacheStats()

    # ---- moving sequences ----
    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq) if front else self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Adds a sequence that already holds its blocks (a forked candidate)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Takes seq out of every queue and frees its blocks. Idempotent."""
        self._dequeue(seq)
        self.block_manager.free(seq)
        self._release_draft(seq)
        seq.status = SeqStatus.FINISHED

    def hold(self, seq: Sequence) -> None:
        """Finishes seq but keeps its blocks (and its drafter's): a KV lease lets another engine read them until
        free_held()."""
        self._dequeue(seq)
        seq.status = SeqStatus.FINISHED
        self.held[seq.request.request_id] = seq

    def free_held(self, request_id: int) -> None:
        """Frees the blocks of a held request (its lease ended). Idempotent."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.block_manager.free(seq)
            self._release_draft(seq)

    def _release_draft(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.release(seq)

    def _dequeue(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.WAITING_FOR_KV:
            self.connector.cancel_import(seq)
            self.waiting_for_kv.remove(seq)

    # ---- the KV plane ----
    def update_from_connector(self, events: ConnectorEvents) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """Applies reads that ended and leases that ended. Returns the sequences whose import ended (KV in place:
        running; failed: back to waiting to prefill here), whose candidates now start from their first tokens, and
        (sequence, why) for failed imports that cannot be prefilled here (images without their embeddings): those
        are finished, their blocks freed."""
        for request_id in events.leases_ended:
            self.free_held(request_id)
        ended, failed = [], []
        for seq, problem in events.imports_done:
            if seq.status is not SeqStatus.WAITING_FOR_KV:
                continue  # preempted or finished meanwhile
            self.waiting_for_kv.remove(seq)
            if problem is None:
                seq.num_computed_tokens = seq.num_tokens
                self.block_manager.register(seq, seq.num_computed_tokens)
                seq.request.kv_source = None  # read, and its lease released: a preemption from here recomputes
                if self.drafter is not None:
                    self.drafter.imported(seq)
                self.add_running(seq)
            elif not seq.request.can_recompute:
                self.block_manager.free(seq)
                self._release_draft(seq)
                seq.status = SeqStatus.FINISHED
                failed.append((seq, f"reading the prompt KV failed ({problem}) and the prompt has images whose "
                                    "embeddings only the prefill side had: it cannot be prefilled here"))
                continue
            else:
                log.warning("request %d re-prefills locally: %s", seq.request.request_id, problem)
                self.num_reprefills += 1
                self.block_manager.free(seq)
                self._release_draft(seq)
                seq.request.kv_source = None
                self.add(seq, front=True)
            ended.append(seq)
        return ended, failed

    # ---- one step ----
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if self.drafter is not None and self.drafter.enabled(len(self.running)):
            budget = self._add_drafts(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def on_computed(self, out: SchedulerOutput) -> None:
        """The step ran: advances each scheduled sequence's progress and caches its blocks that became full."""
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n - len(seq.draft)  # drafts count once accepted (OutputProcessor)
            if self.block_manager.enable_prefix_caching:
                update_block_hashes(seq, self.block_manager.block_size)
                self.block_manager.register(seq, seq.num_computed_tokens)
            self.block_manager.release_behind_window(seq)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            if not self._make_room(seq, n, out):
                break  # seq itself was preempted; everything after it already was
            self.block_manager.allocate(seq, n)
            out.scheduled.append((seq, n))
            budget -= n
            i += 1
        return budget

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Speculation: each decoding sequence scheduled for one token also computes its drafts, from what the
        step's budget and the free blocks leave once every running sequence has its place (a guess never preempts
        anything). Not a prompt's last chunk: it samples every candidate's first token. Returns the budget left."""
        decoding = [i for i, (seq, n) in enumerate(out.scheduled) if n == 1 and seq.request.forked]
        if budget <= 0 or not decoding:
            return budget
        drafts = self.drafter.propose([out.scheduled[i][0] for i in decoding], budget)
        for i, draft in zip(decoding, drafts):
            seq = out.scheduled[i][0]
            while draft and not self.block_manager.can_allocate(seq, 1 + len(draft)):
                draft.pop()  # as many as the blocks it holds and the free ones take
            if draft:
                self.block_manager.allocate(seq, 1 + len(draft))
                seq.draft = draft
                out.scheduled[i] = (seq, 1 + len(draft))
                budget -= len(draft)
        return budget

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempts the newest admitted sequences (imports first) until seq's blocks fit; False if seq itself
        had to go."""
        while not self.block_manager.can_allocate(seq, n):
            victim = self.waiting_for_kv[-1] if self.waiting_for_kv else self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        # Recompute: drop the KV, keep the tokens; the sequence prefills prompt + outputs again later (its full
        # blocks stay in the prefix cache until evicted, so it may well find them again). An import is re-read.
        self._dequeue(seq)
        self.block_manager.free(seq)
        self._release_draft(seq)
        seq.num_computed_tokens, seq.draft = 0, []
        self.add(seq, front=True)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        slots = sum(s.num_slots for s in self.running) + sum(s.num_slots for s in self.waiting_for_kv)
        while self.waiting and slots + self.waiting[0].num_slots <= self.max_num_seqs:
            seq = self.waiting[0]
            importing = seq.request.kv_source is not None
            if not importing and budget <= 0:
                break
            cached = self._cached_prefix(seq, importing)
            n = seq.num_tokens - len(cached[0]) * self.block_manager.block_size
            n = n if importing else min(n, budget)
            if not self.block_manager.can_admit(seq, cached, n, importing):
                break
            self.waiting.popleft()
            self._admit(seq, cached, n, importing)
            slots += seq.num_slots
            if importing:
                self._start_import(seq, len(cached[0]))
            else:
                self.add_running(seq)
                out.scheduled.append((seq, n))
                budget -= n

    def _cached_prefix(self, seq: Sequence, importing: bool) -> list[list[int]]:
        """The blocks of seq's longest cached prefix it may use, per layer group. A computing sequence leaves its
        last token to compute (its logits are needed); a hit never ends inside an image; prompt logits need every
        position computed, so such requests take no hit."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or seq.request.wants_prompt_logits:
            return bm.lookup([])
        usable = seq.num_tokens if importing else seq.num_tokens - 1
        usable = image_safe_prefix(seq.request, usable) // bm.block_size
        return bm.lookup(update_block_hashes(seq, bm.block_size)[:usable], seq.num_tokens if importing else None)

    def _admit(self, seq: Sequence, cached: list[list[int]], n: int, importing: bool) -> None:
        bm = self.block_manager
        bm.admit(seq, cached)
        seq.num_computed_tokens = len(cached[0]) * bm.block_size
        bm.allocate(seq, n, importing)
        req = seq.request
        if bm.enable_prefix_caching and not req.wants_prompt_logits:
            self.cache_stats.query_tokens += seq.num_tokens
            self.cache_stats.hit_tokens += seq.num_computed_tokens
        if req.num_cached_tokens is None:
            req.num_cached_tokens = min(seq.num_computed_tokens, req.num_prompt_tokens)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()

    def _start_import(self, seq: Sequence, num_cached_blocks: int) -> None:
        handle = seq.request.kv_source
        pairs = _import_pairs(seq.block_tables, handle.group_tables(), num_cached_blocks)
        if pairs is None:  # the handle lacks a block this engine needs: the prompt is computed here instead
            log.warning("request %d re-prefills locally: its KV handle lacks blocks of the window",
                        seq.request.request_id)
            self.num_reprefills += 1
            self.connector.release_unread(handle)
            self.block_manager.free(seq)
            seq.num_computed_tokens, seq.request.kv_source = 0, None
            self.add(seq, front=True)
            return
        seq.status = SeqStatus.WAITING_FOR_KV
        self.waiting_for_kv.append(seq)
        draft = self._draft_pairs(seq, handle) if pairs[0] else None  # nothing read: the draft computes too
        self.connector.start_import(ImportPlan(seq, handle, *pairs, *(draft or ((), ()))))

    def _draft_pairs(self, seq: Sequence, handle) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(local, remote) draft-pool blocks to read with seq's prompt KV, if its drafter can use the handle's."""
        tables = self.drafter.import_tables(seq, handle) if self.drafter is not None else None
        pairs = _import_pairs(tables, handle.draft_tables(), 0) if tables is not None else None
        if tables is not None and pairs is None:
            self.drafter.release(seq)
        return pairs


def _import_pairs(tables: list[list[int]], remote: list[tuple[int, tuple[int, ...]]], num_cached_blocks: int
                  ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(local blocks, remote blocks) to read, pairwise: every group's blocks from num_cached_blocks on that this
    side holds (a window group's entries behind the window are not read). None if the remote side lacks one."""
    local, theirs = [], []
    for table, (start, blocks) in zip(tables, remote, strict=True):
        for i in range(num_cached_blocks, len(table)):
            if table[i] < 0:
                continue
            if not start <= i < start + len(blocks):
                return None
            local.append(table[i])
            theirs.append(blocks[i - start])
    return tuple(local), tuple(theirs)
