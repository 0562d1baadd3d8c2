"""What the engine refuses before it queues a request: each check raises ValueError naming what is wrong."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv.block_manager import BlockManager
from engine.config import ModelSpec
from engine.core.request import EngineRequest
from llmapi.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.core.engine import EngineConfig


def check_images(req: EngineRequest, hidden_size: int) -> None:
    """Items in prompt order inside the prompt, each with its (length, hidden) embeddings."""
    if len(req.mm_embeddings) != len(req.mm_items):
        raise ValueError(f"{len(req.mm_items)} image(s) in mm_items but {len(req.mm_embeddings)} embedding "
                         "tensor(s): a prompt's images need their embeddings here")
    end = 0
    for i, (item, emb) in enumerate(zip(req.mm_items, req.mm_embeddings)):
        if item.length < 1 or item.offset < end or item.end > req.num_prompt_tokens:
            raise ValueError(f"image {i} at positions [{item.offset}, {item.end}) is not inside the prompt "
                             f"({req.num_prompt_tokens} tokens) after the previous image")
        if tuple(emb.shape) != (item.length, hidden_size):
            raise ValueError(f"image {i}: embeddings of shape {tuple(emb.shape)}, expected "
                             f"({item.length}, {hidden_size})")
        end = item.end


def check_request(prompt: list[int], params: SamplingParams, spec: ModelSpec, block_manager: BlockManager,
                  config: "EngineConfig") -> None:
    """Raises ValueError naming what is wrong with a request before the engine queues it."""
    if not prompt:
        raise ValueError("prompt is empty: at least one token is needed")
    bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < spec.vocab_size)]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {spec.vocab_size}): {bad[:5]}")
    limit = spec.max_position_embeddings
    if len(prompt) + params.max_tokens > limit:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the context length {limit}"
        )
    if any(t >= spec.vocab_size for t in params.logit_bias or {}):
        raise ValueError(f"SamplingParams.logit_bias: token ids out of range [0, {spec.vocab_size})")
    need = block_manager.request_blocks(len(prompt), params.max_tokens, params.num_candidates,
                                        config.max_num_batched_tokens)
    if need > block_manager.num_blocks:
        raise ValueError(f"request needs {need} KV blocks ({params.num_candidates} candidate(s)), the pool has "
                         f"{block_manager.num_blocks}")
    if params.num_candidates > config.max_num_seqs:
        raise ValueError(f"the request has {params.num_candidates} candidates (n / best_of), the engine runs at "
                         f"most {config.max_num_seqs} sequences at once (max_num_seqs)")
