"""OutputProcessor: what a step's samples do to the requests. Forks a request's candidates at its first sample,
appends tokens, applies finish and stop rules, keeps prompt logits, ends context-only requests with a hand-off, and
builds the RequestDeltas. A generation-only request starts here too, from the first tokens the prefill side sampled,
exactly as if they were its first sample.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.config import ModelSpec
from engine.sampling.grammar import Grammars
from engine.kv.kv_connector import KVConnector
from engine.core.request import EngineRequest, Sequence
from engine.sampling.sampler import Sample, top_logprobs
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.model.executor import ModelOutput
from engine.model.runner import ModelRunner
from llmapi.outputs import Handoff, Logprob, RequestDelta, TokenDelta


class OutputProcessor:
    """runner: copies a fork's partial block (on every tensor-parallel rank)."""

    def __init__(self, spec: ModelSpec, scheduler: Scheduler, runner: ModelRunner, connector: KVConnector,
                 requests: dict[int, EngineRequest], grammars: Grammars):
        self.spec = spec
        self.grammars = grammars
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.runner = runner
        self.connector = connector
        self.requests = requests  # the engine's live requests; a request leaves it with its final response
        self._pending: list[RequestDelta] = []
        self._next_seq_id = 0

    # ---- sequences ----
    def new_seq(self, req: EngineRequest, index: int, token_ids: list[int]) -> Sequence:
        """A candidate from token_ids (the prompt, or prompt + output so far); a grammar's matcher replays the output
        (a resumed candidate). Raises ValueError if the request's grammar does not compile for this vocabulary."""
        seq = Sequence(self._next_seq_id, req, index, token_ids)
        guided = req.sampling_params.guided_decoding
        if guided is not None:
            seq.grammar = self.grammars.matcher(guided)
            seq.grammar.accept_all(token_ids[req.num_prompt_tokens:])
        self._next_seq_id += 1
        req.seqs.append(seq)
        return seq

    # ---- one step ----
    def update(self, out: SchedulerOutput, model_out: ModelOutput) -> list[RequestDelta]:
        """Applies a step's model output; returns every response due (including those of aborts, stops and imports
        since the last step)."""
        for seq, logits in model_out.prompt_logits.items():
            seq.request.prompt_logits.update(logits)
        self.scheduler.on_computed(out)
        deltas: dict[int, list[TokenDelta]] = {}
        for seq, samples in model_out.samples.items():
            req = seq.request
            if req.context_only:
                self._end_context(seq, samples)
                continue
            if req.forked:
                deltas.setdefault(req.request_id, []).append(self._append_verified(seq, samples))
                continue
            for s, sample in self._fork(seq, samples):
                deltas.setdefault(req.request_id, []).append(self._append(s, sample))
        for request_id, ds in deltas.items():
            self._pending.append(self._response(self.requests[request_id], ds))
        responses, self._pending = self._pending, []
        return responses

    def start_generation(self, seqs: list[Sequence]) -> None:
        """Generation-only requests whose KV import ended (in place, or failed and back to waiting): their
        candidates start from the prefill side's first tokens."""
        for seq in seqs:
            req = seq.request
            samples = [Sample(t.token_id, t.logprob, {tok: Logprob(lp, r) for tok, lp, r in t.top_logprobs} or None)
                       for t in req.first_tokens]
            deltas = [self._append(s, sample, echo=req.echo_first_tokens) for s, sample in self._fork(seq, samples)]
            self._pending.append(self._response(req, deltas))

    def abort(self, req: EngineRequest) -> None:
        deltas = [self._finish(s, "cancelled", None) for s in req.seqs if not s.finished]
        self._leave(req)
        self._pending.append(RequestDelta(req.request_id, tuple(deltas), finished=True))

    def fail(self, req: EngineRequest, why: str, retry_whole: bool = False) -> None:
        """Ends the request with an error (every candidate's finish_reason 'error'): it cannot go on here.
        retry_whole: its owner may serve it again whole elsewhere (RequestDelta.retry_whole)."""
        deltas = [self._finish(s, "error", None) for s in req.seqs if not s.finished]
        self._leave(req)
        self._pending.append(RequestDelta(req.request_id, tuple(deltas), finished=True, error=why,
                                          retry_whole=retry_whole))

    def stop(self, req: EngineRequest, seq: Sequence) -> None:
        delta = self._finish(seq, "stop", None)
        self._pending.append(RequestDelta(req.request_id, (delta,), finished=req.finished))
        if req.finished:
            self._leave(req)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    # ---- candidates ----
    def _fork(self, seq: Sequence, samples: list[Sample]) -> list[tuple[Sequence, Sample]]:
        """Creates the request's other candidates from its first sequence, sharing the prompt's blocks."""
        req = seq.request
        req.forked = True
        children = [self.new_seq(req, k, list(seq.token_ids)) for k in range(1, len(samples))]
        for child in children:
            self._share_prompt(seq, child)
        return list(zip([seq, *children], samples))

    def _share_prompt(self, seq: Sequence, child: Sequence) -> None:
        """child starts from seq's computed prompt: shared full blocks, a private copy of a partial last one."""
        full = seq.num_prompt_tokens // self.block_manager.block_size
        child.block_hashes = list(seq.block_hashes[:full])
        if seq.num_computed_tokens < seq.num_prompt_tokens or not self.block_manager.can_fork():
            self.scheduler.add(child)  # no KV to share, or no block for the copy: the child computes its prompt
            return
        for src, dst in self.block_manager.fork(seq, child):
            self.runner.copy_block(src, dst)
        child.num_computed_tokens = seq.num_computed_tokens
        self.scheduler.add_running(child)

    def _append(self, seq: Sequence, sample: Sample, echo: bool = True) -> TokenDelta:
        seq.token_ids.append(sample.token_id)
        if seq.grammar is not None:
            seq.grammar.accept(sample.token_id)
        seq.cumulative_logprob += sample.logprob
        tokens = (sample.token_id,) if echo else ()
        logprobs = (sample.top_logprobs,) if echo and sample.top_logprobs is not None else None
        reason, stop = self._finish_reason(seq, sample.token_id)
        if reason is not None:
            return self._finish(seq, reason, stop, tokens, logprobs)
        return TokenDelta(seq.index, tokens, seq.cumulative_logprob, logprobs)

    def _append_verified(self, seq: Sequence, samples: list[Sample]) -> TokenDelta:
        """Appends the step's first sample, then each draft token's following sample while the draft token equals
        the sample at its place (its KV, computed from it, then holds): the tokens are those of a step per token.
        The rest of the drafts' KV slots are dropped, with the blocks past the sequence's end."""
        draft, seq.draft = seq.draft, []
        delta = self._append(seq, samples[0])
        accepted = 0
        for token, sample in zip(draft, samples[1:]):
            if seq.finished or token != seq.token_ids[-1]:
                break
            seq.num_computed_tokens += 1
            accepted += 1
            delta = _merge(delta, self._append(seq, sample))
        if not draft:
            return delta
        self.scheduler.drafter.record(len(draft), accepted)
        if not seq.finished:
            self.block_manager.trim(seq)
        return dataclasses.replace(delta, num_draft_tokens=len(draft), num_accepted_draft_tokens=accepted)

    def _finish_reason(self, seq: Sequence, token: int, num_output_tokens: int | None = None):
        """(finish_reason, stop_reason) after seq got token, or (None, None) if it goes on."""
        params = seq.request.sampling_params
        outputs = seq.num_output_tokens if num_output_tokens is None else num_output_tokens
        if not params.ignore_eos and token in self.spec.eos_token_ids:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        grammar = seq.grammar
        if grammar is not None and (grammar.done if num_output_tokens is None else grammar.done_after(token)):
            return "stop", None  # the grammar is complete: nothing but EOS could follow
        if outputs >= params.max_tokens or seq.request.num_prompt_tokens + outputs >= self.spec.max_position_embeddings:
            return "length", None
        return None, None

    def _finish(self, seq: Sequence, reason: str, stop_reason, tokens=(), logprobs=None) -> TokenDelta:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        return TokenDelta(seq.index, tuple(tokens), seq.cumulative_logprob, logprobs, reason, stop_reason)

    # ---- the end of a context-only request ----
    def _end_context(self, seq: Sequence, samples: list[Sample]) -> None:
        """Reports each candidate's first token; the prompt's blocks are held under a lease for the decode side,
        unless every candidate ended with its first token (then nothing will read them: freed now). A speculating
        engine drafts after the first token (one candidate); a draft model's KV of the prompt is held with them."""
        req = seq.request
        req.forked = True
        deltas = []
        for k, sample in enumerate(samples):
            reason, stop = self._finish_reason(seq, sample.token_id, num_output_tokens=1)
            logprobs = (sample.top_logprobs,) if sample.top_logprobs is not None else None
            deltas.append(TokenDelta(k, (sample.token_id,), sample.logprob, logprobs, reason, stop))
        if all(d.finish_reason for d in deltas):
            self.scheduler.finish(seq)
            self._pending.append(self._response(req, deltas))
            return
        drafter = self.scheduler.drafter
        drafts = drafter.first_drafts(seq, samples[0].token_id) if drafter is not None and len(samples) == 1 else []
        draft_kv = drafter.lease_blocks(seq, req.num_prompt_tokens) if drafter is not None else None
        blocks, starts = self.block_manager.lease_blocks(seq, req.num_prompt_tokens)
        opaque = self.connector.hold(req.request_id, blocks, req.num_prompt_tokens, [s.logprob for s in samples],
                                     [_triples(s.top_logprobs) for s in samples], req.mm_items, starts, draft_kv)
        self.scheduler.hold(seq)
        handoff = Handoff(req.request_id, tuple(s.token_id for s in samples), opaque, tuple(drafts))
        self._pending.append(self._response(req, deltas, handoff=handoff))

    # ---- responses ----
    def _response(self, req: EngineRequest, deltas: list[TokenDelta], handoff: Handoff | None = None
                  ) -> RequestDelta:
        first = not req.reported_queue_time
        req.reported_queue_time = True
        finished = req.finished and handoff is None
        if finished or handoff is not None:
            self._leave(req)
        extra = self._prompt_outputs(req) if first and req.prompt_logits else {}
        queue_time = req.first_scheduled_time - req.arrival_time if first else None
        cached = req.num_cached_tokens if first else None
        return RequestDelta(req.request_id, tuple(deltas), finished, queue_time=queue_time, handoff=handoff,
                              num_cached_tokens=cached, **extra)

    def _leave(self, req: EngineRequest) -> None:
        """The request is done on this engine (its blocks may still be held under a KV lease)."""
        self.requests.pop(req.request_id, None)
        req.mm_embeddings = ()  # nothing computes its prompt again; a held request must not pin them

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
            out["prompt_logprobs"] = [None] + [top_logprobs(lp[i - 1], ids[i], params.prompt_logprobs)
                                               for i in range(1, len(ids))]
        return out


def _merge(first: TokenDelta, then: TokenDelta) -> TokenDelta:
    """One candidate's tokens of one step as one delta (speculation accepts several)."""
    logprobs = None if first.logprobs is None else first.logprobs + (then.logprobs or ())
    return dataclasses.replace(then, token_ids=first.token_ids + then.token_ids, logprobs=logprobs)


def _triples(top: dict[int, Logprob] | None) -> tuple[tuple[int, float, int], ...]:
    return tuple((t, lp.logprob, lp.rank) for t, lp in (top or {}).items())
