"""FCFS scheduler with a per-step token budget: chunked prefill, continuous batching, preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import Sequence, SeqStatus


@dataclass
class SchedulerOutput:
    """What runs this step: (sequence, number of new tokens to compute), in flat-batch order."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq) if front else self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Adds a sequence that already holds its blocks (a forked candidate, a handed-over request)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Takes seq out of every queue and frees its blocks. Idempotent."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SeqStatus.FINISHED

    def detach(self, seq: Sequence) -> None:
        """Takes a finished seq out of the running queue but leaves its blocks allocated (a KV lease holds them)."""
        if seq in self.running:
            self.running.remove(seq)
        seq.status = SeqStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, n, out):
                break  # seq itself was preempted; everything after it already was
            self.block_manager.allocate(seq, n)
            out.scheduled.append((seq, n))
            budget -= n
            i += 1
        return budget

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempts the newest running sequences until seq's blocks fit; False if seq itself had to go."""
        while not self.block_manager.can_allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        # Recompute: drop the KV, keep the tokens; the sequence prefills prompt + outputs again later.
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        self.add(seq, front=True)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(seq, n):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
