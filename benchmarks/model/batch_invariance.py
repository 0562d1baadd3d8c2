"""How often a seeded request's tokens change with the company it is computed in, with and without
EngineConfig.batch_invariant, and what the mode costs.

    python -m benchmarks.model.batch_invariance [--model DIR] [--requests 24] [--tokens 96] [--dtypes float32,bfloat16]

Each seeded request (temperature 0.8, n=2, like a user's retry-safe sampling) runs twice on a fresh engine: alone,
its prompt prefilled in one piece, and then all together with a 64-token step budget, so prompts are chunked, share
steps with other prompts' chunks and with other requests' decodes (what a resume or a re-prefill after a fault
does to a request's KV). Printed per dtype and mode: the requests whose tokens differ between the two runs, the
earliest position they part at, the batched run's output tok/s, and the prefill tok/s of long prompts (8 of 1536
tokens, one output token each), where attending query by query costs most. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import torch

from benchmarks.offline_peers import BENCH
from engine.core.engine import EngineConfig, LLMEngine
from llmapi import SamplingParams


def generate(engine: LLMEngine, prompts: dict[int, list[int]], params: SamplingParams) -> dict[int, list[list[int]]]:
    """Every prompt at once, request id = its seed; -> {id: each candidate's tokens}."""
    out = {}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, dataclasses.replace(params, seed=rid))
        out[rid] = [[] for _ in range(params.n)]
    while engine.has_unfinished_requests():
        for rsp in engine.step():
            for delta in rsp.deltas:
                out[rsp.request_id][delta.index].extend(delta.token_ids)
    return out


def measure(model: str, dtype: str, invariant: bool, prompts: dict[int, list[int]], tokens: int) -> str:
    params = SamplingParams(max_tokens=tokens, temperature=0.8, n=2, ignore_eos=True)
    config = EngineConfig(dtype=dtype, batch_invariant=invariant)
    alone = {}
    for rid, prompt in prompts.items():  # each on a fresh engine: nothing cached, nothing beside it
        alone.update(generate(LLMEngine(model, config), {rid: prompt}, params))
    engine = LLMEngine(model, dataclasses.replace(config, max_num_batched_tokens=64))
    start = time.perf_counter()
    together = generate(engine, prompts, params)
    wall = time.perf_counter() - start
    parted = [p for p in (first_difference(alone[rid], together[rid]) for rid in prompts) if p is not None]
    rate = len(prompts) * params.n * tokens / wall
    return (f"| {dtype} | {'on' if invariant else 'off'} | {len(parted)} of {len(prompts)} | "
            f"{min(parted) if parted else '-'} | {rate:.0f} | {long_prefill_rate(model, config):.0f} |")


def long_prefill_rate(model: str, config: EngineConfig, count: int = 8, length: int = 1536) -> float:
    """Prompt tokens per second over `count` fresh prompts of `length` tokens (after a warm-up prompt)."""
    rng = random.Random(1)
    engine = LLMEngine(model, config)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    generate(engine, {0: [rng.randrange(10, 8000) for _ in range(256)]}, one)
    start = time.perf_counter()
    generate(engine, {rid: [rng.randrange(10, 8000) for _ in range(length)] for rid in range(count)}, one)
    return count * length / (time.perf_counter() - start)


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    spots = [next((i for i, (x, y) in enumerate(zip(ca, cb)) if x != y), None) for ca, cb in zip(a, b)]
    spots = [s for s in spots if s is not None]
    return min(spots) if spots else None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model.batch_invariance",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help=f"default: {BENCH.path} (built if missing)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or BENCH.ensure()
    rng = random.Random(0)
    prompts = {rid: [rng.randrange(10, 8000) for _ in range(rng.randint(16, 256))] for rid in range(args.requests)}
    print("| dtype | batch_invariant | requests whose tokens differ, alone vs batched | earliest position | "
          "batched output tok/s | prefill tok/s, 1536-token prompts |\n|---|---|---|---:|---:|---:|")
    for dtype in args.dtypes.split(","):
        for invariant in (False, True):
            print(measure(model, dtype, invariant, prompts, args.tokens), flush=True)


if __name__ == "__main__":
    main()
