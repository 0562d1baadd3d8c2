"""Post-processing benchmark (not a test): `python -m benchmarks.postproc [--model DIR] [--requests 64] [--steps 512]`.

Feeds synthetic RequestDeltas (R requests x S steps, one token per request per step, tokens from real text) to:
- the in-process path: one DetokenizedGenerationResultBase per request, as the embedded LLM's engine thread does;
- one PostprocWorker inline: unpickle + verify the step's message, process, pickle + sign the outputs (its whole
  per-token CPU cost, no socket), i.e. what one worker process can sustain;
- N worker processes behind a PostprocPool: sender, workers and lane over real signed tcp pipes, end to end.
Then the latency of one output batch (one step of R requests): in-process handling vs the hop through N workers.
Best of --repeats for rates, median/p99 for latencies. All processes share this host's cores: with fewer cores
than N + 1 busy processes, the N-worker rows measure the host, not the workers.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import tempfile
import threading
import time
from pathlib import Path

from transformers import AutoTokenizer

from postproc.detokenized import DetokenizedGenerationResultBase
from llmapi.outputs import RequestDelta, TokenDelta
from llmapi.sampling_params import SamplingParams
from postproc.pipes import new_pipe_key, sign, tcp_address
from postproc.pool import PostprocPool
from postproc.worker import PostprocParams, PostprocWorker

Steps = list[list[RequestDelta]]


def token_stream(tokenizer, count: int) -> list[int]:
    """Real text's token ids (accents, CJK, punctuation), repeated to `count`."""
    from raypd.tools.tiny import corpus

    ids = tokenizer.encode(" ".join(corpus(400, seed=7)) + " 日本語のテキスト ça coûte €5 — naïve")
    return [ids[i % len(ids)] for i in range(count)]


def synthetic_steps(tokens: list[int], num_requests: int, num_steps: int, first_id: int = 0) -> Steps:
    steps = []
    for s in range(num_steps):
        last = s == num_steps - 1
        steps.append([
            RequestDelta(first_id + r, (TokenDelta(0, (tokens[(r * num_steps + s) % len(tokens)],), -0.5 * s, None,
                                                     "length" if last else None),), last)
            for r in range(num_requests)
        ])
    return steps


def best_rate(fn, tokens: int, repeats: int) -> float:
    return max(tokens / fn() for _ in range(repeats))


# ---- in-process and inline ----
def in_process_seconds(tokenizer, steps: Steps, params: SamplingParams) -> float:
    start = time.perf_counter()
    records = {rsp.request_id: DetokenizedGenerationResultBase(rsp.request_id, [1], params, tokenizer, True)
               for rsp in steps[0]}
    for batch in steps:
        for rsp in batch:
            records[rsp.request_id].handle(rsp)
    return time.perf_counter() - start


def as_inputs(steps: Steps, params: SamplingParams) -> list[list[PostprocWorker.Input]]:
    first = [PostprocWorker.Input(rsp, params, PostprocParams(0, (1,)), None, True) for rsp in steps[0]]
    return [first, *steps[1:]]  # as PostprocSender sends them: later Inputs as bare RequestDeltas


def inline_worker_seconds(model: str, steps: Steps, params: SamplingParams) -> float:
    key = new_pipe_key()
    payloads = [pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL) for b in as_inputs(steps, params)]
    macs = [sign(key, p) for p in payloads]
    worker = PostprocWorker((tcp_address("127.0.0.1"), key), [(tcp_address("127.0.0.1", 1), key)], model)
    start = time.perf_counter()
    for mac, payload in zip(macs, payloads):
        assert sign(key, payload) == mac
        for outputs in worker.process(pickle.loads(payload)).values():
            sign(key, pickle.dumps([tuple(out) for out in outputs], protocol=pickle.HIGHEST_PROTOCOL))
    return time.perf_counter() - start


# ---- worker processes ----
class _Sink:
    """Stands in for a request's GenerationResult: counts what the pool's lane delivers."""

    def __init__(self, counter: "_Counter", params: SamplingParams):
        self.counter, self.sampling_params, self.prompt_token_ids, self.streaming = counter, params, [1], True
        self.disaggregated_params = None

    def put(self, res: RequestDelta) -> None:
        self.counter.add(res)


class _Counter:
    """Outputs delivered so far; only the lane thread adds, so no lock, and a waiter is woken only at its target."""

    def __init__(self):
        self.outputs = 0
        self._target = 0
        self._reached = threading.Event()

    def add(self, res: RequestDelta) -> None:
        self.outputs += 1
        if self.outputs >= self._target:
            self._reached.set()

    def wait(self, outputs: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        self._target = outputs
        while self.outputs < outputs:
            self._reached.clear()  # then re-check: an add() between the two is not lost
            if self.outputs < outputs and not self._reached.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{self.outputs} of {outputs} outputs arrived within {timeout}s")


def _submit(pool: PostprocPool, steps: Steps, params: SamplingParams) -> _Counter:
    counter = _Counter()
    for rsp in steps[0]:
        pool.submit(rsp.request_id, _Sink(counter, params))
    return counter


def pool_seconds(pool: PostprocPool, steps: Steps, params: SamplingParams) -> float:
    counter = _submit(pool, steps, params)
    start = time.perf_counter()
    for batch in steps:
        pool.send(batch)
    counter.wait(len(steps) * len(steps[0]))
    return time.perf_counter() - start


def hop_latencies(pool: PostprocPool, steps: Steps, params: SamplingParams) -> list[float]:
    counter = _submit(pool, steps, params)
    latencies = []
    for i, batch in enumerate(steps):
        start = time.perf_counter()
        pool.send(batch)
        counter.wait((i + 1) * len(batch))
        latencies.append(time.perf_counter() - start)
    return latencies


def in_process_latencies(tokenizer, steps: Steps, params: SamplingParams) -> list[float]:
    records = {rsp.request_id: DetokenizedGenerationResultBase(rsp.request_id, [1], params, tokenizer, True)
               for rsp in steps[0]}
    latencies = []
    for batch in steps:
        start = time.perf_counter()
        for rsp in batch:
            records[rsp.request_id].handle(rsp)
        latencies.append(time.perf_counter() - start)
    return latencies


# ---- main ----
def _tiny_model() -> str:
    default = Path("models/tiny-llama")
    if (default / "config.json").exists():
        return str(default)
    from raypd.tools.tiny import build_tiny_model

    return str(build_tiny_model(Path(tempfile.mkdtemp(prefix="raypd-bench-")) / "tiny-llama", arch="llama"))


def _ms(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{statistics.median(ordered) * 1e3:.2f} / {p99 * 1e3:.2f}"


def run(model: str, requests: int, num_steps: int, repeats: int, workers: list[int]) -> list[tuple[str, str, str]]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    params = SamplingParams(max_tokens=num_steps, stop=["<never seen>"])  # a stop string, so matching is paid
    tokens = token_stream(tokenizer, requests * num_steps)
    total = requests * num_steps
    fresh = iter(range(0, 1 << 40, 1 << 20))  # request ids: each run opens new records

    def steps(count: int = num_steps) -> Steps:
        return synthetic_steps(tokens, requests, count, next(fresh))

    rate = best_rate(lambda: in_process_seconds(tokenizer, steps(), params), total, repeats)
    rows = [("in-process (engine thread)", f"{rate:,.0f}", _ms(in_process_latencies(tokenizer, steps(200), params)))]
    rate = best_rate(lambda: inline_worker_seconds(model, steps(), params), total, repeats)
    rows.append(("1 worker, inline (+pickle/HMAC)", f"{rate:,.0f}", "-"))
    for n in workers:
        with_pool = PostprocPool(model, n, lambda rid, idx: None, lambda rid: None)
        try:
            rate = best_rate(lambda: pool_seconds(with_pool, steps(), params), total, repeats)
            hop = hop_latencies(with_pool, steps(200), params)
        finally:
            with_pool.close()
        rows.append((f"{n} worker process{'es' if n > 1 else ''} (end to end)", f"{rate:,.0f}", _ms(hop)))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint dir (its tokenizer is used); default: the tiny model")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    rows = run(args.model or _tiny_model(), args.requests, args.steps, args.repeats, args.workers)
    print(f"\n{args.requests} requests x {args.steps} steps, 1 token per request per step, {os.cpu_count()} CPUs")
    print(f"| path | detokenized tokens/s | latency per output batch of {args.requests}, median / p99 ms |")
    print("|---|---:|---:|")
    for row in rows:
        print(f"| {' | '.join(row)} |")


if __name__ == "__main__":
    main()
