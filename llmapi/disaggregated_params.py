"""DisaggregatedParams: what crosses between the prefill (context) and decode (generation) roles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

# What a request asks of an engine: all of it, its prompt only (prefill), or generation from a handed-off KV (decode)
RequestType = Literal["context_and_generation", "context_only", "generation_only"]
REQUEST_TYPES: tuple[str, ...] = get_args(RequestType)
MAX_DRAFT_TOKENS = 16  # speculative drafts carried from the context side (as num_speculative_tokens' limit)


def request_type(params: DisaggregatedParams | None) -> RequestType:
    """What a request with these params asks of an engine: no params is a whole request."""
    return params.request_type if params is not None else "context_and_generation"


@dataclass(frozen=True)
class MultimodalEmbeddingHandle:
    """One image's embeddings, made by a MultimodalEncoder and held in its NIXL-registered arena under a lease.

    num_tokens, hidden_size and dtype describe the (num_tokens, hidden_size) tensor for the reader's checks; `signed`
    is what the reader trusts: HMAC-signed JSON (engine/multimodal/embedding_handle.py) naming the encoder's agent, the
    arena slot (region index) and its generation, the lease and its deadline, the model fingerprint and the content
    hash.
    """

    num_tokens: int
    hidden_size: int
    dtype: str
    signed: bytes


@dataclass
class DisaggregatedParams:
    """As in the reference API. `opaque_state` is the signed KV handle made by the context side;
    `first_gen_tokens` holds one first token per candidate. `multimodal_embedding_handles` (one
    MultimodalEmbeddingHandle per image, in prompt order) and `multimodal_hashes` (8 int32 per image) come from a
    MultimodalEncoder; a context-only (or whole) request reads the embeddings they name. The decode side never gets
    them: its KV handle names the images by hash instead."""

    request_type: RequestType = "context_and_generation"
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
            if self.multimodal_embedding_handles:
                raise ValueError("DisaggregatedParams.multimodal_embedding_handles: a generation_only request reads "
                                 "the prompt's KV, not its image embeddings (give them to the context_only request)")
        drafts = self.draft_tokens
        if drafts is not None:
            if not isinstance(drafts, list) or len(drafts) > MAX_DRAFT_TOKENS or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in drafts):
                raise ValueError(f"DisaggregatedParams.draft_tokens must be a list of at most {MAX_DRAFT_TOKENS} "
                                 "non-negative token ids")
            if drafts and self.first_gen_tokens is not None and len(self.first_gen_tokens) != 1:
                raise ValueError("DisaggregatedParams.draft_tokens: drafts follow one candidate's first token, "
                                 f"got {len(self.first_gen_tokens)} first_gen_tokens")
        handles, hashes = self.multimodal_embedding_handles, self.multimodal_hashes
        if hashes is not None and handles is not None and len(hashes) != len(handles):
            raise ValueError(f"DisaggregatedParams: {len(hashes)} multimodal_hashes for {len(handles)} "
                             "multimodal_embedding_handles (one of each per image)")
