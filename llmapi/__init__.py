"""What users import. The plain types load without the engine; `LLM` loads it on first use."""

from llmapi.disaggregated_params import DisaggregatedParams, MultimodalEmbeddingHandle
from llmapi.outputs import CompletionOutput, Logprob, MetricNames
from llmapi.result import GenerationResult, RequestError, RequestOutput
from llmapi.sampling_params import GuidedDecodingParams, SamplingParams

__all__ = [
    "LLM", "SamplingParams", "GuidedDecodingParams", "RequestOutput", "CompletionOutput", "GenerationResult",
    "DisaggregatedParams",
    "Logprob", "MetricNames", "RequestError", "MultimodalEncoder", "MultimodalEmbeddingHandle",
]


def __getattr__(name: str):
    if name == "LLM":
        from llmapi.llm import LLM

        return LLM
    if name == "MultimodalEncoder":
        from llmapi.multimodal_encoder import MultimodalEncoder

        return MultimodalEncoder
    raise AttributeError(f"module 'llmapi' has no attribute {name!r}")
