"""Encode -> splice -> prefill -> decode against transformers' LlavaForConditionalGeneration (fp32).

Our pieces: MultimodalProcessor (pixels, expanded prompt, ranges), VisionEncoder (embeddings), embeddings_in_span and
CausalLM.forward(row_embeds=...) over the paged cache, with chunked prefill that cuts images and a batch that mixes
prompts. The reference: transformers' processor + forward / generate(pixel_values=...).
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import transformers

from engine.model.attention import AttentionMetadata, SeqSlice
from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.multimodal.processing import MultimodalPrompt, MultimodalProcessor, embeddings_in_span
from engine.multimodal.vision import VisionEncoder
from tests.engine.images import random_images
from tests.engine.parity import assert_same_tokens

MODELS = {
    "clip-llama": dict(text_arch="llama", vision="clip"),
    "siglip-qwen3": dict(text_arch="qwen3", vision="siglip"),
    "clip-mistral": dict(text_arch="mistral", vision="clip", sliding_window=24),  # the window cuts through images
}
PROMPTS = {
    "one": "<|user|>\nWhat is in <image> this picture?<|eos|>\n<|assistant|>\n",
    "two": "first <image> and then <image>, compare them.",
    "back_to_back": "These: <image><image> are",
    "at_start": "<image> a photo of",
    "text_only": "the quick brown fox jumps over",
}
NEW_TOKENS = 12


class Stack:
    """Our three pieces and transformers' model, for one checkpoint."""

    def __init__(self, path):
        self.path = path
        self.processor = MultimodalProcessor(path)
        self.encoder = VisionEncoder.from_pretrained(path, dtype="float32")
        self.model = CausalLM.from_pretrained(path, dtype="float32")
        self.hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()

    @functools.cached_property
    def unpacked(self) -> CausalLM:
        """The model with its linears unpacked: F.linear, as transformers computes them (the logits test's)."""
        return CausalLM.from_pretrained(self.path, dtype="float32", pack=False)

    def prompt(self, name: str, seed: int = 0) -> MultimodalPrompt:
        text = PROMPTS[name]
        return self.processor.process(text, random_images(text.count("<image>"), seed=seed))

    def embeddings(self, prompt: MultimodalPrompt) -> list[torch.Tensor]:
        if not prompt.images:
            return []
        with torch.inference_mode():
            return list(self.encoder(prompt.pixel_values()))  # each (tokens, hidden)

    def hf_inputs(self, prompt: MultimodalPrompt) -> dict:
        inputs = dict(input_ids=torch.tensor([prompt.token_ids]))
        if prompt.images:
            inputs["pixel_values"] = prompt.pixel_values()
        return inputs


@pytest.fixture(scope="module")
def stack(llava_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = Stack(llava_factory(**MODELS[name]))
        return cache[name]

    return get


def _tables(need: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)  # no sequence's blocks contiguous or in order
    return [[pool.pop() for _ in range(n)] for n in need]


def _forward(model, ids, positions, slices, cache, block_size, row_embeds):
    meta = AttentionMetadata.build(slices, block_size, "cpu")
    with torch.inference_mode():
        return model(torch.tensor(ids), positions, meta, cache, row_embeds=row_embeds)  # (T, hidden)


def _greedy(stack: Stack, prompts: list[MultimodalPrompt], new_tokens: int, chunk=7, block_size=4):
    """Chunked prefill (chunks cut images) and batched decode of all prompts together over one paged cache."""
    embeds = [stack.embeddings(p) for p in prompts]
    need = [-(-(len(p.token_ids) + new_tokens) // block_size) for p in prompts]
    cache = KVCache(stack.model.kv_layout(block_size), sum(need) + 5)
    tables = _tables(need, sum(need) + 5, seed=len(prompts))
    tokens = [list(p.token_ids) for p in prompts]
    computed, outs = [0] * len(prompts), [[] for _ in prompts]
    while any(len(o) < new_tokens for o in outs):
        active = [i for i, o in enumerate(outs) if len(o) < new_tokens]
        takes = [min(chunk, len(tokens[i]) - computed[i]) for i in active]
        ids, rows, values, first_row = [], [], [], 0
        for i, n in zip(active, takes):
            ids += tokens[i][computed[i] : computed[i] + n]
            span = embeddings_in_span(prompts[i].ranges, embeds[i], computed[i], n)  # None past the prompt
            if span is not None:
                rows.append(span[0] + first_row)
                values.append(span[1])
            first_row += n
        positions = torch.cat([torch.arange(computed[i], computed[i] + n) for i, n in zip(active, takes)])
        slices = [SeqSlice((tables[i],), computed[i], n) for i, n in zip(active, takes)]
        row_embeds = (torch.cat(rows), torch.cat(values)) if rows else None
        hidden = _forward(stack.model, ids, positions, slices, cache, block_size, row_embeds)
        with torch.inference_mode():
            last = stack.model.compute_logits(hidden[torch.cumsum(torch.tensor(takes), 0) - 1])  # (active, vocab)
        for row, (i, n) in enumerate(zip(active, takes)):
            computed[i] += n
            if computed[i] == len(tokens[i]):
                tokens[i].append(int(last[row].argmax()))
                outs[i].append(tokens[i][-1])
    return outs


def _reference(stack: Stack, prompt: MultimodalPrompt, new_tokens: int) -> tuple[list[int], list[float]]:
    with torch.inference_mode():
        out = stack.hf.generate(
            **stack.hf_inputs(prompt), max_new_tokens=new_tokens, do_sample=False, output_logits=True,
            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
        )
    gaps = [float(step[0].float().topk(2).values.diff().abs()) for step in out.logits]
    return out.sequences[0, len(prompt.token_ids):].tolist(), gaps


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_prefill_logits_match_transformers(stack, model, prompt):
    """With the linears unpacked (transformers' own fp32 GEMMs), as in test_model's logits test."""
    s = stack(model)
    p = s.prompt(prompt)
    n = len(p.token_ids)
    cache = KVCache(s.model.kv_layout(4), -(-n // 4) + 2)
    slices = [SeqSlice((_tables([-(-n // 4)], -(-n // 4) + 2, seed=0)[0],), 0, n)]
    row_embeds = embeddings_in_span(p.ranges, s.embeddings(p), 0, n)
    hidden = _forward(s.unpacked, list(p.token_ids), torch.arange(n), slices, cache, 4, row_embeds)
    with torch.inference_mode():
        logits = s.unpacked.compute_logits(hidden)  # (n, vocab)
        ref = s.hf(**s.hf_inputs(p)).logits[0].float()  # (n, vocab)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model", list(MODELS))
def test_greedy_tokens_match_generate(stack, model):
    s = stack(model)
    prompts = [s.prompt(name, seed=i) for i, name in enumerate(PROMPTS)]
    got = _greedy(s, prompts, NEW_TOKENS)
    for name, prompt, tokens in zip(PROMPTS, prompts, got):
        ref, gaps = _reference(s, prompt, NEW_TOKENS)
        assert_same_tokens(tokens, ref, gaps, f"{model}/{name}")


def test_the_image_decides_the_tokens(stack):
    # Otherwise the parity above could hold with the images ignored.
    s = stack("clip-llama")
    prompts = [s.prompt("one", seed=seed) for seed in (0, 1)]
    assert prompts[0].token_ids == prompts[1].token_ids and prompts[0].content_hashes != prompts[1].content_hashes
    a, b = _greedy(s, prompts, NEW_TOKENS)
    assert a != b

