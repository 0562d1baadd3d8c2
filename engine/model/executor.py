"""ModelExecutor: one step on the model. Runs the scheduled tokens, keeps the prompt logits asked for, and samples
every sequence whose new tokens reach its end. It reads sequences and changes none of them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from engine.core.request import Sequence
from engine.model.runner import ModelRunner
from engine.parallel.host_cores import FixedThreads, HostCores
from engine.sampling.sampler import Sample, Sampler, SampleRow
from engine.core.scheduler import SchedulerOutput


@dataclass
class ModelOutput:
    # One per candidate before the fork, else one per position: the next token, then one after each draft token.
    samples: dict[Sequence, list[Sample]] = field(default_factory=dict)
    prompt_logits: dict[Sequence, dict[int, torch.Tensor]] = field(default_factory=dict)  # position -> (vocab,) fp32


class ModelExecutor:
    def __init__(self, runner: ModelRunner, sampler: Sampler, cores: HostCores | FixedThreads | None = None):
        self.runner = runner
        self.sampler = sampler
        self.cores = cores or FixedThreads()  # how many threads each forward runs on (engine/parallel/host_cores.py)

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        if not out.scheduled:
            return ModelOutput()
        last_rows = [end - 1 for end in itertools.accumulate(n for _, n in out.scheduled)]  # each one's last new token
        rows, owners, flat = self._sample_rows(out, last_rows)
        prompt = self._prompt_rows(out, last_rows)
        with self.cores.forward(last_rows[-1] + 1):
            logits = self.runner.run(out.scheduled, flat + [r for _, rs in prompt.values() for r in rs])
        kept, at = {}, len(flat)
        for seq, (positions, rs) in prompt.items():
            kept[seq] = dict(zip(positions, logits[at:at + len(rs)]))
            at += len(rs)
        return ModelOutput(self._sample(rows, owners, logits[:len(flat)]), kept)

    def _sample_rows(self, out: SchedulerOutput, last_rows: list[int]) -> tuple[list[SampleRow], list, list[int]]:
        """What to sample: one row per candidate of each sequence whose new tokens reach its end (a request's first
        sample draws one token per candidate from the same logits), its sequence, and its flat row. A sequence
        with drafts gets a row per position: each as it would be sampled had the drafts before it been sampled."""
        rows, owners, flat = [], [], []
        for (seq, n), row in zip(out.scheduled, last_rows):
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end yet
            req = seq.request
            if seq.draft:
                k = len(seq.draft)
                for i in range(k + 1):
                    rows.append(SampleRow(req.sampling_params, seq.index, seq.num_tokens + i,
                                          seq.token_ids + seq.draft[:i] if i else seq.token_ids,
                                          seq.num_prompt_tokens))
                    owners.append(seq)
                    flat.append(row - k + i)
                continue
            for k in ([seq.index] if req.forked else range(req.sampling_params.num_candidates)):
                rows.append(SampleRow(req.sampling_params, k, seq.num_tokens, seq.token_ids, seq.num_prompt_tokens,
                                      seq.grammar))
                owners.append(seq)
                flat.append(row)
        return rows, owners, flat

    def _sample(self, rows: list[SampleRow], owners: list, logits: torch.Tensor) -> dict[Sequence, list[Sample]]:
        if not rows:
            return {}
        by_seq: dict[Sequence, list[Sample]] = {}
        for seq, sample in zip(owners, self.sampler(logits, rows)):
            by_seq.setdefault(seq, []).append(sample)
        return by_seq

    def _prompt_rows(self, out: SchedulerOutput, last_rows: list[int]) -> dict[Sequence, tuple[range, list[int]]]:
        """Sequences whose prompt logits are wanted: (the prompt positions this step computes, their flat rows)."""
        kept = {}
        for (seq, n), last in zip(out.scheduled, last_rows):
            req = seq.request
            if req.forked or not req.wants_prompt_logits:
                continue
            start = seq.num_computed_tokens
            count = min(n, req.num_prompt_tokens - start)
            if count <= 0:
                continue
            kept[seq] = (range(start, start + count), list(range(last - n + 1, last - n + 1 + count)))
        return kept
