"""What users import: the embedded `LLM` (the engine in-process), `MultimodalEncoder`, and the API's plain types
(llmapi). The top layer: it drives the engine and the postproc workers; nothing of the project imports it."""

from llmapi import (CompletionOutput, DisaggregatedParams, GenerationResult, GuidedDecodingParams, Logprob,
                    MetricNames, MultimodalEmbeddingHandle, RequestError, RequestOutput, SamplingParams)
from raypd.llm import LLM
from raypd.multimodal_encoder import MultimodalEncoder

__all__ = [
    "LLM", "MultimodalEncoder", "SamplingParams", "GuidedDecodingParams", "RequestOutput", "CompletionOutput",
    "GenerationResult", "DisaggregatedParams", "Logprob", "MetricNames", "RequestError", "MultimodalEmbeddingHandle",
]
