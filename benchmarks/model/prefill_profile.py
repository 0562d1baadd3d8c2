"""Where a fresh prompt's prefill step goes, op by op: linears, attention (with the KV writes), norms, RoPE, the
activation, sampling, the rest of the model's forward (Python glue, embedding, reshapes) and the engine's step
around it (scheduling, metadata, output processing).

    python -m benchmarks.model.prefill_profile [--model models/tiny-llama-bench] [--dtype float32,bfloat16]
                                               [--tokens 345] [--threads 1] [--steps 8]

Each step prefills a prompt no earlier step sent (prefix caching off too), greedily, one output token. Every op is
timed around its call (the CPU runs them synchronously), so the shares add up to the step's wall time; the median
step is reported. The machine's limits for comparison: fp32 and bf16 GEMM GFLOP/s at the step's largest linear shape
are measured in the same run. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import pathlib
import random
import statistics
import time

import torch

from benchmarks.offline_peers import BENCH
from engine.core.engine import EngineConfig, LLMEngine
from engine.model.linear import Linear
from llmapi.sampling_params import SamplingParams

OPS = {"rms_norm": "norms", "add_rms_norm": "norms", "rope": "rope", "paged_attention": "attention"}


class Timings:
    def __init__(self):
        self.spent: dict[str, float] = collections.defaultdict(float)

    def wrap(self, fn, category: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[category] += time.perf_counter() - start
        return timed


def instrument(engine: LLMEngine, timings: Timings) -> None:
    """Times the model's ops, its forward and the sampler (instance attributes over the methods they call)."""
    model = engine.model
    for module in model.modules():
        ops = getattr(module, "ops", None)
        if ops is not None and not getattr(ops, "_timed", False):
            for name, category in OPS.items():
                if hasattr(ops, name):
                    setattr(ops, name, timings.wrap(getattr(ops, name), category))
            ops._timed = True
        if hasattr(module, "act_and_mul"):
            module.act_and_mul = timings.wrap(module.act_and_mul, "activation")
        if isinstance(module, Linear):
            module.forward = timings.wrap(module.forward, "linears")
    runner = engine.executor.runner
    runner.run = timings.wrap(runner.run, "forward")
    engine.executor.sampler = timings.wrap(engine.executor.sampler, "sampling")


def gemm_gflops(rows: int, inner: int, cols: int, dtype: torch.dtype) -> float:
    a, b = torch.randn(rows, inner).to(dtype), torch.randn(cols, inner).to(dtype)
    for _ in range(3):
        torch.nn.functional.linear(a, b)
    n, start = 20, time.perf_counter()
    for _ in range(n):
        torch.nn.functional.linear(a, b)
    return 2 * rows * inner * cols * n / (time.perf_counter() - start) / 1e9


def profile(model_dir: str, dtype: str, tokens: int, steps: int) -> dict[str, float]:
    """Median ms per category over `steps` fresh-prompt prefill steps."""
    engine = LLMEngine(model_dir, EngineConfig(dtype=dtype, enable_prefix_caching=False, kv_cache_bytes=64 << 20))
    timings = Timings()
    instrument(engine, timings)
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    per_step: list[dict[str, float]] = []
    for i in range(steps + 2):  # two warm-up steps
        prompt = [rng.randrange(10, vocab) for _ in range(tokens)]
        engine.add_request(i, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        timings.spent.clear()
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        if i >= 2:
            per_step.append(split(dict(timings.spent), wall))
    return {k: statistics.median(s[k] for s in per_step) * 1e3 for k in per_step[0]}


def split(spent: dict[str, float], wall: float) -> dict[str, float]:
    ops = ("linears", "attention", "norms", "rope", "activation")
    inside = sum(spent.get(k, 0.0) for k in ops)
    forward = spent.get("forward", 0.0)
    parts = {k: spent.get(k, 0.0) for k in ops}
    parts["model glue (Python, embedding, reshapes)"] = forward - inside
    parts["sampling"] = spent.get("sampling", 0.0)
    parts["engine around the forward"] = wall - forward - parts["sampling"]
    parts["step"] = wall
    return parts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model.prefill_profile",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the bench-size Llama, built if missing)")
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--tokens", type=int, default=345, help="prompt tokens (345 ~ raypd bench's 256 words)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or BENCH.ensure()
    results = {d: profile(model_dir, d, args.tokens, args.steps) for d in args.dtype.split(",")}
    print(f"prefill of a fresh {args.tokens}-token prompt, {args.threads} thread(s), median of {args.steps} steps: "
          f"ms (share of the step)")
    print("| part | " + " | ".join(results) + " |\n|---|" + "---:|" * len(results))
    for part in next(iter(results.values())):
        cells = [f"{r[part]:.2f} ({r[part] / r['step']:.0%})" for r in results.values()]
        print(f"| {part} | " + " | ".join(cells) + " |")
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    for d in results:
        dt = getattr(torch, d)
        print(f"this machine, {args.threads} thread(s), torch's F.linear in {d}: the MLP's up projection "
              f"{args.tokens}x{hidden}x{inner} {gemm_gflops(args.tokens, hidden, inner, dt):.0f} GFLOP/s, "
              f"16 rows {gemm_gflops(16, hidden, inner, dt):.0f} GFLOP/s")


if __name__ == "__main__":
    main()
