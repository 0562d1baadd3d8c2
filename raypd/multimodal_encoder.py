"""MultimodalEncoder: a LLaVA checkpoint's vision tower + projector only, its embeddings handed out as handles.

    encoder = MultimodalEncoder(model=llava_dir)
    enc = encoder.generate({"prompt": "<image> what is this?", "multi_modal_data": {"image": [img]}})
    ctx = llm.generate({"prompt": "<image> what is this?"}, sp, disaggregated_params=enc.disaggregated_params)

The embeddings stay in this process, in a NIXL-registered arena that is also the encoder cache (the same image again is
not encoded again); the handles name them, signed, and the prefill side reads them over NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.multimodal.encoder import EncoderConfig, EncoderEngine
from engine.multimodal.processing import ImageLimits, MultimodalProcessor
from llmapi.batch import Prompt, as_prompt_list, split_prompt
from llmapi.disaggregated_params import DisaggregatedParams


@dataclass(frozen=True)
class EncoderOutput:
    """One prompt's images, encoded. disaggregated_params (context_only) carries multimodal_embedding_handles and
    multimodal_hashes, one per image in prompt order, for the request that prefills this prompt."""

    prompt: str | list[int]
    disaggregated_params: DisaggregatedParams

    @property
    def multimodal_hashes(self) -> list[list[int]]:
        return self.disaggregated_params.multimodal_hashes


class MultimodalEncoder:
    def __init__(self, model: str, encoder_config: EncoderConfig | None = None,
                 limits: ImageLimits = ImageLimits(), **config_kwargs):
        """encoder_config (or its fields as keywords): dtype, device, cache size (cache_bytes or num_slots), lease_s,
        cluster_key (the prefill engines that read the handles must share it; None: this process's key)."""
        self.processor = MultimodalProcessor(model, limits)
        self.engine = EncoderEngine(model, encoder_config or EncoderConfig(**config_kwargs))

    def generate(self, inputs: Prompt | Sequence[Prompt]) -> EncoderOutput | list[EncoderOutput]:
        """Encodes the images of one prompt dict ({"prompt": ..., "multi_modal_data": {"image": [...]}}) or of each
        of a list. The prompt must hold one image placeholder per image. Raises ValueError naming a bad image."""
        prompts, single = as_prompt_list(inputs)
        outputs = [self._encode(p) for p in prompts]
        return outputs[0] if single else outputs

    def _encode(self, inputs: Prompt) -> EncoderOutput:
        prompt, images = split_prompt(inputs)
        mm = self.processor.process(prompt, images or [])
        handles = self.engine.encode(mm.images) if mm.images else []
        params = DisaggregatedParams(request_type="context_only", multimodal_embedding_handles=handles,
                                     multimodal_hashes=[list(h) for h in mm.content_hashes])
        return EncoderOutput(prompt, params)

    def stats(self) -> dict[str, float]:
        """Images encoded, cache hits and evictions, leases held."""
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.close()

    def __enter__(self) -> MultimodalEncoder:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
