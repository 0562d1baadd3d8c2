"""The parity oracle: transformers' own greedy loop, with the top-2 logit gap recorded at every step."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

NEAR_TIE = 1e-4  # PARITY.md: a divergence is acceptable only where the reference's top-2 gap is below this


class Reference:
    def __init__(self, model_dir: str):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float], list[torch.Tensor]]:
        """transformers generate(do_sample=False): tokens, the top-2 gap at each step, each step's log_softmax."""
        ids = torch.tensor([prompt])
        out = self.model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
            eos_token_id=None, pad_token_id=0,
        )
        tokens = out.sequences[0, len(prompt):].tolist()
        gaps, logprobs = [], []
        for step in out.logits:
            top2 = step[0].float().topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            logprobs.append(torch.log_softmax(step[0].float(), dim=-1))
        return tokens, gaps, logprobs


def assert_same_tokens(ours: list[int], ref: list[int], gaps: list[float], label: str = "") -> None:
    """Token-identical, except that a divergence at a near-tie ends the comparison there."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[i] < NEAR_TIE, f"{label}: token {i} differs ({a} vs {b}) with top-2 gap {gaps[i]:.2e}"
            return
    assert len(ours) == len(ref), f"{label}: {len(ours)} tokens vs {len(ref)}"


class LlavaReference:
    """transformers' LlavaForConditionalGeneration.generate(pixel_values=...) on the checkpoint processor's inputs."""

    def __init__(self, model_dir):
        from transformers import LlavaForConditionalGeneration

        from engine.multimodal.processing import MultimodalProcessor

        self.processor = MultimodalProcessor(model_dir)
        self.model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def greedy(self, prompt: str, images: list, max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and the top-2 gap at each step."""
        mm = self.processor.process(prompt, images)
        inputs = {"input_ids": torch.tensor([mm.token_ids])}
        if mm.images:
            inputs["pixel_values"] = mm.pixel_values()
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        gaps = [float(step[0].float().topk(2).values.diff().abs()) for step in out.logits]
        return out.sequences[0, len(mm.token_ids):].tolist(), gaps
