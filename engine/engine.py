"""LLMEngine: one engine for every role. Its loop reads like pseudocode: schedule, run, postprocess."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.disagg import KVImporter, LeaseTable, release_message
from engine.kv_cache import KVCache, KVLayout
from engine.kv_handle import KVHandle, compatibility_problems
from engine.kv_transfer import KVTransport, NixlTransport, TransferError
from engine.model import CausalLM
from engine.request import EngineRequest, Sequence
from engine.runner import ModelRunner
from engine.sampler import Sample, Sampler, SampleRow, top_logprobs
from engine.scheduler import Scheduler, SchedulerOutput
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import EngineResponse, Logprob, TokenDelta
from llmapi.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 512 << 20
    max_num_batched_tokens: int = 2048  # per-step token budget; prompts longer than this are prefilled in chunks
    max_num_seqs: int = 64
    dtype: str | None = None  # None: the checkpoint's dtype
    device: str = "cpu"
    num_threads: int | None = None
    seed: int = 0  # for requests without a seed
    kv_lease_s: float = 30.0  # how long a prefill engine holds a context-only request's blocks for the decode side
    kv_transfer_timeout_s: float = 10.0  # a decode engine's budget to read one request's prompt KV
    cluster_key: bytes | None = None  # signs KV handles; engines that exchange handles across processes share it

    def pool_blocks(self, layout: KVLayout) -> int:
        """How many KV blocks of this layout the pool holds: num_blocks, or as many as kv_cache_bytes holds."""
        return self.num_blocks or max(1, self.kv_cache_bytes // layout.block_bytes)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_bytes", "kv_lease_s",
                     "kv_transfer_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class EngineCard:
    """What one engine tells another when they first meet: how to reach its KV and what its KV is."""

    name: str
    transport_info: bytes
    layout: KVLayout
    fingerprint: str


class LLMEngine:
    def __init__(self, model_dir: str, config: EngineConfig = EngineConfig()):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model = CausalLM.from_pretrained(model_dir, dtype=config.dtype, device=config.device)
        self.spec = self.model.spec
        layout = self.model.kv_layout(config.block_size)
        num_blocks = config.pool_blocks(layout)
        self.kv_cache = KVCache(layout, num_blocks, config.device)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.sampler = Sampler(config.seed)
        self.requests: dict[int, EngineRequest] = {}
        self._pending: list[EngineResponse] = []
        self._next_seq_id = 0
        self.leases = LeaseTable(self.scheduler, config.kv_lease_s)
        self._transport: KVTransport | None = None
        self._importer: KVImporter | None = None
        self._peers: set[str] = set()  # transports we have met (compatibility checked)

    # ---- the KV plane (created on first use: a colocated engine never needs it) ----
    @property
    def transport(self) -> KVTransport:
        if self._transport is None:
            name = f"raypd-{uuid.uuid4().hex[:12]}"
            self._transport = NixlTransport(name, self.kv_cache, generations=self.block_manager.generations)
            self._importer = KVImporter(self.block_manager, self._transport, self.config.kv_transfer_timeout_s)
        return self._transport

    def card(self) -> EngineCard:
        return EngineCard(self.transport.name, self.transport.metadata(), self.kv_cache.layout, self.spec.fingerprint)

    def meet(self, name: str, transport_info: bytes, layout: KVLayout, fingerprint: str) -> None:
        """First contact with a peer engine: refuses an incompatible one, naming every mismatch, then connects."""
        if name in self._peers:
            return
        problems = compatibility_problems(self.kv_cache.layout, self.spec.fingerprint, layout, fingerprint)
        if problems:
            raise ValueError(f"engine {name!r} is incompatible with this one: " + "; ".join(problems))
        self.transport.connect(name, transport_info)
        self._peers.add(name)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # ---- requests in and out ----
    def add_request(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                    disaggregated_params: DisaggregatedParams | None = None, echo_first_tokens: bool = True) -> None:
        """Queues a request; raises ValueError naming what is wrong with it.

        context_only: prefill, sample the first token of each candidate, then hold the prompt's blocks under a lease
        and finish with DisaggregatedParams naming them. generation_only: read those blocks and decode; the first
        tokens are emitted again unless echo_first_tokens is False (an owner that already streamed them).
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} is already in use")
        self._validate(prompt_token_ids, params)
        kind = disaggregated_params.request_type if disaggregated_params else "context_and_generation"
        req = EngineRequest(request_id, list(prompt_token_ids), params, context_only=kind == "context_only")
        if kind == "generation_only":
            disaggregated_params.validate()
            handle, unreachable = self._open_handle(disaggregated_params, req)
            self.requests[request_id] = req
            self._add_generation_only(req, handle, disaggregated_params.first_gen_tokens, echo_first_tokens, unreachable)
            return
        if req.context_only:
            self.transport  # noqa: B018  (fail now, not after the prefill, if the KV plane cannot start)
        self.requests[request_id] = req
        self.scheduler.add(self._new_seq(req, 0, list(prompt_token_ids)))

    def abort_request(self, request_id: int) -> None:
        """Stops every candidate of the request and frees its blocks; it ends with finish_reason 'cancelled'."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if self._importer is not None:
            for seq in req.seqs:
                self._importer.cancel(seq)
        deltas = [self._finish(s, "cancelled", None) for s in req.seqs if not s.finished]
        del self.requests[request_id]
        self._pending.append(EngineResponse(request_id, tuple(deltas), finished=True))

    def stop_candidate(self, request_id: int, index: int) -> None:
        """Stops one candidate (a post-processor matched a stop string); the request ends when all have."""
        req = self.requests.get(request_id)
        seq = next((s for s in req.seqs if s.index == index), None) if req else None
        if seq is None or seq.finished:
            return
        delta = self._finish(seq, "stop", None)
        self._pending.append(EngineResponse(request_id, (delta,), finished=req.finished))
        if req.finished:
            del self.requests[request_id]

    @property
    def kv_bytes_read(self) -> int:
        """KV bytes this engine has imported from prefill engines (validated reads only)."""
        return self._importer.bytes_read if self._importer is not None else 0

    @property
    def last_import_s(self) -> float:
        """Seconds the latest KV import took, first READ posted to validated."""
        return self._importer.last_import_s if self._importer is not None else 0.0

    def queued_tokens(self) -> int:
        """Work this engine has accepted and not done: tokens to compute plus tokens still to generate."""
        total = 0
        for req in self.requests.values():
            left = req.sampling_params.max_tokens
            for seq in req.seqs:
                if not seq.finished:
                    total += seq.num_tokens - seq.num_computed_tokens + max(0, left - seq.num_output_tokens)
        return total

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # ---- the loop ----
    def step(self) -> list[EngineResponse]:
        if self._transport is not None:
            self._poll_kv_plane()
        out = self.scheduler.schedule()
        now = time.monotonic()
        for seq, _ in out.scheduled:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
        if out.scheduled:
            hidden, last_rows = self.runner.run(out.scheduled)
            self._keep_prompt_logits(out, hidden, last_rows)
            samples = self._sample(out, hidden, last_rows)
            self._postprocess(out, samples)
        responses, self._pending = self._pending, []
        return responses

    def _sample(self, out: SchedulerOutput, hidden: torch.Tensor, last_rows: list[int]) -> dict[Sequence, list[Sample]]:
        """Samples for every scheduled sequence whose new tokens reach its end; a request's first sample draws
        one token per candidate from the same logits."""
        rows, owners, flat = [], [], []
        for (seq, n), row in zip(out.scheduled, last_rows):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end yet
            count = seq.request.sampling_params.num_candidates if not seq.request.forked else 1
            for k in range(count):
                index = k if not seq.request.forked else seq.index
                rows.append(SampleRow(seq.request.sampling_params, index, seq.num_tokens))
                owners.append(seq)
                flat.append(row)
        if not rows:
            return {}
        samples = self.sampler(self.runner.logits(hidden, flat), rows)
        by_seq: dict[Sequence, list[Sample]] = {}
        for seq, sample in zip(owners, samples):
            by_seq.setdefault(seq, []).append(sample)
        return by_seq

    def _postprocess(self, out: SchedulerOutput, samples: dict[Sequence, list[Sample]]) -> None:
        deltas: dict[int, list[TokenDelta]] = {}
        for seq, seq_samples in samples.items():
            req = seq.request
            if req.context_only:
                self._finish_context(seq, seq_samples)
                continue
            new_seqs = self._fork(seq, seq_samples) if not req.forked else [(seq, seq_samples[0])]
            for s, sample in new_seqs:
                deltas.setdefault(req.request_id, []).append(self._append(s, sample))
        for request_id, ds in deltas.items():
            self._pending.append(self._response(self.requests[request_id], ds))

    def _fork(self, seq: Sequence, samples: list[Sample]) -> list[tuple[Sequence, Sample]]:
        """Creates the request's other candidates from its first sequence, sharing the prompt's blocks."""
        req = seq.request
        req.forked = True
        children = [self._new_seq(req, k, list(seq.token_ids)) for k in range(1, len(samples))]
        for child in children:
            self._share_prompt(seq, child)
        return list(zip([seq, *children], samples))

    def _share_prompt(self, seq: Sequence, child: Sequence) -> None:
        """child starts from seq's computed prompt: shared full blocks, a private copy of a partial last one."""
        if not self.block_manager.can_fork():
            self.scheduler.add(child)  # no block for the copy: the child recomputes its prompt later
            return
        copy = self.block_manager.fork(seq, child)
        if copy is not None:
            self.kv_cache.copy_block(*copy)
        child.num_computed_tokens = seq.num_computed_tokens
        self.scheduler.add_running(child)

    def _append(self, seq: Sequence, sample: Sample) -> TokenDelta:
        seq.token_ids.append(sample.token_id)
        seq.cumulative_logprob += sample.logprob
        reason, stop = self._finish_reason(seq, sample.token_id)
        if reason is not None:
            return self._finish(seq, reason, stop, (sample.token_id,), sample)
        logprobs = (sample.top_logprobs,) if sample.top_logprobs is not None else None
        return TokenDelta(seq.index, (sample.token_id,), seq.cumulative_logprob, logprobs)

    def _finish_reason(self, seq: Sequence, token: int, num_output_tokens: int | None = None):
        """(finish_reason, stop_reason) after seq got token, or (None, None) if it goes on."""
        params = seq.request.sampling_params
        outputs = seq.num_output_tokens if num_output_tokens is None else num_output_tokens
        if not params.ignore_eos and token in self.spec.eos_token_ids:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if outputs >= params.max_tokens or seq.request.num_prompt_tokens + outputs >= self.spec.max_position_embeddings:
            return "length", None
        return None, None

    def _finish(self, seq, reason, stop_reason, tokens=(), sample: Sample | None = None) -> TokenDelta:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        logprobs = (sample.top_logprobs,) if sample is not None and sample.top_logprobs is not None else None
        return TokenDelta(seq.index, tuple(tokens), seq.cumulative_logprob, logprobs, reason, stop_reason)

    def _response(self, req: EngineRequest, deltas: list[TokenDelta], **extra) -> EngineResponse:
        first = not req.reported_queue_time
        req.reported_queue_time = True
        finished = req.finished
        if finished:
            del self.requests[req.request_id]
        if first and req.prompt_logits:
            extra.update(self._prompt_outputs(req))
        queue_time = req.first_scheduled_time - req.arrival_time if first else None
        return EngineResponse(req.request_id, tuple(deltas), finished, queue_time=queue_time, **extra)

    # ---- disaggregation ----
    def _finish_context(self, seq: Sequence, samples: list[Sample]) -> None:
        """Context-only: report each candidate's first token and hold the prompt's blocks for the decode side."""
        req = seq.request
        req.forked = True
        deltas = []
        for k, sample in enumerate(samples):
            reason, stop = self._finish_reason(seq, sample.token_id, num_output_tokens=1)
            logprobs = (sample.top_logprobs,) if sample.top_logprobs is not None else None
            deltas.append(TokenDelta(k, (sample.token_id,), sample.logprob, logprobs, reason or "length", stop))
        seq.finish_reason = "length"
        blocks = tuple(seq.block_table[: self.block_manager.blocks_for(req.num_prompt_tokens)])
        handle = KVHandle(
            ctx_request_id=req.request_id, agent=self.transport.name, transport_info=self.transport.metadata(),
            block_ids=blocks, generations=tuple(self.block_manager.generations[list(blocks)].tolist()),
            num_tokens=req.num_prompt_tokens, layout=self.kv_cache.layout, fingerprint=self.spec.fingerprint,
            lease_deadline=self.leases.hold(req.request_id, seq),
            first_logprobs=tuple(s.logprob for s in samples),
            first_top_logprobs=tuple(_triples(s.top_logprobs) for s in samples),
        )
        params = DisaggregatedParams(
            "context_only", first_gen_tokens=[s.token_id for s in samples], ctx_request_id=req.request_id,
            opaque_state=handle.sign(self.config.cluster_key),
        )
        self._pending.append(self._response(req, deltas, disaggregated_params=params))

    def _open_handle(self, params: DisaggregatedParams, req: EngineRequest) -> tuple[KVHandle, str | None]:
        """The verified handle, and why its engine cannot be reached (then the request prefills here)."""
        handle = KVHandle.open(params.opaque_state, self.config.cluster_key)
        unreachable = None
        try:
            self.meet(handle.agent, handle.transport_info, handle.layout, handle.fingerprint)
        except TransferError as e:
            unreachable = str(e)
        if handle.num_tokens != req.num_prompt_tokens:
            raise ValueError(f"the KV handle holds {handle.num_tokens} prompt tokens, the prompt has {req.num_prompt_tokens}")
        count = req.sampling_params.num_candidates
        if len(params.first_gen_tokens) != count:
            raise ValueError(f"first_gen_tokens has {len(params.first_gen_tokens)} tokens for {count} candidates")
        return handle, unreachable

    def _add_generation_only(self, req: EngineRequest, handle: KVHandle, first: list[int], echo: bool,
                             unreachable: str | None) -> None:
        """Starts from the prefill side's first tokens; the prompt's KV is read before the request joins the batch."""
        req.forked = True
        req.first_scheduled_time = req.arrival_time
        deltas, alive = [], []
        for k, token in enumerate(first):
            seq = self._new_seq(req, k, req.prompt_token_ids + [token])
            seq.cumulative_logprob = handle.first_logprobs[k] if handle.first_logprobs else 0.0
            top = {t: Logprob(lp, r) for t, lp, r in handle.first_top_logprobs[k]} if handle.first_top_logprobs else None
            reason, stop = self._finish_reason(seq, token)
            if reason is not None:
                seq.finish_reason, seq.stop_reason = reason, stop
                self.scheduler.finish(seq)
            else:
                alive.append(seq)
            wanted = (top,) if echo and req.sampling_params.logprobs is not None and top else None
            tokens = (token,) if echo else ()
            deltas.append(TokenDelta(k, tokens, seq.cumulative_logprob, wanted, reason, stop))
        self._pending.append(self._response(req, deltas))
        if not alive:
            if not unreachable:
                self._release_unread(handle)
            self.requests.pop(req.request_id, None)
            return
        req.followers = alive[1:]
        if unreachable:
            self._import_done(alive[0], unreachable)
        else:
            self._importer.add(alive[0], handle)

    def release_kv(self, params: DisaggregatedParams) -> None:
        """Tells the prefill engine named by a KV handle that its blocks will not be read (the request ended before
        decoding): it frees them now instead of when the lease ends. Refuses a handle whose signature fails."""
        handle = KVHandle.open(params.opaque_state, self.config.cluster_key)
        try:
            self.meet(handle.agent, handle.transport_info, handle.layout, handle.fingerprint)
        except TransferError as e:
            log.info("prefill engine of context request %d unreachable: %s", handle.ctx_request_id, e)
            return
        self._release_unread(handle)

    def _release_unread(self, handle: KVHandle) -> None:
        try:
            self.transport.send_notification(handle.agent, release_message(handle.ctx_request_id))
        except TransferError as e:  # the lease ends on its own
            log.info("could not release context request %d early: %s", handle.ctx_request_id, e)

    def _poll_kv_plane(self) -> None:
        self.leases.on_notifications(self._transport.poll_notifications())
        self.leases.expire()
        for seq, problem in self._importer.poll():
            self._import_done(seq, problem)

    def _import_done(self, seq: Sequence, problem: str | None) -> None:
        """The prompt KV is in place (problem None): decode. Otherwise prefill the prompt here, same tokens."""
        if problem is None:
            seq.num_computed_tokens = seq.request.num_prompt_tokens
            self.scheduler.add_running(seq)
        else:
            log.warning("request %d re-prefills locally: %s", seq.request.request_id, problem)
            self._importer.cancel(seq)
            self.block_manager.free(seq)
            self.scheduler.add(seq)
        for follower in seq.request.followers:
            self._share_prompt(seq, follower) if problem is None else self.scheduler.add(follower)
        seq.request.followers = []

    # ---- prompt logits (prompt_logprobs, return_context_logits) ----
    def _keep_prompt_logits(self, out: SchedulerOutput, hidden: torch.Tensor, last_rows: list[int]) -> None:
        for (seq, n), last in zip(out.scheduled, last_rows):
            req = seq.request
            if req.forked or not req.wants_prompt_logits:
                continue
            start = seq.num_computed_tokens
            count = min(n, req.num_prompt_tokens - start)
            rows = list(range(last - n + 1, last - n + 1 + count))
            for pos, logits in zip(range(start, start + count), self.runner.logits(hidden, rows)):
                req.prompt_logits[pos] = logits

    def _prompt_outputs(self, req: EngineRequest) -> dict:
        logits = torch.stack([req.prompt_logits[p] for p in range(req.num_prompt_tokens)])  # (P, vocab)
        req.prompt_logits = {}
        out = {}
        params = req.sampling_params
        if params.return_context_logits:
            out["context_logits"] = logits
        if params.prompt_logprobs is not None:
            lp = torch.log_softmax(logits, dim=-1)
            ids = req.prompt_token_ids
            out["prompt_logprobs"] = [None] + [top_logprobs(lp[i - 1], ids[i], params.prompt_logprobs) for i in range(1, len(ids))]
        return out

    # ---- helpers ----
    def _new_seq(self, req: EngineRequest, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, req, index, token_ids)
        self._next_seq_id += 1
        req.seqs.append(seq)
        return seq

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < self.spec.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.spec.vocab_size}): {bad[:5]}")
        limit = self.spec.max_position_embeddings
        if len(prompt) + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the context length {limit}"
            )
        need = self.block_manager.blocks_for(len(prompt) + params.max_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"request needs {need} KV blocks, the pool has {self.block_manager.num_blocks}")


def _triples(top: dict[int, Logprob] | None) -> tuple[tuple[int, float, int], ...]:
    return tuple((t, lp.logprob, lp.rank) for t, lp in (top or {}).items())
