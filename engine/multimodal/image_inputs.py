"""ImageInputs: what the host of an engine does with a request's images before the engine takes it.

Embedded (`LLM`): decode, preprocess and encode in-process, then splice. With embedding handles (a context-only or
whole request after a MultimodalEncoder): read the embeddings over NIXL, checked, then splice; no images here.
Generation-only: nothing to read or encode; the prompt's placeholders are expanded as the KV handle's images say.
Either way the engine gets the expanded prompt, each image's item (hash, offset, length) and, unless it only decodes,
the embeddings.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.multimodal.processing import ImageLimits, MultimodalProcessor, count_placeholders, locate_placeholders
from engine.core.request import MultimodalItem
from engine.multimodal.vision import load_vision_spec


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt ready for LLMEngine.add_request."""

    token_ids: list[int]
    mm_items: tuple[MultimodalItem, ...] = ()
    mm_embeddings: tuple[torch.Tensor, ...] = ()  # each (length, hidden), aligned with mm_items


class ImageInputs:
    """model_dir's vision side, built on first use. dtype: the engine's model dtype (embeddings are spliced in it)."""

    def __init__(self, model_dir, dtype: str, device: str = "cpu", cluster_key: bytes | None = None,
                 read_timeout_s: float = 10.0, limits: ImageLimits = ImageLimits()):
        self.model_dir = model_dir
        self.spec = load_vision_spec(model_dir)  # None: a text-only model
        self.dtype, self.device, self.limits = dtype, device, limits
        self._key, self._read_timeout_s = cluster_key, read_timeout_s
        self._processor = self._encoder = self._reader = None
        self._building = threading.Lock()  # callers' threads (LLM.generate, a worker's reads) build these at once

    @property
    def multimodal(self) -> bool:
        return self.spec is not None

    # ---- the three ways in ----
    def text(self, token_ids: Sequence[int]) -> PreparedPrompt:
        """A prompt without images: on an image model it may hold no image placeholder either."""
        if self.spec is not None:
            count_placeholders(token_ids, self.spec.image_token_id, 0)
        return PreparedPrompt(list(token_ids))

    def from_images(self, token_ids: Sequence[int], images) -> PreparedPrompt:
        """Decodes, preprocesses and encodes the images here (errors name images[i])."""
        if not images:
            return self.text(token_ids)
        self._require("multi_modal_data.image", "images")
        mm = self.processor.process(list(token_ids), images)
        encoder = self._vision_encoder()
        with torch.inference_mode():
            embeds = encoder(mm.pixel_values().to(self.device))  # (N, tokens_per_image, hidden)
        items = tuple(MultimodalItem(img.content_hash, r.offset, r.length) for img, r in zip(mm.images, mm.ranges))
        return PreparedPrompt(list(mm.token_ids), items, tuple(embeds))

    def from_handles(self, token_ids: Sequence[int], handles: Sequence, hashes: Sequence | None) -> PreparedPrompt:
        """Reads the embeddings the handles name (checked; see engine/multimodal/embedding_reader.py) and places them at
        the prompt's placeholders (one per image, or already expanded)."""
        self._require("multimodal_embedding_handles", "image embeddings")
        reader = self.reader
        opened = reader.open(handles, hashes)
        ids, ranges = locate_placeholders(token_ids, self.spec.image_token_id, [h.num_tokens for h in opened])
        embeds = reader.read(opened)
        items = tuple(MultimodalItem(h.content_hash, r.offset, r.length) for h, r in zip(opened, ranges))
        return PreparedPrompt(ids, items, tuple(embeds))

    def for_generation(self, token_ids: Sequence[int], items: Sequence[tuple]) -> PreparedPrompt:
        """A generation-only prompt: its placeholders expanded as the KV handle's images (hash, offset, length) say.
        The engine takes the items from the handle itself; here they only place the placeholders."""
        if not items:
            return self.text(token_ids)
        ids, ranges = locate_placeholders(token_ids, self.spec.image_token_id, [length for _, _, length in items])
        if [r.offset for r in ranges] != [offset for _, offset, _ in items]:
            raise ValueError("the prompt's image placeholders are not where the KV handle's images are")
        return PreparedPrompt(ids)

    # ---- built on first use ----
    @property
    def processor(self) -> MultimodalProcessor:
        with self._building:
            if self._processor is None:
                self._processor = MultimodalProcessor(self.model_dir, self.limits)
            return self._processor

    def _vision_encoder(self):
        with self._building:
            if self._encoder is None:
                from engine.multimodal.vision import VisionEncoder

                self._encoder = VisionEncoder.from_pretrained(self.model_dir, dtype=self.dtype, device=self.device)
            return self._encoder

    @property
    def reader(self):
        with self._building:
            if self._reader is None:
                from engine.multimodal.embedding_reader import EmbeddingReader, EmbeddingSpec  # imports nixl

                s = self.spec
                expected = EmbeddingSpec(s.tokens_per_image, s.text_hidden_size, self.dtype, s.fingerprint)
                self._reader = EmbeddingReader(expected, self._key, self._read_timeout_s)
            return self._reader

    def _require(self, field: str, what: str) -> None:
        if self.spec is None:
            raise ValueError(f"{field}: the model at {self.model_dir} is text-only; it takes no {what}")

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
