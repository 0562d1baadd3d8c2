"""The embedded LLM: the engine in-process, its loop on a background thread, results owned by the caller."""

from __future__ import annotations

import copy
import itertools
from typing import Sequence

from transformers import AutoTokenizer

from engine.core.engine import EngineConfig, LLMEngine, nixl_connector
from engine.multimodal.image_inputs import ImageInputs, PreparedPrompt
from engine.kv.kv_handle import KVHandle
from engine.core.loop import EngineLoop
from engine.spec.config import SpeculativeConfig
from llmapi.batch import Prompt, as_prompt_list, split_prompt, wait_all
from postproc.detokenized import DetokenizedGenerationResultBase
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import RequestDelta
from llmapi.result import RequestOutput
from llmapi.sampling_params import SamplingParams
from postproc.pool import PostprocPool
from postproc.sink import ResultSink



class LLM:
    """`LLM(model=DIR)`: generate() for batches, generate_async() for one request (streaming or not)."""

    def __init__(self, model: str, engine_config: EngineConfig | None = None, num_postprocess_workers: int = 0,
                 post_processor_hook: str | None = None, kv_transfer: str | None = None, **engine_kwargs):
        """num_postprocess_workers: 0 detokenizes on the engine thread; N >= 1 in N worker processes, which also
        run post_processor_hook ("module.Class", a postproc.hooks.PostProcessorHook) on every chunk.
        kv_transfer: None serves whole requests only (nixl is never loaded); "nixl" also serves context_only and
        generation_only requests, exchanging KV with other engines over NIXL. speculative_config (among the
        engine's settings): a SpeculativeConfig, or its fields as a dict, as vLLM takes it."""
        if post_processor_hook and not num_postprocess_workers:
            raise ValueError("post_processor_hook runs in postproc workers: set num_postprocess_workers >= 1")
        if kv_transfer not in (None, "nixl"):
            raise ValueError(f"kv_transfer must be None or 'nixl', got {kv_transfer!r}")
        self.model_dir = model
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        if isinstance(engine_kwargs.get("speculative_config"), dict):
            engine_kwargs["speculative_config"] = SpeculativeConfig(**engine_kwargs["speculative_config"])
        config = engine_config or EngineConfig(**engine_kwargs)
        engine = LLMEngine(model, config, nixl_connector(config) if kv_transfer else None)
        self.engine = engine
        self.config = config
        dtype = str(engine.model.dtype).removeprefix("torch.")
        self.images = ImageInputs(model, dtype, config.device, config.cluster_key, config.kv_transfer_timeout_s)
        self._ids = itertools.count()
        self._records: dict[int, tuple[DetokenizedGenerationResultBase, ResultSink]] = {}  # engine thread only
        # N >= 1: detokenization and stop strings run in N worker processes, off the engine thread.
        self._postproc = (
            PostprocPool(model, num_postprocess_workers, self._stop_candidates, self._abort, post_processor_hook)
            if num_postprocess_workers else None
        )
        self.loop = EngineLoop(engine, self._on_step, self._fail_all)

    # ---- public API ----
    def generate(
        self,
        inputs: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        timeout: float | None = None,
        disaggregated_params: DisaggregatedParams | Sequence[DisaggregatedParams] | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Generates for one prompt (returns one RequestOutput) or many (returns a list, in order)."""
        prompts, single = as_prompt_list(inputs)
        params = _per_prompt(sampling_params, len(prompts), SamplingParams)
        disagg = _per_prompt(disaggregated_params, len(prompts), DisaggregatedParams)
        results = [self.generate_async(p, sp, disaggregated_params=dp) for p, sp, dp in zip(prompts, params, disagg)]
        wait_all(results, use_tqdm, timeout)
        return results[0] if single else results

    def generate_async(self, inputs: Prompt, sampling_params: SamplingParams | None = None,
                       streaming: bool = False,
                       disaggregated_params: DisaggregatedParams | None = None) -> RequestOutput:
        """Submits one request and returns at once; iterate the result to stream, or call result(timeout).

        inputs: a prompt (text or token ids), or {"prompt": ..., "multi_modal_data": {"image": [images]}} with one
        `<image>` placeholder per image (PIL images, encoded bytes or data: URLs), encoded here and spliced in.
        disaggregated_params: request_type "context_only" prefills and returns the first token with the KV handle
        in result.disaggregated_params; "generation_only" continues from such a handle (read over NIXL). With
        multimodal_embedding_handles (from a MultimodalEncoder) the images' embeddings are read over NIXL instead.
        """
        self._check_alive()
        params = copy.deepcopy(sampling_params or SamplingParams())
        disagg = copy.copy(disaggregated_params)
        prompt, prepared = self._prepare(inputs, disagg)
        request_id = next(self._ids)
        ids = prepared.token_ids
        result = RequestOutput(request_id, ids, params, prompt, streaming, abort_fn=self._abort,
                               disaggregated_params=disagg)
        record = DetokenizedGenerationResultBase(request_id, ids, params, self.tokenizer, streaming)
        # The engine thread validates the request; its ValueError is raised here, on the caller's thread.
        self.loop.call(lambda engine: self._add(engine, record, result, prepared))
        return result

    def shutdown(self) -> None:
        """Stops the loop; unfinished requests end with an error."""
        self.loop.shutdown()
        self.images.close()
        if self._postproc is not None:
            self._postproc.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- helpers run on the caller's thread ----
    def _prepare(self, inputs: Prompt, disagg: DisaggregatedParams | None) -> tuple[str | None, PreparedPrompt]:
        """The prompt's text and what the engine takes: images encoded here, embeddings read over NIXL, or (decode)
        placeholders expanded as the KV handle's images say."""
        prompt, images = split_prompt(inputs)
        text, ids = self._tokenize(prompt)
        handles = disagg.multimodal_embedding_handles if disagg is not None else None
        if handles:
            if images is not None:
                raise ValueError("give a prompt's images (multi_modal_data) or their multimodal_embedding_handles, "
                                 "not both")
            return text, self.images.from_handles(ids, handles, disagg.multimodal_hashes)
        if images is not None:
            return text, self.images.from_images(ids, images)
        if disagg is not None and disagg.request_type == "generation_only" and self.images.multimodal:
            items = KVHandle.open(disagg.opaque_state, self.config.cluster_key).mm_items
            return text, self.images.for_generation(ids, items)
        return text, self.images.text(ids)

    def _tokenize(self, inputs) -> tuple[str | None, list[int]]:
        if isinstance(inputs, str):
            return inputs, self.tokenizer.encode(inputs)
        if isinstance(inputs, (list, tuple)) and all(isinstance(t, int) for t in inputs):
            return None, list(inputs)
        raise TypeError(f"a prompt is a string or a list of token ids, got {type(inputs).__name__}")

    def _abort(self, request_id: int) -> None:
        self.loop.post(lambda engine: engine.abort_request(request_id))

    def _stopper(self, request_id: int):
        """Stops candidates of a request detokenized on the engine thread: right there."""
        return lambda indices: [self.engine.stop_candidate(request_id, i) for i in indices]

    def _stop_candidates(self, request_id: int, indices: tuple[int, ...]) -> None:
        # A postproc worker's should_abort (stop string, hook): the engine thread stops them and frees their blocks.
        self.loop.post(lambda engine: [engine.stop_candidate(request_id, i) for i in indices])

    def _check_alive(self) -> None:
        self.loop.check_alive()

    # ---- on the engine thread ----
    def _add(self, engine: LLMEngine, record: DetokenizedGenerationResultBase, result: RequestOutput,
             prepared: PreparedPrompt) -> None:
        engine.add_request(result.request_id, result.prompt_token_ids, result.sampling_params,
                           result.disaggregated_params, mm_items=prepared.mm_items,
                           mm_embeddings=prepared.mm_embeddings)
        if self._postproc is not None:
            self._postproc.submit(result.request_id, result)
        else:
            self._records[result.request_id] = (record, ResultSink(result, self._stopper(result.request_id)))

    def _on_step(self, responses: list[RequestDelta]) -> None:
        if self._postproc is not None:
            self._postproc.send(responses)
            return
        for rsp in responses:
            self._deliver(rsp)

    def _deliver(self, rsp: RequestDelta) -> None:
        record, sink = self._records.get(rsp.request_id, (None, None))
        if record is None:
            return
        if sink.apply_response(record, rsp) or rsp.final:
            del self._records[rsp.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        for _, sink in self._records.values():
            sink.result.put(exc)
        self._records.clear()
        if self._postproc is not None:
            self._postproc.fail_all(exc)


def _per_prompt(value, count: int, kind: type) -> list:
    """One value per prompt, from None, one value, or a list of exactly one per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * count
    value = list(value)
    if len(value) != count:
        raise ValueError(f"got {len(value)} {kind.__name__} for {count} prompts: pass one, or one per prompt")
    return value
