"""The embedding handle: what a prefill engine needs to read one image's embeddings from an encoder's arena.

Like the KV handle (engine/kv/kv_handle.py) it is signed by the encoder that made it (HMAC-SHA256 under the cluster key,
its own context so neither kind of handle passes for the other) and serialized as JSON, never pickle: a forged or
altered handle is refused before anything in it is used. It names a slot of the encoder's NIXL-registered arena and
the slot's generation when the lease began; the reader reads the slot, then its generation, and a changed one means
the entry was evicted and the slot refilled meanwhile (the lease had ended), so those bytes are never used.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass

from engine.kv.kv_handle import open_json, sign_json
from llmapi.disaggregated_params import MultimodalEmbeddingHandle

_CONTEXT = b"raypd.embedding_handle.v1"


class EmbeddingsGone(ValueError):
    """The embeddings a valid handle names can no longer be read: its lease ended, its slot was refilled, or its
    encoder is gone or unreachable. Encoding the images again (fresh handles) is the way on; a request owner does
    that and serves the request again (RequestDelta.retry_whole)."""


@dataclass(frozen=True)
class EmbeddingHandle:
    agent: str  # the encoder's transport name
    transport_info: bytes  # what a peer needs to connect to that transport
    slot: int  # index of the entry in the encoder's arena (the region's descriptor index)
    generation: int  # the slot's fill count when the lease began; a changed one was refilled
    lease_id: str  # random, per lease: what a release message names
    lease_deadline: float  # the encoder's wall clock (time.time()); checked, but never trusted alone
    fingerprint: str  # the encoder's model fingerprint
    content_hash: tuple[int, ...]  # 8 int32, engine/multimodal/processing.py's image_hash
    num_tokens: int
    hidden_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    def sign(self, key: bytes | None) -> bytes:
        body = dataclasses.asdict(self)
        body["transport_info"] = base64.b64encode(self.transport_info).decode()
        return sign_json(body, key, _CONTEXT)

    @classmethod
    def open(cls, blob: bytes, key: bytes | None, field: str = "embedding handle") -> EmbeddingHandle:
        """Verifies the signature, then parses. Raises InvalidHandle (a ValueError) naming `field`."""
        body = open_json(blob, key, _CONTEXT, field, "multimodal embedding handle")
        body["transport_info"] = base64.b64decode(body["transport_info"])
        body["content_hash"] = tuple(body["content_hash"])
        return cls(**body)

    def public(self, key: bytes | None) -> MultimodalEmbeddingHandle:
        """What a MultimodalEncoder hands out: the tensor's description and this handle, signed."""
        return MultimodalEmbeddingHandle(self.num_tokens, self.hidden_size, self.dtype, self.sign(key))
