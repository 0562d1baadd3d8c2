"""The encoder role: images in, embedding handles out. A Ray actor class (plain Python until ray.remote wraps it)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import ray

from engine.multimodal.encoder import EncoderConfig, EncoderEngine
from engine.multimodal.processing import ImageItem
from llmapi.disaggregated_params import DisaggregatedParams


class EncoderWorker:
    """Encodes preprocessed images (the owner decoded and hashed them) into its NIXL-registered arena, serving repeats
    from that cache, and returns the handles a prefill worker reads them by."""

    def __init__(self, model_dir: str, config: EncoderConfig):
        self.engine = EncoderEngine(model_dir, config)

    async def encode(self, items: Sequence[ImageItem]) -> DisaggregatedParams:
        """context_only params carrying one embedding handle and content hash per image, in order. Raises ValueError
        for an image this model cannot take, EncoderCacheFull when every slot is leased."""
        handles = await asyncio.to_thread(self.engine.encode, list(items))  # the actor's event loop stays free
        return DisaggregatedParams("context_only", multimodal_embedding_handles=handles,
                                   multimodal_hashes=[list(item.content_hash) for item in items])

    def card(self) -> None:
        """Encoders exchange no KV: nothing for peers to meet (the replica directory lists them for their stats)."""
        return None

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def check_health(self) -> None:
        pass

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        self.engine.close()
