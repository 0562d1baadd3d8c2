"""Tensor parallelism on this host: the embedded LLM at 1 rank and at N, the same cores in total, side by side.

    python -m benchmarks.model.tensor_parallel [--model DIR] [--sizes 1,2] [--requests 16] [--rounds 2]

Each size serves a warm-up round, then timed rounds, every round with prompts of its own (no prefix-cache hits are
timed); greedy, EOS ignored. One rank gets every core as torch threads; N ranks get cores / N each. Reported: output
and total tokens/s, and rank 0's time inside all-reduces per model step (two per layer, one for the embeddings, one
for the logits). A benchmark, not a test: token disagreement between sizes is printed, not raised.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as benchmarks.offline: passive OpenMP waits on shared cores

from benchmarks.offline import make_workload  # noqa: E402
from benchmarks.offline_peers import BENCH  # noqa: E402
from engine.config import load_spec  # noqa: E402
from llmapi.sampling_params import SamplingParams  # noqa: E402
from raypd.llm import LLM  # noqa: E402


def run_size(model_dir: str, size: int, rounds: int, requests: int) -> dict:
    cores = os.cpu_count() or 1
    spec = load_spec(model_dir)
    with LLM(model_dir, tensor_parallel_size=size, num_threads=max(1, cores // size), dtype="float32") as llm:
        best, tokens = None, []
        for r in range(rounds + 1):  # round 0 warms up
            work = make_workload(requests, (16, 256), (16, 128), spec.vocab_size, seed=100 + r)
            params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work.output_lens]
            before = llm.engine.stats()
            start = time.perf_counter()
            outs = llm.generate(work.prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            after = llm.engine.stats()
            tokens.append([o.outputs[0].token_ids for o in outs])
            if r and (best is None or wall < best["wall"]):
                # two all-reduces per layer, one for the embeddings and one for the logits (nearly every step)
                steps = (after.get("tp_all_reduce_calls", 0) - before.get("tp_all_reduce_calls", 0)) / (
                    2 * spec.num_layers + 2)
                reduce_s = after.get("tp_all_reduce_s", 0) - before.get("tp_all_reduce_s", 0)
                best = dict(wall=wall, out=work.output_tokens / wall,
                            total=(work.output_tokens + work.prompt_tokens) / wall,
                            reduce_ms=1e3 * reduce_s / steps if steps else 0.0,
                            reduce_share=reduce_s / wall)
    return dict(best, tokens=tokens)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model.tensor_parallel",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help=f"checkpoint dir (default: {BENCH.path}, built if missing)")
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    model_dir = args.model or BENCH.ensure()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {size: run_size(model_dir, size, args.rounds, args.requests) for size in sizes}
    base = results[sizes[0]]
    print(f"\n{model_dir}, {args.requests} requests, prompts 16-256, outputs 16-128, fp32, {os.cpu_count()} cores")
    print("| ranks | output tok/s | total tok/s | vs first | all-reduce ms/step | all-reduce share |")
    print("|---|---|---|---|---|---|")
    for size, r in results.items():
        same = sum(a == b for a, b in zip(sum(r["tokens"], []), sum(base["tokens"], [])))
        print(f"| {size} | {r['out']:.0f} | {r['total']:.0f} | {r['out'] / base['out']:.2f}x | "
              f"{r['reduce_ms']:.3f} | {100 * r['reduce_share']:.0f}% |")
        if same != len(sum(base["tokens"], [])):
            print(f"  {size} ranks: {same}/{len(sum(base['tokens'], []))} requests token-identical to {sizes[0]}")


if __name__ == "__main__":
    main()
