"""What every generate() shares, whoever runs the requests: telling one prompt from many, and waiting for a batch."""

from __future__ import annotations

from typing import Sequence

from tqdm import tqdm

from llmapi.result import GenerationResult

Prompt = str | list[int] | dict  # dict: {"prompt": ..., "multi_modal_data": {"image": [...]}}


def as_prompt_list(inputs: Prompt | Sequence[Prompt]) -> tuple[list[Prompt], bool]:
    """(the prompts, whether a single prompt was given): a string, a token id list or a prompt dict is one prompt."""
    single = isinstance(inputs, (str, dict)) or (bool(inputs) and isinstance(inputs[0], int))
    return ([inputs] if single else list(inputs)), single


def wait_all(results: list[GenerationResult], use_tqdm: bool, timeout: float | None) -> None:
    """Waits for each result in turn (each with `timeout`), with a progress bar for more than one."""
    for r in tqdm(results, disable=not use_tqdm or len(results) < 2, desc="raypd"):
        r.result(timeout)


def split_prompt(inputs: Prompt) -> tuple[str | list[int], list | None]:
    """(prompt, images or None) of a prompt or a {"prompt", "multi_modal_data"} dict."""
    if not isinstance(inputs, dict):
        return inputs, None
    unknown = set(inputs) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown:
        raise ValueError(f"unknown prompt key(s) {sorted(unknown)}; expected prompt (or prompt_token_ids) and "
                         "multi_modal_data")
    if ("prompt" in inputs) == ("prompt_token_ids" in inputs):
        raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
    prompt = inputs["prompt"] if "prompt" in inputs else list(inputs["prompt_token_ids"])
    data = inputs.get("multi_modal_data") or {}
    if not isinstance(data, dict) or set(data) - {"image"}:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"multi_modal_data takes {{'image': [images]}}, got {got}")
    images = data.get("image")
    if images is None:
        return prompt, None
    return prompt, list(images) if isinstance(images, (list, tuple)) else [images]
