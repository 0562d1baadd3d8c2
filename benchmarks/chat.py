"""Multi-turn chat with prefix caching on and off, in one run: `python -m benchmarks.chat`.

Workload: every conversation starts with the same system prompt (~1k tokens); each turn appends a user message and
the model's reply, and the next turn's prompt is the whole conversation so far. Conversations run concurrently; a
conversation's next turn arrives when its previous reply is done. Reported per setting: prefix-cache hit rate,
output tokens/s, TTFT percentiles; and, alone on the engine, the TTFT of a 1k-token shared prefix + short suffix
when the prefix is cached (a hit) against when it is not (a miss). Greedy, EOS ignored, the same seeded workload for
both settings. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import statistics
import time
from dataclasses import dataclass, field

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (see benchmarks/offline.py)

import torch  # noqa: E402

from engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from raypd.tools.tiny import build_tiny_model  # noqa: E402
from llmapi.sampling_params import SamplingParams  # noqa: E402

DEFAULT_MODEL_DIR = pathlib.Path("models/tiny-llama-bench")
FIRST_ORDINARY_ID = 10


@dataclass(frozen=True)
class ChatWorkload:
    system: list[int]
    turns: list[list[list[int]]]  # per conversation, per turn: the user message's token ids
    reply_len: int


def make_workload(conversations: int, turns: int, system_len: int, user_len: tuple[int, int], reply_len: int,
                  vocab: int, seed: int = 0) -> ChatWorkload:
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]  # noqa: E731
    return ChatWorkload(tokens(system_len), [[tokens(rng.randint(*user_len)) for _ in range(turns)]
                                             for _ in range(conversations)], reply_len)


@dataclass
class Conversation:
    history: list[int]
    turns_left: list[list[int]]
    request_id: int | None = None
    submitted: float = 0.0
    reply: list[int] = field(default_factory=list)


@dataclass
class ChatResult:
    wall_s: float
    output_tokens: int
    ttfts: list[float]
    hit_rate: float
    replies: list[list[int]]


def run_chat(engine: LLMEngine, wl: ChatWorkload) -> ChatResult:
    convs = [Conversation(list(wl.system), list(turns)) for turns in wl.turns]
    params = SamplingParams(max_tokens=wl.reply_len, temperature=0, ignore_eos=True)
    by_id, ttfts, replies, next_id = {}, [], [], 0
    stats0 = (engine.scheduler.cache_stats.query_tokens, engine.scheduler.cache_stats.hit_tokens)
    start = time.perf_counter()

    def submit(conv: Conversation) -> None:
        nonlocal next_id
        conv.history += conv.turns_left.pop(0)
        conv.request_id, conv.submitted, conv.reply = next_id, time.perf_counter(), []
        by_id[next_id] = conv
        engine.add_request(next_id, list(conv.history), params)
        next_id += 1

    for conv in convs:
        submit(conv)
    while engine.has_unfinished_requests():
        for rsp in engine.step():
            conv = by_id[rsp.request_id]
            if not conv.reply and rsp.deltas and rsp.deltas[0].token_ids:
                ttfts.append(time.perf_counter() - conv.submitted)
            conv.reply += [t for d in rsp.deltas for t in d.token_ids]
            if rsp.finished:
                conv.history += conv.reply
                replies.append(conv.reply)
                if conv.turns_left:
                    submit(conv)
    wall = time.perf_counter() - start
    query = engine.scheduler.cache_stats.query_tokens - stats0[0]
    hits = engine.scheduler.cache_stats.hit_tokens - stats0[1]
    return ChatResult(wall, sum(len(r) for r in replies), ttfts, hits / query if query else 0.0, replies)


def ttft_alone(engine: LLMEngine, prompt: list[int], request_id: int) -> float:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def hit_vs_miss(model_dir: str, config: EngineConfig, prefix_len: int, suffix_len: int, vocab: int,
                repeats: int = 5) -> tuple[float, float]:
    """Best TTFT of a prompt whose prefix_len-token prefix is cached (hit) and of one whose is not (miss)."""
    engine = LLMEngine(model_dir, config)
    rng = random.Random(1)
    tokens = lambda n: [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]  # noqa: E731
    prefix = tokens(prefix_len)
    ttft_alone(engine, prefix + tokens(suffix_len), 0)  # warm-up, and it caches the prefix
    hits = [ttft_alone(engine, prefix + tokens(suffix_len), 1 + i) for i in range(repeats)]
    misses = [ttft_alone(engine, tokens(prefix_len) + tokens(suffix_len), 100 + i) for i in range(repeats)]
    return min(hits), min(misses)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(results: dict[str, ChatResult], hit: float, miss: float, args) -> str:
    on, off = results["caching on"], results["caching off"]
    lines = [f"multi-turn chat: {args.conversations} conversations x {args.turns} turns, system prompt "
             f"{args.system_len} tokens, user messages {args.user_len}, replies {args.reply_len} tokens, "
             f"{args.threads} threads", "",
             "| setting | hit rate | output tok/s | TTFT p50 | TTFT p90 | wall |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r.hit_rate:.1%} | {r.output_tokens / r.wall_s:.0f} | "
                     f"{statistics.median(r.ttfts) * 1e3:.0f} ms | {percentile(r.ttfts, 0.9) * 1e3:.0f} ms | "
                     f"{r.wall_s:.1f} s |")
    same = sum(a == b for a, b in zip(sorted(on.replies), sorted(off.replies)))
    lines += ["", f"throughput, caching on / off: {on.output_tokens / on.wall_s / (off.output_tokens / off.wall_s):.2f}x "
              f"(target >= 2x); replies identical: {same}/{len(off.replies)}",
              f"TTFT alone, {args.system_len}-token shared prefix + {args.user_len[1]}-token suffix: hit "
              f"{hit * 1e3:.1f} ms, miss {miss * 1e3:.1f} ms, hit/miss {hit / miss:.0%} (target <= 25%)"]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chat", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help=f"checkpoint dir; default: build {DEFAULT_MODEL_DIR}")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--user-len", type=lambda s: tuple(int(x) for x in s.split(",")), default=(24, 64))
    p.add_argument("--reply-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the report here as markdown")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = pathlib.Path(args.model) if args.model else DEFAULT_MODEL_DIR
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, size="bench")
    engine_probe = LLMEngine(str(model_dir), EngineConfig(num_blocks=16))
    vocab = engine_probe.spec.vocab_size
    wl = make_workload(args.conversations, args.turns, args.system_len, args.user_len, args.reply_len, vocab)
    results = {}
    for name, caching in (("caching off", False), ("caching on", True)):
        engine = LLMEngine(str(model_dir), EngineConfig(enable_prefix_caching=caching))
        run_chat(engine, make_workload(2, 1, 64, (8, 8), 4, vocab, seed=99))  # warm-up
        results[name] = run_chat(engine, wl)
    hit, miss = hit_vs_miss(str(model_dir), EngineConfig(), args.system_len, args.user_len[1], vocab)
    text = report(results, hit, miss, args)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
