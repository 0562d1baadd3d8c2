"""LLMEngine: one engine for every role. Its loop reads like pseudocode: schedule, run, postprocess."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.request import EngineRequest, Sequence
from engine.runner import ModelRunner
from engine.sampler import Sample, Sampler, SampleRow, top_logprobs
from engine.scheduler import Scheduler, SchedulerOutput
from llmapi.outputs import EngineResponse, TokenDelta
from llmapi.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 512 << 20
    max_num_batched_tokens: int = 1024  # per-step token budget; prompts longer than this are prefilled in chunks
    max_num_seqs: int = 64
    dtype: str | None = None  # None: the checkpoint's dtype
    device: str = "cpu"
    num_threads: int | None = None
    seed: int = 0  # for requests without a seed

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")


class LLMEngine:
    def __init__(self, model_dir: str, config: EngineConfig = EngineConfig()):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model = CausalLM.from_pretrained(model_dir, dtype=config.dtype, device=config.device)
        self.spec = self.model.spec
        layout = self.model.kv_layout(config.block_size)
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // layout.block_bytes)
        self.kv_cache = KVCache(layout, num_blocks, config.device)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.sampler = Sampler(config.seed)
        self.requests: dict[int, EngineRequest] = {}
        self._pending: list[EngineResponse] = []
        self._next_seq_id = 0

    # ---- requests in and out ----
    def add_request(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queues a request; raises ValueError naming what is wrong with it."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} is already in use")
        self._validate(prompt_token_ids, params)
        req = EngineRequest(request_id, list(prompt_token_ids), params)
        self.requests[request_id] = req
        self.scheduler.add(self._new_seq(req, 0, list(prompt_token_ids)))

    def abort_request(self, request_id: int) -> None:
        """Stops every candidate of the request and frees its blocks; it ends with finish_reason 'cancelled'."""
        req = self.requests.get(request_id)
        if req is None:
            return
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

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # ---- the loop ----
    def step(self) -> list[EngineResponse]:
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
            new_seqs = self._fork(seq, seq_samples) if not req.forked else [(seq, seq_samples[0])]
            for s, sample in new_seqs:
                deltas.setdefault(req.request_id, []).append(self._append(s, sample))
        for request_id, ds in deltas.items():
            self._pending.append(self._response(self.requests[request_id], ds))

    def _fork(self, seq: Sequence, samples: list[Sample]) -> list[tuple[Sequence, Sample]]:
        """Creates the request's other candidates from its first sequence, sharing the prompt's blocks."""
        req = seq.request
        req.forked = True
        pairs = [(seq, samples[0])]
        for k, sample in enumerate(samples[1:], start=1):
            child = self._new_seq(req, k, list(seq.token_ids))
            if self.block_manager.can_fork():
                copy = self.block_manager.fork(seq, child)
                if copy is not None:
                    self.kv_cache.copy_block(*copy)
                child.num_computed_tokens = seq.num_computed_tokens
                self.scheduler.add_running(child)
            else:  # no block for a private copy: the child recomputes its prompt later
                self.scheduler.add(child)
            pairs.append((child, sample))
        return pairs

    def _append(self, seq: Sequence, sample: Sample) -> TokenDelta:
        seq.token_ids.append(sample.token_id)
        seq.cumulative_logprob += sample.logprob
        reason, stop = self._finish_reason(seq, sample.token_id)
        if reason is not None:
            return self._finish(seq, reason, stop, (sample.token_id,), sample)
        logprobs = (sample.top_logprobs,) if sample.top_logprobs is not None else None
        return TokenDelta(seq.index, (sample.token_id,), seq.cumulative_logprob, logprobs)

    def _finish_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        params = seq.request.sampling_params
        if not params.ignore_eos and token in self.spec.eos_token_ids:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.spec.max_position_embeddings:
            return "length", None
        return None, None

    def _finish(self, seq, reason, stop_reason, tokens=(), sample: Sample | None = None) -> TokenDelta:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        logprobs = (sample.top_logprobs,) if sample is not None and sample.top_logprobs is not None else None
        return TokenDelta(seq.index, tuple(tokens), seq.cumulative_logprob, logprobs, reason, stop_reason)

    def _response(self, req: EngineRequest, deltas: list[TokenDelta]) -> EngineResponse:
        first = not req.reported_queue_time
        req.reported_queue_time = True
        finished = req.finished
        if finished:
            del self.requests[req.request_id]
        extra = self._prompt_outputs(req) if first and req.wants_prompt_logits else {}
        queue_time = req.first_scheduled_time - req.arrival_time if first else None
        return EngineResponse(req.request_id, tuple(deltas), finished, queue_time=queue_time, **extra)

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
