"""A discrete-event simulator of a raypd deployment: P prefill and D decode replicas (P = 0: colocated), requests
arriving at given times (a client with at most `concurrency` in flight, like `raypd bench`).

Each simulated replica drives the engine's own Scheduler and BlockManager, so batching is the engine's: the token
budget, max_num_seqs, chunked prefill, preemption and prefix caching. Only the model is replaced: a step takes the
time a StepModel fitted on this hardware (cluster/planning/plan.py profiles it) says for the step's batch, adjusted on
decode replicas by the serving path's Overheads; a decode replica's KV import ends `handoff_s` after the prefill's first
token, and every TTFT gets `ttft_s` more (HTTP, tokenizer, Serve handles, the first token's trip to the client). Routing
is by load, as the routers see it (prefill: prompt tokens to compute; decode: tokens to generate plus KV tokens held).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable

from engine.kv.block_manager import BlockManager
from engine.kv.kv_connector import ConnectorEvents, ImportPlan, NullConnector
from engine.core.request import EngineRequest, Sequence
from engine.core.scheduler import Scheduler, SchedulerOutput
from llmapi.sampling_params import SamplingParams

FEATURES = ("step", "tokens", "seqs", "prefill_attention", "decode_context")


def step_features(out: SchedulerOutput) -> tuple[float, ...]:
    """What a step's time depends on: 1, tokens computed, sequences, prefill attention pairs (chunk tokens x the
    context they attend over) and the context decode sequences attend over (their KV is gathered every step)."""
    prefill = sum(n * (seq.num_computed_tokens + n) for seq, n in out.scheduled if n > 1)
    decode = sum(seq.num_computed_tokens + 1 for seq, n in out.scheduled if n == 1)
    return 1.0, float(out.num_tokens), float(len(out.scheduled)), float(prefill), float(decode)


@dataclass(frozen=True)
class StepModel:
    """step seconds = coefficients . step_features(step)."""

    coefficients: tuple[float, ...]

    def seconds(self, out: SchedulerOutput) -> float:
        return max(0.0, sum(c * f for c, f in zip(self.coefficients, step_features(out))))


@dataclass(frozen=True)
class EngineShape:
    """The engine settings batching depends on."""

    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool = True
    windows: tuple[int | None, ...] = (None,)  # per KV layer group (engine/kv/kv_cache.py)

    def __post_init__(self):
        object.__setattr__(self, "windows", tuple(self.windows))  # a list when read from JSON


@dataclass(frozen=True)
class Overheads:
    """What the serving path adds to the engine's time (benchmarks/plan_check.py calibrates them against Serve).
    A decode replica's step (colocated: every step) takes step_scale times the engine's, plus seq_step_s per
    sequence in it: the process and its neighbours (postproc, ingress, HTTP) share the host's cores, and each
    sequence's tokens cost the serving path work every step. A request's first token also waits
    ttft_s + ttft_per_request_s per request in flight on the serving path, averaged over the run: the load the
    other streams put on the shared cores, smooth in the request rate. (Counting the requests in flight at each
    request's own sending made the p50 jump by whole requests at low rates, where the measured one rises
    smoothly.)"""

    ttft_s: float = 0.0
    step_scale: float = 1.0
    seq_step_s: float = 0.0
    handoff_s: float = 0.0
    ttft_per_request_s: float = 0.0  # more TTFT per request in flight, on average over the run (a shared path)

    def step_seconds(self, engine_s: float, num_seqs: int) -> float:
        return engine_s * self.step_scale + self.seq_step_s * num_seqs


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class SimRecord:
    request: SimRequest
    ttft_overhead_s: float = 0.0
    sent_s: float | None = None  # when the client sent it (later than arrival under a concurrency cap)
    first_token_s: float | None = None  # engine time of the first token
    done_s: float | None = None  # engine time of the last

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s + self.ttft_overhead_s

    @property
    def tpot_s(self) -> float | None:
        n = self.request.max_tokens
        return None if n < 2 else (self.done_s - self.first_token_s) / (n - 1)


@dataclass(frozen=True)
class _Handle:
    """Stands for a KV handle: the scheduler only reads which remote blocks to import."""

    block_ids: tuple[int, ...]
    groups: int = 1

    def group_tables(self) -> list[tuple[int, tuple[int, ...]]]:
        return [(0, self.block_ids)] * self.groups  # each layer group from its first block, as KVHandle.group_tables


class _SimConnector(NullConnector):
    """Imports end after the replica's handoff time, on the simulated clock."""

    def __init__(self, replica: _Replica):
        self.replica = replica
        self._imports: dict[int, tuple[float, Sequence]] = {}  # id(seq) -> (when done, seq)

    def start_import(self, plan: ImportPlan) -> None:
        done = self.replica.now + self.replica.overheads.handoff_s
        self._imports[id(plan.seq)] = (done, plan.seq)
        self.replica.sim.at(done, self.replica.kick)

    def cancel_import(self, seq: Sequence) -> None:
        self._imports.pop(id(seq), None)

    def poll(self) -> ConnectorEvents:
        done = [(key, seq) for key, (t, seq) in self._imports.items() if t <= self.replica.now + 1e-12]
        for key, _ in done:
            del self._imports[key]
        return ConnectorEvents(imports_done=tuple((seq, None) for _, seq in done))


class _Replica:
    """One engine on the simulated clock: the real scheduler, the fitted step time."""

    def __init__(self, sim: Simulation, role: str, shape: EngineShape, model: StepModel, overheads: Overheads,
                 on_token: Callable[[Sequence, float], None]):
        self.sim, self.role, self.shape, self.model, self.overheads = sim, role, shape, model, overheads
        self.on_token = on_token
        self.now = 0.0
        self.busy = False
        blocks = BlockManager(shape.num_blocks, shape.block_size, shape.enable_prefix_caching, shape.windows)
        self.connector = _SimConnector(self)
        self.scheduler = Scheduler(blocks, self.connector, shape.max_num_batched_tokens, shape.max_num_seqs)
        self.live: set[Sequence] = set()

    def add(self, seq: Sequence) -> None:
        self.live.add(seq)
        self.scheduler.add(seq)
        # after everything else that happens at this instant: the engine takes all that was submitted by then
        self.sim.at(self.sim.now, self.kick)

    def load(self) -> int:
        """As the replica would report it (cluster/routing_policy.replica_state)."""
        uncomputed = sum(s.num_tokens - s.num_computed_tokens for s in self.live)
        if self.role == "prefill":
            return uncomputed
        bm = self.scheduler.block_manager
        to_generate = sum(max(0, s.request.sampling_params.max_tokens - s.num_output_tokens) for s in self.live)
        return uncomputed + to_generate + (bm.num_blocks - bm.num_free_blocks) * bm.block_size

    def kick(self, now: float) -> None:
        """Starts a step now, unless one is running (its end starts the next) or there is nothing to do."""
        if self.busy or not self.live:
            return
        self.now = now
        ended, _ = self.scheduler.update_from_connector(self.connector.poll())  # simulated imports never fail
        for seq in ended:
            if not seq.finished:  # the prefill's first token, as the engine's output processor appends it
                seq.token_ids.append(_token(seq))
        out = self.scheduler.schedule()
        if not out.scheduled:
            return  # waiting on an import (its end kicks again) or on blocks another sequence frees
        self.busy = True
        seconds = self.model.seconds(out)
        if self.role == "decode":
            seconds = self.overheads.step_seconds(seconds, len(out.scheduled))
        self.sim.at(now + seconds, lambda t: self._end_step(out, t))

    def _end_step(self, out: SchedulerOutput, now: float) -> None:
        self.now, self.busy = now, False
        self.scheduler.on_computed(out)
        for seq, _ in out.scheduled:
            if seq.num_computed_tokens < seq.num_tokens or seq.finished:
                continue  # a chunk of a longer prompt
            seq.token_ids.append(_token(seq))
            self.on_token(seq, now)
            if seq.request.context_only or seq.num_output_tokens >= seq.request.sampling_params.max_tokens:
                self.scheduler.finish(seq)
                self.live.discard(seq)
        self.kick(now)


def _token(seq: Sequence) -> int:
    # distinct per request and position, so generated blocks never look shared between requests
    return hash((seq.request.request_id, seq.num_tokens)) % 30000 + 10


class Simulation:
    """Runs requests through P prefill and D decode replicas (P = 0: decode replicas serve whole requests)."""

    def __init__(self, shape: EngineShape, model: StepModel, num_prefill: int, num_decode: int,
                 overheads: Overheads = Overheads(), concurrency: int | None = None):
        if num_decode < 1:
            raise ValueError("a deployment needs at least one decode replica")
        self.now = 0.0
        self.overheads = overheads
        self._events: list = []
        self._order = itertools.count()
        self.prefill = [_Replica(self, "prefill", shape, model, overheads, self._prefilled) for _ in range(num_prefill)]
        self.decode = [_Replica(self, "decode", shape, model, overheads, self._decoded) for _ in range(num_decode)]
        self._concurrency = concurrency
        self._in_flight = 0  # client slots taken (a slot passes straight to a waiting request)
        self._gate: deque[SimRecord] = deque()
        self._records: dict[int, SimRecord] = {}
        self._ids = itertools.count()

    def at(self, when: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def run(self, requests: list[SimRequest]) -> list[SimRecord]:
        records = [SimRecord(r, self.overheads.ttft_s) for r in requests]
        for record in records:
            self.at(record.request.arrival_s, lambda t, rec=record: self._arrive(rec, t))
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action(self.now)
        if any(r.done_s is None for r in records):
            raise RuntimeError("the simulation ended with requests unfinished (a request larger than the KV pool?)")
        load = _mean_in_flight(records)
        for r in records:
            r.ttft_overhead_s += self.overheads.ttft_per_request_s * load
        return records

    # ---- the client ----
    def _arrive(self, record: SimRecord, now: float) -> None:
        if self._concurrency is not None and self._in_flight >= self._concurrency:
            self._gate.append(record)
            return
        self._send(record, now)

    def _send(self, record: SimRecord, now: float, slot_held: bool = False) -> None:
        self._in_flight += 0 if slot_held else 1
        record.sent_s = now
        request_id = next(self._ids)
        self._records[request_id] = record
        kind = "context_only" if self.prefill else "context_and_generation"
        target = min(self.prefill or self.decode, key=_Replica.load)
        target.add(_sequence(request_id, record.request, kind))

    def _finish(self, record: SimRecord, now: float) -> None:
        record.done_s = now
        if not self._gate:
            self._in_flight -= 1
            return
        # the slot passes to the next waiting request, sent once the client has seen this one end
        waiting = self._gate.popleft()
        self.at(now + self.overheads.ttft_s, lambda t: self._send(waiting, t, slot_held=True))

    # ---- tokens ----
    def _prefilled(self, seq: Sequence, now: float) -> None:
        """A prefill replica's first token: streamed to the client, and the request handed to a decode replica."""
        record = self._records[seq.request.request_id]
        record.first_token_s = now
        if record.request.max_tokens <= 1:
            self._finish(record, now)
            return
        handed = _sequence(seq.request.request_id, record.request, "generation_only")
        decode = min(self.decode, key=_Replica.load)
        # as many blocks as it needs, in every layer group
        handed.request.kv_source = _Handle(tuple(range(len(record.request.prompt))), len(decode.shape.windows))
        decode.add(handed)

    def _decoded(self, seq: Sequence, now: float) -> None:
        record = self._records[seq.request.request_id]
        if record.first_token_s is None:
            record.first_token_s = now
        if seq.num_output_tokens >= record.request.max_tokens:
            self._finish(record, now)


def _sequence(request_id: int, request: SimRequest, kind: str) -> Sequence:
    params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
    engine_request = EngineRequest(request_id, list(request.prompt), params, kind, forked=True)
    seq = Sequence(request_id, engine_request, 0, list(request.prompt))
    engine_request.seqs.append(seq)
    return seq


def _mean_in_flight(records: list[SimRecord]) -> float:
    """Requests in flight on the serving path, averaged over the run's time (Little's law: busy time / span)."""
    start = min(r.sent_s for r in records)
    span = max(r.done_s for r in records) - start
    return sum(r.done_s - r.sent_s for r in records) / span if span > 0 else 0.0
