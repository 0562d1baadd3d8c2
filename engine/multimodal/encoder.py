"""EncoderEngine: the multimodal encoder role's engine. Vision tower + projector, and the arena its embeddings live in.

It takes preprocessed images (engine/multimodal/processing.py's ImageItem: pixels and content hash), serves each from
the encoder cache or encodes it into a free (or evicted) slot, and returns one signed embedding handle per image, all
under one lease. Plain Python: the embedded MultimodalEncoder (llmapi) and the encoder role's actor (encoder/worker.py)
wrap it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.multimodal.embedding_handle import EmbeddingHandle
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.processing import HASH_WORDS, ImageItem
from engine.multimodal.vision import VisionEncoder
from llmapi.disaggregated_params import MultimodalEmbeddingHandle


@dataclass(frozen=True)
class EncoderConfig:
    dtype: str | None = None  # None: the checkpoint's; "auto" as the engines; must match the prefill engines' dtype
    device: str = "cpu"
    num_threads: int | None = None
    cache_bytes: int = 256 << 20  # the arena: as many image slots as this holds
    num_slots: int | None = None  # overrides cache_bytes
    lease_s: float = 30.0  # how long a handle's slot is held for its reader
    max_batch_images: int = 16  # images per forward pass
    cluster_key: bytes | None = None  # signs handles; the prefill engines that read them share it

    def __post_init__(self):
        for name in ("cache_bytes", "lease_s", "max_batch_images"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EncoderConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_slots is not None and self.num_slots < 1:
            raise ValueError(f"EncoderConfig.num_slots must be >= 1, got {self.num_slots}")


class EncoderEngine:
    """Thread-safe: encode() calls run one at a time."""

    def __init__(self, model_dir, config: EncoderConfig = EncoderConfig()):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model = VisionEncoder.from_pretrained(model_dir, dtype=config.dtype, device=config.device)
        self.spec = self.model.spec
        dtype = self.model.dtype
        self.dtype = str(dtype).removeprefix("torch.")
        slot_bytes = self.spec.tokens_per_image * self.spec.text_hidden_size * dtype.itemsize
        num_slots = config.num_slots or max(1, config.cache_bytes // slot_bytes)
        self.cache = EncoderCache(num_slots, self.spec.tokens_per_image, self.spec.text_hidden_size, dtype,
                                  config.lease_s, config.cluster_key, config.device)
        self._lock = threading.Lock()

    def encode(self, items: Sequence[ImageItem]) -> list[MultimodalEmbeddingHandle]:
        """One handle per item, in order. Raises ValueError for an item this model cannot take, EncoderCacheFull
        when no slot can be freed for a new image."""
        for i, item in enumerate(items):
            self._check(i, item)
        with self._lock:
            self.cache.poll()
            lease_id, deadline = self.cache.new_lease()
            try:
                slots = self._fill(items, lease_id)
            except BaseException:
                self.cache.end_lease(lease_id)
                raise
            return [self._handle(item, slot, lease_id, deadline) for item, slot in zip(items, slots)]

    def stats(self) -> dict[str, float]:
        with self._lock:
            self.cache.poll()
            s = self.cache.stats
            return {"images_encoded": s.encodes, "encoder_cache_hits": s.hits, "encoder_cache_evictions": s.evictions,
                    "encoder_leases": self.cache.num_leases, "encoder_leases_released": s.releases,
                    "encoder_leases_expired": s.expired, "encoder_cache_slots": self.cache.num_slots}

    def close(self) -> None:
        self.cache.close()

    # ---- under the lock ----
    def _fill(self, items: Sequence[ImageItem], lease_id: str) -> list[int]:
        """Each item's slot, pinned under the lease: hits first (so that allocating cannot evict them), then a
        slot for each new image, encoded in batches. A failure frees the slots it had taken."""
        slots: dict[tuple[int, ...], int] = {}
        misses: dict[tuple[int, ...], ImageItem] = {}
        for item in items:
            h = item.content_hash
            if h in slots or h in misses:
                continue  # the same image twice in one call: one slot
            slot = self.cache.lookup(h)
            if slot is None:
                misses[h] = item
                continue
            self.cache.pin(lease_id, slot)
            self.cache.stats.hits += 1
            slots[h] = slot
        taken = []
        try:
            for h in misses:
                slots[h] = self.cache.allocate(h, lease_id)
                taken.append(h)
            self._encode_into(list(misses.items()), slots)
        except BaseException:
            for h in taken:
                self.cache.discard(h)
            raise
        return [slots[item.content_hash] for item in items]

    def _encode_into(self, misses: list[tuple[tuple[int, ...], ImageItem]], slots: dict) -> None:
        step = self.config.max_batch_images
        for start in range(0, len(misses), step):
            chunk = misses[start:start + step]
            pixels = torch.stack([item.pixel_values for _, item in chunk]).to(self.config.device)  # (N, C, H, W)
            with torch.inference_mode():
                embeds = self.model(pixels)  # (N, tokens_per_image, text_hidden)
            for (h, _), emb in zip(chunk, embeds):
                self.cache.arena[slots[h]].copy_(emb)
        self.cache.stats.encodes += len(misses)

    def _handle(self, item: ImageItem, slot: int, lease_id: str, deadline: float) -> MultimodalEmbeddingHandle:
        transport = self.cache.transport
        handle = EmbeddingHandle(
            agent=transport.name, transport_info=transport.metadata(), slot=slot,
            generation=int(self.cache.generations[slot]), lease_id=lease_id, lease_deadline=deadline,
            fingerprint=self.spec.fingerprint, content_hash=tuple(item.content_hash),
            num_tokens=self.spec.tokens_per_image, hidden_size=self.spec.text_hidden_size, dtype=self.dtype)
        return handle.public(self.config.cluster_key)

    def _check(self, index: int, item: ImageItem) -> None:
        s = self.spec
        shape = (s.num_channels, s.image_size, s.image_size)
        if tuple(item.pixel_values.shape) != shape:
            raise ValueError(f"images[{index}]: pixel values of shape {tuple(item.pixel_values.shape)}, this "
                             f"encoder takes {shape} (the checkpoint's processor makes them)")
        if item.num_tokens != s.tokens_per_image or len(item.content_hash) != HASH_WORDS:
            raise ValueError(f"images[{index}]: {item.num_tokens} tokens and a hash of {len(item.content_hash)} "
                             f"words; this encoder makes {s.tokens_per_image} tokens per image, hashed in "
                             f"{HASH_WORDS} words")
