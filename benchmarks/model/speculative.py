"""What speculative decoding (n-gram drafts) gains where drafts match and costs where they do not.

    python -m benchmarks.model.speculative [--tokens 128] [--k 4] [--threads 1]

The model has the bench llama's shapes (benchmarks.offline_peers.BENCH) with weights at initializer range 0.03
(models/tiny-llama-bench-loops): random weights that small make greedy text fall into loops of a few tokens and out
of them, as real text repeats spans of its prompt or of itself (code edits, quotes, lists). Two workloads:
`repeats` (greedy: continuations repeat, drafts match) and `random` (temperature 1.0, seeded: continuations are
draws from a flat distribution, drafts rarely exist and almost never match). Each at c=1 (requests one at a time)
and c=16 (16 at once). Speculation off and on run on fresh engines with the same prompts (nothing cached: each round
draws new ones), alternated (off first, then on first), `--rounds` times after a warm-up. Printed: drafts accepted, tokens per verify step,
TPOT p50 over every request of every round (per request: (last token time - first) / (tokens - 1)), output tok/s
(the rounds' tokens over their time), on/off ratios, and whether the tokens were the same. A benchmark, not a test
(tests/engine/test_speculative.py holds the tokens).
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
from engine.spec.config import SpeculativeConfig
from llmapi import SamplingParams

LOOPS = Checkpoint("models/tiny-llama-bench-loops", "llama", "bench", "float32", (("initializer_range", 0.03),))
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


def measure(model: str, workload: str, concurrency: int, tokens: int, k: int, rounds: int,
            rng: random.Random) -> str:
    params = dataclasses.replace(WORKLOADS[workload], max_tokens=tokens)
    count = 4 if concurrency == 1 else concurrency
    configs = {False: EngineConfig(), True: EngineConfig(speculative_config=SpeculativeConfig(num_speculative_tokens=k))}
    engines = {on: LLMEngine(model, config) for on, config in configs.items()}
    vocab = engines[False].spec.vocab_size
    for engine in engines.values():
        run(engine, prompts_of(rng, 2, vocab), params, 2)  # warm-up
    tpot, wall, outputs = {False: [], True: []}, {False: 0.0, True: 0.0}, {False: [], True: []}
    for r in range(rounds):
        prompts = prompts_of(rng, count, vocab)
        for on in (False, True) if r % 2 == 0 else (True, False):
            got, times, seconds = run(engines[on], prompts, params, concurrency)
            tpot[on] += times
            wall[on] += seconds
            outputs[on].append(got)
    stats = engines[True].stats()
    drafted, accepted, steps = (stats[f"spec_{x}"] for x in ("draft_tokens", "accepted_tokens", "verify_steps"))
    off, on = statistics.median(tpot[False]), statistics.median(tpot[True])
    rate_off, rate_on = (rounds * count * tokens / wall[x] for x in (False, True))
    accept = f"{accepted / drafted:.0%} of {drafted}" if drafted else "no drafts"
    per_step = f"{1 + accepted / steps:.2f}" if steps else "-"
    same = "yes" if outputs[False] == outputs[True] else "no"
    return (f"| {workload} | {concurrency} | {accept} | {per_step} | {off * 1e3:.2f} | {on * 1e3:.2f} | "
            f"{on / off:.2f}x | {rate_off:.0f} | {rate_on:.0f} | {rate_on / rate_off:.2f}x | {same} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = LOOPS.ensure()
    rng = random.Random(0)
    print(f"num_speculative_tokens={args.k}, prompt lookup 2..4, {args.tokens} tokens per request, "
          f"{args.threads} thread(s)")
    print("| workload | concurrency | drafts accepted | tokens per verify step | TPOT p50 off (ms) | on (ms) | "
          "on/off | tok/s off | on | on/off | same tokens |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for workload in args.workloads.split(","):
        for concurrency in (1, 16):
            print(measure(model, workload, concurrency, args.tokens, args.k, args.rounds, rng), flush=True)


if __name__ == "__main__":
    main()
