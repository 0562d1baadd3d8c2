"""ModelExecutor: one step on the model. Runs the scheduled tokens, keeps the prompt logits asked for, and samples
every sequence whose new tokens reach its end. It reads sequences and changes none of them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.request import Sequence
from engine.model.runner import ModelRunner
from engine.sampling.sampler import Sample, Sampler, SampleRow
from engine.core.scheduler import SchedulerOutput


@dataclass
class ModelOutput:
    samples: dict[Sequence, list[Sample]] = field(default_factory=dict)  # one per candidate before the fork, else one
    prompt_logits: dict[Sequence, dict[int, torch.Tensor]] = field(default_factory=dict)  # position -> (vocab,) fp32


class ModelExecutor:
    def __init__(self, runner: ModelRunner, sampler: Sampler):
        self.runner = runner
        self.sampler = sampler

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        if not out.scheduled:
            return ModelOutput()
        hidden, last_rows = self.runner.run(out.scheduled)
        return ModelOutput(self._sample(out, hidden, last_rows), self._prompt_logits(out, hidden, last_rows))

    def _sample(self, out: SchedulerOutput, hidden: torch.Tensor, last_rows: list[int]) -> dict[Sequence, list[Sample]]:
        """A request's first sample draws one token per candidate from the same logits."""
        rows, owners, flat = [], [], []
        for (seq, n), row in zip(out.scheduled, last_rows):
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end yet
            req = seq.request
            for k in ([seq.index] if req.forked else range(req.sampling_params.num_candidates)):
                rows.append(SampleRow(req.sampling_params, k, seq.num_tokens, seq.token_ids, seq.num_prompt_tokens,
                                      seq.grammar))
                owners.append(seq)
                flat.append(row)
        if not rows:
            return {}
        by_seq: dict[Sequence, list[Sample]] = {}
        for seq, sample in zip(owners, self.sampler(self.runner.logits(hidden, flat), rows)):
            by_seq.setdefault(seq, []).append(sample)
        return by_seq

    def _prompt_logits(self, out: SchedulerOutput, hidden: torch.Tensor, last_rows: list[int]) -> dict:
        kept = {}
        for (seq, n), last in zip(out.scheduled, last_rows):
            req = seq.request
            if req.forked or not req.wants_prompt_logits:
                continue
            start = seq.num_computed_tokens
            count = min(n, req.num_prompt_tokens - start)
            if count <= 0:
                continue
            rows = list(range(last - n + 1, last - n + 1 + count))
            kept[seq] = dict(zip(range(start, start + count), self.runner.logits(hidden, rows)))
        return kept
