"""What users import. The plain types load without the engine; `LLM` loads it on first use."""

from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.outputs import CompletionOutput, Logprob, MetricNames
from llmapi.result import GenerationResult, RequestError, RequestOutput
from llmapi.sampling_params import SamplingParams

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "GenerationResult", "DisaggregatedParams",
    "Logprob", "MetricNames", "RequestError",
]


def __getattr__(name: str):
    if name == "LLM":
        from llmapi.llm import LLM

        return LLM
    raise AttributeError(f"module 'llmapi' has no attribute {name!r}")
