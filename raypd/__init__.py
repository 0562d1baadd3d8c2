"""What users import: the embedded `LLM` (the engine in-process), `MultimodalEncoder`, and the API's plain types
(llmapi). The top layer: it drives the engine and the postproc workers; nothing of the project imports it.
MultimodalEncoder loads on first use: it registers its arena with NIXL, which a text-only LLM never loads."""

from llmapi import (CompletionOutput, DisaggregatedParams, GenerationResult, GuidedDecodingParams, Logprob,
                    MetricNames, MultimodalEmbeddingHandle, RequestError, RequestOutput, SamplingParams)
from engine.spec.config import SpeculativeConfig
from raypd.llm import LLM

__all__ = [
    "LLM", "MultimodalEncoder", "SamplingParams", "GuidedDecodingParams", "RequestOutput", "CompletionOutput",
    "GenerationResult", "DisaggregatedParams", "Logprob", "MetricNames", "RequestError", "MultimodalEmbeddingHandle",
    "SpeculativeConfig",
]


def __getattr__(name: str):
    if name == "MultimodalEncoder":
        from raypd.multimodal_encoder import MultimodalEncoder

        return MultimodalEncoder
    raise AttributeError(f"module 'raypd' has no attribute {name!r}")
