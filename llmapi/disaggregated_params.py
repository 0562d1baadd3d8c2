"""DisaggregatedParams: what crosses between the prefill (context) and decode (generation) roles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REQUEST_TYPES = ("context_and_generation", "context_only", "generation_only")


@dataclass
class DisaggregatedParams:
    """As in the reference API. `opaque_state` is the signed KV handle made by the context side;
    `first_gen_tokens` holds one first token per candidate."""

    request_type: str = "context_and_generation"
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    multimodal_embedding_handles: list[Any] | None = None
    multimodal_hashes: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.request_type not in REQUEST_TYPES:
            raise ValueError(f"DisaggregatedParams.request_type must be one of {REQUEST_TYPES}, got {self.request_type!r}")
        if self.request_type == "generation_only":
            if not self.first_gen_tokens:
                raise ValueError("DisaggregatedParams.first_gen_tokens is required for a generation_only request")
            if self.opaque_state is None:
                raise ValueError("DisaggregatedParams.opaque_state is required for a generation_only request")
