"""Where a mixture-of-experts layer's time goes: the experts' matmuls, or Python and dispatch around them.

    python -m benchmarks.model.moe [--arch qwen3_moe|mixtral|deepseek_v3] [--tokens 16,512] [--threads 1] [--steps 20]

Builds the bench-size checkpoint (as `make bench-peers` does), then times the sparse MLP of every layer over steps of
T tokens (a decode batch, a prefill chunk) under torch.profiler: the share of the block's wall time spent inside ops
(matmuls, packed or not, the SiLU-and-mul kernel, index_add, routing) against everything else (the per-expert Python
loop, tensor bookkeeping). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.offline_peers import DEEPSEEK_V3, MIXTRAL, QWEN3_MOE
from engine.model.causal_lm import CausalLM
from engine.model.moe import SparseMoe

CHECKPOINTS = {"qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL, "deepseek_v3": DEEPSEEK_V3}


def measure(model: CausalLM, tokens: int, steps: int) -> tuple[float, float, int]:
    """(ms per step over every sparse layer, share of it inside aten ops, experts hit per layer on average)."""
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoe)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, model.spec.hidden_size, generator=gen).to(model.dtype)  # (T, hidden)
    with torch.inference_mode():
        for block in blocks:  # warm-up: oneDNN / MKL pick their kernels for these shapes
            block(x)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                for block in blocks:
                    block(x)
            wall = time.perf_counter() - start
        hit = sum(len(torch.unique(block.route(x)[1])) for block in blocks) / len(blocks)
    # top-level ops (aten, oneDNN's packed matmul, raypd's kernels; their children are inside them): what the kernels
    # cost, Python's dispatch to them included
    events = [e for e in prof.events() if e.cpu_parent is None]
    inside = sum(e.cpu_time_total for e in events) / 1e6  # seconds
    return wall / steps * 1e3, min(inside / wall, 1.0), round(hit)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_moe,mixtral", help="comma-separated: qwen3_moe, mixtral, deepseek_v3")
    parser.add_argument("--tokens", default="16,512", help="tokens per step, comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| model | tokens per step | sparse MLPs, ms per step | inside ops | Python and the rest | experts "
          "hit per layer |\n|---|---|---|---|---|---|")
    for arch in args.arch.split(","):
        model = CausalLM.from_pretrained(CHECKPOINTS[arch].ensure(), dtype="float32")
        for tokens in (int(t) for t in args.tokens.split(",")):
            ms, share, hit = measure(model, tokens, args.steps)
            print(f"| {arch} | {tokens} | {ms:.2f} | {share:.0%} | {1 - share:.0%} | {hit} of "
                  f"{model.spec.moe.num_experts} |", flush=True)


if __name__ == "__main__":
    main()
