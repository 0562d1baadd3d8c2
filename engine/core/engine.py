"""LLMEngine: one engine for every role. Its step reads like vLLM v1's: poll the KV connector, schedule, run the
model, update from the output. Requests are validated here and then live in the scheduler's queues."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from engine.kv.block_manager import BlockManager
from engine.model.executor import ModelExecutor
from engine.sampling.grammar import Grammars
from engine.model.kernels import cpu_kernels
from engine.kv.kv_cache import KVCache, KVLayout
from engine.kv.kv_connector import EngineCard, KVConnector, NullConnector
from engine.model.causal_lm import CausalLM
from engine.config import load_spec
from engine.parallel.host_cores import FixedThreads, HostCores
from engine.parallel.ranks import START_TIMEOUT_S, RankGroup
from engine.parallel.shard import SINGLE, check_shardable
from engine.core.output_processor import OutputProcessor
from engine.core.request import EngineRequest, FirstToken, MultimodalItem
from engine.model.runner import ModelRunner
from engine.sampling.sampler import Sampler
from engine.spec.config import SpeculativeConfig
from engine.spec.drafter import Drafter
from engine.spec.ngram import NgramDrafter
from engine.core.scheduler import Scheduler
from engine.core.validation import check_images, check_request
from llmapi.disaggregated_params import DisaggregatedParams, request_type
from llmapi.outputs import RequestDelta, Resume
from llmapi.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    # None: as many as kv_cache_bytes holds. Counted in blocks of every layer: a model with G layer groups
    # (engine/kv/kv_cache.py) gets G times as many blocks, each of its groups' layers, in the same memory.
    num_blocks: int | None = None
    kv_cache_bytes: int = 512 << 20
    max_num_batched_tokens: int = 2048  # per-step token budget; prompts longer than this are prefilled in chunks
    max_num_seqs: int = 64
    dtype: str | None = None  # None: the checkpoint's dtype; "auto": engine.config.auto_dtype's choice
    device: str = "cpu"
    num_threads: int | None = None
    seed: int = 0  # for requests without a seed
    enable_prefix_caching: bool = True  # full blocks of earlier prompts are reused, not recomputed
    kv_lease_s: float = 30.0  # how long a prefill engine holds a context-only request's blocks for the decode side
    kv_transfer_timeout_s: float = 10.0  # a decode engine's budget to read one request's prompt KV
    cluster_key: bytes | None = None  # signs KV handles; engines that exchange handles across processes share it
    # Ranks the model is split over (engine/parallel/): this engine is rank 0; the others are started as processes on
    # this host unless the engine is given them (a Ray replica starts them as actors).
    tensor_parallel_size: int = 1
    # Every query attends through the one per-query kernel, prefill tokens too: a sequence's logits are then the same
    # bits whatever it is batched with, however its prompt is chunked, wherever it was prefilled, and after a resume
    # (the linears, norms and sampler are per-row already). Costs prefill speed (docs/performance.md). One rank only.
    batch_invariant: bool = False
    speculative_config: SpeculativeConfig | None = None  # speculative decoding (engine/spec/); None: off
    # Forwards of prompt chunks (>= 128 tokens) run on the host's cores no other engine is computing on, never on fewer
    # than num_threads (engine/parallel/host_cores.py). Needs num_threads; one rank only; off under batch_invariant
    # (whose promise is bits, and a GEMM's bits may depend on its thread count on some CPUs).
    borrow_idle_cores: bool = False

    def pool_blocks(self, layout: KVLayout) -> int:
        """How many KV blocks of this layout the pool holds: num_blocks (of every layer) in blocks of one layer
        group, or as many as kv_cache_bytes holds."""
        if self.num_blocks:
            return self.num_blocks * len(layout.groups)
        return max(1, self.kv_cache_bytes // layout.block_bytes)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "kv_cache_bytes", "kv_lease_s",
                     "kv_transfer_timeout_s", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("EngineConfig.batch_invariant is built for one rank; tensor_parallel_size is "
                             f"{self.tensor_parallel_size}")


def _local_ranks(model_dir: str, config: EngineConfig, kv_transfer: bool) -> RankGroup | None:
    """Ranks 1..N-1 as child processes, when the config asks for tensor parallelism (kv_transfer: each exposes
    its KV pool for hand-offs)."""
    if config.tensor_parallel_size == 1:
        return None
    check_shardable(load_spec(model_dir), config.tensor_parallel_size)  # before any process starts
    from engine.parallel.local import start_local_ranks

    return start_local_ranks(model_dir, config.tensor_parallel_size, config.dtype, config.device,
                             config.num_threads, config.block_size, kv_transfer)


def nixl_connector(config: EngineConfig) -> KVConnector:
    """The KV connector of engines that exchange KV (prefill and decode roles); imports nixl."""
    from engine.kv.nixl_connector import NixlConnector

    return NixlConnector(config.kv_lease_s, config.kv_transfer_timeout_s, config.cluster_key)


class LLMEngine:
    """connector: how this engine exchanges KV with others; None: NullConnector (colocated, no nixl).
    ranks: the other tensor-parallel ranks, started and joined (their RankSetup sent); None with
    config.tensor_parallel_size > 1 starts them here as child processes. The engine closes them."""

    def __init__(self, model_dir: str, config: EngineConfig = EngineConfig(), connector: KVConnector | None = None,
                 ranks: RankGroup | None = None):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.ranks = ranks or _local_ranks(model_dir, config, connector is not None and connector.per_rank_kv)
        try:
            self._build(model_dir, config, connector)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise

    def _build(self, model_dir: str, config: EngineConfig, connector: KVConnector | None) -> None:
        shard = self.ranks.shard if self.ranks is not None else SINGLE
        self.model = CausalLM.from_pretrained(model_dir, dtype=config.dtype, device=config.device, shard=shard,
                                              batch_invariant=config.batch_invariant)
        self.spec = self.model.spec
        layout = self.model.kv_layout(config.block_size)
        num_blocks = config.pool_blocks(layout)
        if self.ranks is not None:
            self.ranks.start(num_blocks, time.monotonic() + START_TIMEOUT_S)
        self.kv_cache = KVCache(layout, num_blocks, config.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          layout.group_windows)
        self.connector = connector or NullConnector()
        self.connector.register_kv_cache(self.kv_cache, self.block_manager.generations, self.spec.fingerprint,
                                         self.ranks)
        drafter = self._drafter(config, layout)
        self.scheduler = Scheduler(self.block_manager, self.connector, config.max_num_batched_tokens,
                                   config.max_num_seqs, drafter)
        # Logits reach the sampler on the CPU whatever the model's device: the fused sampling kernel serves both.
        runner = ModelRunner(self.model, self.kv_cache, self.ranks)
        self.executor = ModelExecutor(runner, Sampler(config.seed, cpu_kernels()), self._cores(config))
        self.requests: dict[int, EngineRequest] = {}
        self.output = OutputProcessor(self.spec, self.scheduler, runner, self.connector, self.requests,
                                      Grammars(model_dir, self.spec.vocab_size))

    def _cores(self, config: EngineConfig) -> HostCores | FixedThreads:
        if config.borrow_idle_cores and config.num_threads and self.ranks is None and config.device == "cpu" \
                and not config.batch_invariant:
            return HostCores(config.num_threads)
        return FixedThreads()

    def _drafter(self, config: EngineConfig, layout: KVLayout) -> Drafter | None:
        spec = config.speculative_config
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramDrafter(spec, self.spec.max_position_embeddings)
        from engine.spec.draft_model import DraftModelDrafter  # loads a second checkpoint

        capacity = self.block_manager.num_blocks // len(layout.groups) * config.block_size
        drafter = DraftModelDrafter(spec, self.spec.max_position_embeddings, self.spec.vocab_size, config.block_size,
                                    capacity, config.dtype, config.device, cpu_kernels())
        # the draft's KV of a prompt travels with the target's in a hand-off (engine/kv/kv_handle.py, DraftKV)
        self.connector.register_draft_cache(drafter.kv_cache, drafter.block_manager.generations, drafter.fingerprint)
        return drafter

    # ---- the loop ----
    def step(self) -> list[RequestDelta]:
        self._poll_kv_connector()
        out = self.scheduler.schedule()
        model_out = self.executor.execute(out)
        return self.output.update(out, model_out)

    def _poll_kv_connector(self) -> None:
        """Reads that ended start their candidates from the prefill side's first tokens; ended leases are freed;
        a request whose read failed and that cannot recompute its prompt here ends with the reason, for its owner
        to serve again whole."""
        started, failed = self.scheduler.update_from_connector(self.connector.poll())
        self.output.start_generation(started)
        for seq, why in failed:
            self.output.fail(seq.request, why, retry_whole=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self.output.has_pending

    def has_kv_reads(self) -> bool:
        """Whether reads of other engines' KV are in flight (their end starts decoding)."""
        return bool(self.scheduler.waiting_for_kv)

    def has_runnable(self) -> bool:
        """Whether a step would compute something now (not only wait on KV reads or leases)."""
        return bool(self.scheduler.waiting or self.scheduler.running) or self.output.has_pending

    # ---- requests in and out ----
    def add_request(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                    disaggregated_params: DisaggregatedParams | None = None, echo_first_tokens: bool = True,
                    mm_items: tuple[MultimodalItem, ...] = (), mm_embeddings: tuple[torch.Tensor, ...] = (),
                    resume: Resume | None = None) -> None:
        """Queues a request; raises ValueError naming what is wrong with it.

        mm_items / mm_embeddings: each image's place in the prompt and its (length, hidden) embeddings, spliced at
        those positions. context_only: prefill, sample the first token of each candidate, then end with a Handoff
        (the prompt's blocks held under a lease; the KV handle carries the items, never the embeddings).
        generation_only: read those blocks and decode, keyed by the handle's items; the first tokens are emitted
        again unless echo_first_tokens is False (an owner that already streamed them). resume: continue the given
        candidates from their tokens so far (computed here again; only new tokens are emitted).
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id} is already in use")
        check_request(prompt_token_ids, params, self.spec, self.block_manager, self.config)
        kind = request_type(disaggregated_params)
        req = EngineRequest(request_id, list(prompt_token_ids), params, kind, cache_salt=params.cache_salt,
                            mm_items=tuple(mm_items), mm_embeddings=tuple(mm_embeddings),
                            echo_first_tokens=echo_first_tokens)
        if kind == "generation_only":
            self._attach_kv_source(req, disaggregated_params)
        else:
            check_images(req, self.spec.hidden_size)
        if kind == "context_only":
            self.connector.card()  # fails now, not after the prefill, if this engine cannot hand KV over
        if resume is not None:
            self._resume(req, resume)
            return
        seq = self.output.new_seq(req, 0, list(prompt_token_ids))  # compiles the request's grammar, if any
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def _resume(self, req: EngineRequest, resume: Resume) -> None:
        params = req.sampling_params
        if req.kind != "context_and_generation":
            raise ValueError(f"a resumed request is served whole, not {req.kind}")
        for c in resume.candidates:
            if not 0 <= c.index < params.num_candidates or len(c.token_ids) >= params.max_tokens:
                raise ValueError(f"resumed candidate {c.index}: index out of range [0, {params.num_candidates}) "
                                 f"or {len(c.token_ids)} tokens already (max_tokens {params.max_tokens})")
            if any(not 0 <= t < self.spec.vocab_size for t in c.token_ids):
                raise ValueError(f"resumed candidate {c.index}: token ids out of range [0, {self.spec.vocab_size})")
        req.forked = True
        seqs = [self.output.new_seq(req, c.index, req.prompt_token_ids + list(c.token_ids)) for c in resume.candidates]
        self.requests[req.request_id] = req
        for seq, c in zip(seqs, resume.candidates):
            seq.cumulative_logprob = c.cumulative_logprob
            self.scheduler.add(seq)

    def _attach_kv_source(self, req: EngineRequest, params: DisaggregatedParams) -> None:
        params.validate()
        handle = self.connector.open_handle(params.opaque_state)
        if handle.num_tokens != req.num_prompt_tokens:
            raise ValueError(f"the KV handle holds {handle.num_tokens} prompt tokens, the prompt has "
                             f"{req.num_prompt_tokens}")
        count = req.sampling_params.num_candidates
        if len(params.first_gen_tokens) != count:
            raise ValueError(f"first_gen_tokens has {len(params.first_gen_tokens)} tokens for {count} candidates")
        items = tuple(MultimodalItem(tuple(h), offset, length) for h, offset, length in handle.mm_items)
        if req.mm_items and req.mm_items != items:
            raise ValueError("mm_items differ from the images the KV handle was computed with")
        req.mm_items = items  # the prompt's images key this engine's prefix cache as they keyed the prefill side's
        logprobs = handle.first_logprobs or (0.0,) * count
        tops = handle.first_top_logprobs or ((),) * count
        req.kv_source = handle
        req.first_tokens = tuple(FirstToken(t, lp, top) for t, lp, top in zip(params.first_gen_tokens, logprobs, tops))
        drafts = params.draft_tokens or ()
        if any(t >= self.spec.vocab_size for t in drafts):
            raise ValueError(f"draft_tokens out of range [0, {self.spec.vocab_size})")
        req.carried_draft = tuple(drafts)

    def abort_request(self, request_id: int) -> None:
        """Stops every candidate of the request and frees its blocks, wherever it is (queued, prefilling, reading
        KV, decoding, or held under a KV lease); it ends with finish_reason 'cancelled'."""
        if self.connector.end_lease(request_id):
            self.scheduler.free_held(request_id)
        req = self.requests.get(request_id)
        if req is not None:
            self.output.abort(req)

    def stop_candidate(self, request_id: int, index: int) -> None:
        """Stops one candidate (a post-processor matched a stop string); the request ends when all have."""
        req = self.requests.get(request_id)
        seq = next((s for s in req.seqs if s.index == index), None) if req else None
        if seq is not None and not seq.finished:
            self.output.stop(req, seq)

    # ---- disaggregation ----
    def card(self) -> EngineCard:
        return dataclasses.replace(self.connector.card(), speculation=self._speculation)

    def meet(self, card: EngineCard) -> None:
        """First contact with a peer engine: refuses an incompatible one, naming every mismatch, then connects. A
        peer that drafts by another method (or this engine not at all) is said once: its drafts are not used."""
        self.connector.meet(card)
        if card.speculation is not None and card.speculation != self._speculation:
            log.info("engine %r sends %s drafts with its hand-offs; this engine %s: they are ignored", card.name,
                     card.speculation, f"drafts by {self._speculation}" if self._speculation else "does not speculate")

    @property
    def _speculation(self) -> str | None:
        spec = self.config.speculative_config
        return spec.method if spec is not None else None

    def release_kv(self, params: DisaggregatedParams) -> None:
        """Tells the prefill engine named by a KV handle that its blocks will not be read (the request ended before
        decoding): it frees them now instead of when the lease ends. Refuses a handle whose signature fails."""
        self.connector.release_unread(self.connector.open_handle(params.opaque_state))

    def close(self) -> None:
        self.connector.close()
        self.executor.cores.close()
        if self.ranks is not None:
            self.ranks.close()

    # ---- what the engine reports ----
    def queued_tokens(self) -> int:
        """Work this engine has accepted and not done: tokens to compute plus tokens still to generate."""
        total = 0
        for req in self.requests.values():
            left = req.sampling_params.max_tokens
            for seq in req.seqs:
                if not seq.finished:
                    total += seq.num_tokens - seq.num_computed_tokens + max(0, left - seq.num_output_tokens)
        return total

    def stats(self) -> dict[str, float]:
        """KV pool occupancy, prefix-cache counters, leases and transfers, for metrics."""
        bm, kv, cache = self.block_manager, self.connector.stats(), self.scheduler.cache_stats
        return {"kv_blocks_in_use": bm.num_blocks - bm.num_free_blocks, "kv_blocks_total": bm.num_blocks,
                "kv_blocks_cached": bm.num_cached_blocks, "kv_leases": kv.leases, "kv_bytes_read": kv.kv_bytes_read,
                "kv_releases_rejected": kv.releases_rejected, "kv_releases_unknown": kv.releases_unknown,
                "prefix_cache_query_tokens": cache.query_tokens, "prefix_cache_hit_tokens": cache.hit_tokens,
                "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "num_waiting_for_kv": len(self.scheduler.waiting_for_kv), "num_preemptions": self.scheduler.num_preemptions,
                # hand-offs queued until the pool holds their blocks (their read has not started)
                "num_waiting_imports": sum(s.request.kv_source is not None for s in self.scheduler.waiting),
                "num_reprefills": self.scheduler.num_reprefills, **self._rank_stats(), **kv.extra,
                "borrowed_core_steps": self.executor.cores.borrowed_steps,
                **(self.scheduler.drafter.stats() if self.scheduler.drafter else {})}

    def _rank_stats(self) -> dict[str, float]:
        """Tensor parallelism's cost here: all-reduces run and the seconds rank 0 spent in them."""
        if self.ranks is None:
            return {}
        reduce = self.ranks.shard.all_reduce
        return {"tp_all_reduce_calls": reduce.calls, "tp_all_reduce_s": reduce.seconds}
