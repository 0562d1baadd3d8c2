"""The plain types of the API (the reference API's names): parameters, outputs, results, the hand-off. They import
nothing else of the project; the embedded `LLM` that drives the engine is `raypd.LLM`."""

from llmapi.disaggregated_params import DisaggregatedParams, MultimodalEmbeddingHandle
from llmapi.outputs import CompletionOutput, Logprob, MetricNames
from llmapi.result import GenerationResult, RequestError, RequestOutput
from llmapi.sampling_params import GuidedDecodingParams, SamplingParams

__all__ = [
    "SamplingParams", "GuidedDecodingParams", "RequestOutput", "CompletionOutput", "GenerationResult",
    "DisaggregatedParams", "Logprob", "MetricNames", "RequestError", "MultimodalEmbeddingHandle",
]
