"""Logits processors: logit bias, repetition / frequency / presence penalties, the grammar's mask, and min-p.

Only rows whose request asks for one pay for it; the sampler skips this module when no row does. The penalties
follow their references op for op in fp32: repetition_penalty is transformers' RepetitionPenaltyLogitsProcessor
(prompt and output tokens), frequency and presence penalties are OpenAI's as vLLM applies them (output tokens only),
min_p is transformers' MinPLogitsWarper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sampling.sampler import SampleRow


def process_logits(logits: torch.Tensor, rows: list["SampleRow"]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (R, vocab) fp32, left unchanged. Returns (scores, masked), both (R, vocab): scores after the bias and
    penalties (logprobs are of these), masked = scores with what each row's grammar forbids at -inf (sampled from)."""
    scores = logits.clone()
    grammar_rows = []
    for i, row in enumerate(rows):
        params = row.params
        if not params.processes_logits:
            continue
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            scores[i, ids] += torch.tensor(list(params.logit_bias.values()), dtype=scores.dtype)
        if params.repetition_penalty != 1:
            scores[i] = repetition_penalty(scores[i], row.token_ids, params.repetition_penalty)
        if params.frequency_penalty or params.presence_penalty:
            output = row.token_ids[row.num_prompt_tokens:]
            scores[i] = frequency_presence(scores[i], output, params.frequency_penalty, params.presence_penalty)
        if row.grammar is not None:
            grammar_rows.append(i)
    if not grammar_rows:
        return scores, scores
    masked = scores.clone()
    for i in grammar_rows:
        masked[i].masked_fill_(~rows[i].grammar.allowed(), float("-inf"))
    return scores, masked


def repetition_penalty(scores: torch.Tensor, token_ids: list[int], penalty: float) -> torch.Tensor:
    """scores: (vocab,). Each token seen so far: a positive logit divided by penalty, a negative one multiplied."""
    if not token_ids:
        return scores
    ids = torch.tensor(token_ids, dtype=torch.long)
    seen = scores.gather(0, ids)
    return scores.scatter(0, ids, torch.where(seen < 0, seen * penalty, seen / penalty))


def frequency_presence(scores: torch.Tensor, output_ids: list[int], frequency: float, presence: float
                       ) -> torch.Tensor:
    """scores: (vocab,). Minus frequency per occurrence of a token in the output, minus presence once if it occurs."""
    if not output_ids:
        return scores
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=scores.numel())  # (vocab,)
    counts = counts[: scores.numel()].to(scores.dtype)
    return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)


def apply_min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """scores: (vocab,), after temperature. Tokens whose probability is below min_p times the top one's are
    removed; the most likely token always stays."""
    probs = torch.softmax(scores, dim=-1)
    remove = probs < min_p * probs.amax()
    remove[probs.argmax()] = False
    return scores.masked_fill(remove, float("-inf"))
