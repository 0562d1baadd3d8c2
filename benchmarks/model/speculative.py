"""What speculative decoding (n-gram drafts) gains where drafts match and costs where they do not.

    python -m benchmarks.model.speculative [--tokens 128] [--k 4] [--threads 1]

The model has the bench llama's shapes (benchmarks.offline_peers.BENCH) with weights at initializer range 0.05
(models/tiny-llama-bench-loops): random weights that small make greedy text fall into loops of a few tokens and out
of them, as real text repeats spans of its prompt or of itself (code edits, quotes, lists). Two workloads:
`repeats` (greedy: continuations repeat, drafts match) and `random` (temperature 1.0, seeded: continuations are
draws from a flat distribution, drafts rarely exist and almost never match). Each at c=1 (requests one at a time)
and c=16 (16 at once), speculation off and on, each run with prompts of its own (nothing cached) after a warm-up.
Printed: drafts accepted, tokens per verify step, TPOT p50 (per request: (last token time - first) / (tokens - 1)),
and output tok/s, with on/off ratios. A benchmark, not a test (tests/engine/test_speculative.py holds the tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from benchmarks.offline_peers import Checkpoint
from engine.core.engine import EngineConfig, LLMEngine
from engine.spec.ngram import SpeculativeConfig
from llmapi import SamplingParams

LOOPS = Checkpoint("models/tiny-llama-bench-loops", "llama", "bench", "float32", (("initializer_range", 0.05),))
WORKLOADS = {"repeats": SamplingParams(temperature=0, ignore_eos=True),
             "random": SamplingParams(temperature=1.0, seed=0, ignore_eos=True)}


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int):
    """Every prompt, `concurrency` at a time; -> (tokens per request, TPOT per request, wall seconds)."""
    tokens: dict[int, list[int]] = {}
    times: dict[int, list[float]] = {}
    start = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        for rid in range(first, min(first + concurrency, len(prompts))):
            engine.add_request(rid, prompts[rid], params)
            tokens[rid], times[rid] = [], []
        while engine.has_unfinished_requests():
            for rsp in engine.step():
                now = time.perf_counter()
                for delta in rsp.deltas:
                    tokens[rsp.request_id].extend(delta.token_ids)
                    times[rsp.request_id].extend([now] * len(delta.token_ids))
    wall = time.perf_counter() - start
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values()]
    return tokens, tpot, wall


def prompts_of(rng: random.Random, count: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(32, 128))] for _ in range(count)]


def measure(model: str, workload: str, concurrency: int, tokens: int, k: int, rng: random.Random) -> str:
    params = dataclasses.replace(WORKLOADS[workload], max_tokens=tokens)
    count = 4 if concurrency == 1 else concurrency
    spec = SpeculativeConfig(num_speculative_tokens=k)
    results = {}
    for on in (False, True):
        engine = LLMEngine(model, EngineConfig(speculative_config=spec if on else None))
        run(engine, prompts_of(rng, 2, engine.spec.vocab_size), params, 2)  # warm-up
        prompts = prompts_of(rng, count, engine.spec.vocab_size)
        results[on] = run(engine, prompts, params, concurrency), engine.stats(), prompts
    (off_tokens, off_tpot, off_wall), _, _ = results[False]
    (on_tokens, on_tpot, on_wall), stats, _ = results[True]
    drafted, accepted, steps = (stats.get(f"spec_{x}", 0) for x in ("draft_tokens", "accepted_tokens", "verify_steps"))
    off_tpot, on_tpot = statistics.median(off_tpot), statistics.median(on_tpot)
    off_rate, on_rate = count * tokens / off_wall, count * tokens / on_wall
    accept = f"{accepted / drafted:.0%} of {drafted}" if drafted else "no drafts"
    per_step = f"{1 + accepted / steps:.2f}" if steps else "-"
    return (f"| {workload} | {concurrency} | {accept} | {per_step} | {off_tpot * 1e3:.2f} | {on_tpot * 1e3:.2f} | "
            f"{on_tpot / off_tpot:.2f}x | {off_rate:.0f} | {on_rate:.0f} | {on_rate / off_rate:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = LOOPS.ensure()
    rng = random.Random(0)
    print(f"num_speculative_tokens={args.k}, prompt lookup 2..4, {args.tokens} tokens per request, "
          f"{args.threads} thread(s)")
    print("| workload | concurrency | drafts accepted | tokens per verify step | TPOT p50 off (ms) | on (ms) | "
          "on/off | tok/s off | on | on/off |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for workload in WORKLOADS:
        for concurrency in (1, 16):
            print(measure(model, workload, concurrency, args.tokens, args.k, rng), flush=True)


if __name__ == "__main__":
    main()
