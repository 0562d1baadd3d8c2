"""What every generate() shares, whoever runs the requests: telling one prompt from many, and waiting for a batch."""

from __future__ import annotations

from typing import Sequence

from tqdm import tqdm

from llmapi.result import GenerationResult

Prompt = str | list[int]


def as_prompt_list(inputs: Prompt | Sequence[Prompt]) -> tuple[list[Prompt], bool]:
    """(the prompts, whether a single prompt was given): a string or a token id list is one prompt."""
    single = isinstance(inputs, str) or (bool(inputs) and isinstance(inputs[0], int))
    return ([inputs] if single else list(inputs)), single


def wait_all(results: list[GenerationResult], use_tqdm: bool, timeout: float | None) -> None:
    """Waits for each result in turn (each with `timeout`), with a progress bar for more than one."""
    for r in tqdm(results, disable=not use_tqdm or len(results) < 2, desc="raypd"):
        r.result(timeout)
