"""raypd bench: a load generator for any OpenAI-compatible completions endpoint.

Requests arrive as a Poisson process at `request_rate` (all at once when it is inf), at most `concurrency` in flight;
each streams a completion of a random prompt, and the arrival time of every streamed chunk is recorded. From those come
TTFT, TPOT, ITL and E2E percentiles, throughput and goodput (requests per second that met every SLO given).
`workload="chat"`: multi-turn conversations instead. Every conversation starts with the same system prompt
(`system_len` words); conversations arrive as the Poisson process, and each sends `num_turns` requests, one after
another: a turn's prompt is the conversation so far (system prompt, earlier user messages and the server's replies)
plus a new user message of `input_len` words, sent when the previous reply has ended. The share of prompt tokens the
server reports as cached (`usage.prompt_tokens_details.cached_tokens`) is the run's prefix-cache hit rate.
`run_benchmark(config)` is the core: the same seed gives the same prompts, lengths and arrival times, so one process can
measure several endpoints on one workload and compare them (benchmarks.report draws and tabulates them side by side).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import multiprocessing.connection
import time
from dataclasses import dataclass, field, replace

import httpx

from benchmarks.workload import BenchConfig, Percentiles, RequestSpec, make_workload, system_prompt

# Warm-up requests come from the workload of seed + this: they must not put the measured prompts in a prefix cache.
_WARMUP_SEED = 104729


@dataclass
class RequestRecord:
    prompt_words: int
    max_tokens: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive streamed chunks
    output_tokens: int = 0  # the server's usage count when it reports one, else the chunks that carried text
    prompt_tokens: int | None = None  # the server's usage counts, when it reports them
    cached_tokens: int | None = None  # of prompt_tokens, served from its prefix cache

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for a failed or one-token request."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class BenchResult:
    config: BenchConfig
    duration_s: float
    records: list[RequestRecord]

    @property
    def completed(self) -> int:
        return sum(r.ok for r in self.records)

    @property
    def failed(self) -> int:
        return len(self.records) - self.completed

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.records if r.ok)

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def cache_hit_rate(self) -> float | None:
        """Prompt tokens the server served from its prefix cache, as a share of all prompt tokens; None when it did
        not report them."""
        counted = [r for r in self.records if r.ok and r.prompt_tokens and r.cached_tokens is not None]
        prompt = sum(r.prompt_tokens for r in counted)
        return sum(r.cached_tokens for r in counted) / prompt if prompt else None

    @property
    def good_requests(self) -> int | None:
        """Completed requests within every SLO given; None when no SLO was given."""
        if self.config.slo_ttft_ms is None and self.config.slo_tpot_ms is None:
            return None
        return sum(self._meets_slos(r) for r in self.records)

    @property
    def goodput(self) -> float | None:
        good = self.good_requests
        return None if good is None else good / self.duration_s

    def samples_ms(self, metric: str) -> list[float]:
        """Every observation of one of METRICS, in ms: one per completed request, or one per chunk gap for itl."""
        ok = [r for r in self.records if r.ok]
        if metric == "itl":
            return [gap * 1e3 for r in ok for gap in r.itl_s]
        values = [getattr(r, f"{metric}_s") for r in ok]
        return [v * 1e3 for v in values if v is not None]

    def latency_ms(self, metric: str) -> Percentiles | None:
        return Percentiles.of(self.samples_ms(metric))

    def errors(self) -> list[str]:
        return [r.error for r in self.records if r.error]

    def _meets_slos(self, r: RequestRecord) -> bool:
        slo_ttft, slo_tpot = self.config.slo_ttft_ms, self.config.slo_tpot_ms
        if not r.ok or (slo_ttft is not None and r.ttft_s * 1e3 > slo_ttft):
            return False
        return slo_tpot is None or r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot


def run_benchmark(config: BenchConfig) -> BenchResult:
    """Runs one benchmark to completion (every request ends by its own deadline) and returns what was measured."""
    return asyncio.run(arun_benchmark(config))


def run_benchmark_apart(config: BenchConfig) -> BenchResult:
    """run_benchmark in a process of its own: a benchmark that starts a server's Ray in its own process would
    otherwise measure it with a client sharing an interpreter (the GIL, Ray's threads) with that Ray's driver, where
    a peer's server gets a client to itself. Spawned, not forked (no copy of the driver's threads). A process that
    dies raises RuntimeError at once; one still running past the run's own deadlines is killed (TimeoutError)."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_bench_into, args=(config, theirs), name="raypd-bench-client", daemon=True)
    proc.start()
    theirs.close()
    try:
        if not multiprocessing.connection.wait([ours], timeout=_SPAWN_S + _longest_run_s(config)):
            raise TimeoutError(f"the benchmark client ran past its requests' deadlines ({config.base_url})")
        try:
            result = ours.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(f"the benchmark client's process died (exit code {proc.exitcode})")
        if isinstance(result, BaseException):
            raise result
        return result
    finally:
        ours.close()
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def _bench_into(config: BenchConfig, conn) -> None:
    try:
        conn.send(run_benchmark(config))
    except BaseException as exc:  # handed to the parent, which raises it
        conn.send(exc)


def _longest_run_s(config: BenchConfig) -> float:
    """How long a run can take with every request at its deadline: warm-ups one at a time, then the last arrival
    and, where concurrency caps the requests in flight, the waves of them before it."""
    specs = make_workload(config)
    waves = -(-len(specs) // (config.concurrency or len(specs)))
    last = max((spec.arrival_s for spec in specs), default=0.0)
    return (config.num_warmups + waves) * config.request_timeout_s + last


_SPAWN_S = 60.0  # a fresh interpreter importing the client, on a loaded 2-core host


async def arun_benchmark(config: BenchConfig) -> BenchResult:
    specs = make_workload(config)
    limit = config.concurrency or len(specs)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # trust_env=False: a proxy from the environment would add its own latency to every number measured here.
    async with httpx.AsyncClient(base_url=config.base_url.rstrip("/") + "/", headers=headers, trust_env=False,
                                 timeout=httpx.Timeout(config.request_timeout_s),
                                 limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as client:
        for spec in make_workload(replace(config, seed=config.seed + _WARMUP_SEED))[: config.num_warmups]:
            await _send(client, config, spec)
        gate = asyncio.Semaphore(limit)
        start = time.perf_counter()
        if config.workload == "chat":
            conversations = [specs[i:i + config.num_turns] for i in range(0, len(specs), config.num_turns)]
            done = await asyncio.gather(*(_converse(client, config, c, gate, start) for c in conversations))
            records = [record for turns in done for record in turns]
        else:
            records = await asyncio.gather(*(_arrive(client, config, spec, gate, start) for spec in specs))
        duration = time.perf_counter() - start
    return BenchResult(config, duration, list(records))


async def _converse(client: httpx.AsyncClient, config: BenchConfig, turns: list[RequestSpec],
                    gate: asyncio.Semaphore, start: float) -> list[RequestRecord]:
    """One conversation: each turn's prompt is everything said so far plus the new user message."""
    await asyncio.sleep(max(0.0, start + turns[0].arrival_s - time.perf_counter()))
    history, records = system_prompt(config), []
    for spec in turns:
        prompt = f"{history} {spec.prompt}".strip()
        async with gate:
            record, reply = await _exchange(client, config, replace(spec, prompt=prompt,
                                                                    prompt_words=len(prompt.split())))
        records.append(record)
        history = prompt + reply
    return records


async def _arrive(client: httpx.AsyncClient, config: BenchConfig, spec: RequestSpec, gate: asyncio.Semaphore,
                  start: float) -> RequestRecord:
    await asyncio.sleep(max(0.0, start + spec.arrival_s - time.perf_counter()))
    async with gate:  # a request waiting here is not yet sent: its clocks start when it is
        return await _send(client, config, spec)


async def _send(client: httpx.AsyncClient, config: BenchConfig, spec: RequestSpec) -> RequestRecord:
    return (await _exchange(client, config, spec))[0]


async def _exchange(client: httpx.AsyncClient, config: BenchConfig, spec: RequestSpec) -> tuple[RequestRecord, str]:
    """One request's measurements and the text it got back ("" when it failed)."""
    record, reply = RequestRecord(spec.prompt_words, spec.max_tokens), ""
    try:
        reply = await asyncio.wait_for(_stream(client, config, spec, record), config.request_timeout_s)
        record.ok = True
    except asyncio.TimeoutError:
        record.error = f"timed out after {config.request_timeout_s:g} s"
    except Exception as exc:  # a failed request is a data point of the run, not the end of it
        record.error = f"{type(exc).__name__}: {exc}"
    return record, reply


async def _stream(client: httpx.AsyncClient, config: BenchConfig, spec: RequestSpec, record: RequestRecord) -> str:
    body = {"model": config.model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    chunks, usage, texts = 0, None, []
    async with client.stream("POST", "completions", json=body) as rsp:
        if rsp.status_code != 200:
            raise RuntimeError(f"HTTP {rsp.status_code}: {(await rsp.aread())[:300].decode(errors='replace')}")
        async for event in _sse_events(rsp):
            if "error" in event:
                raise RuntimeError(f"error in stream: {event['error']}")
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens", usage)
                record.prompt_tokens = event["usage"].get("prompt_tokens")
                record.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            texts += [choice.get("text") or "" for choice in event.get("choices") or ()]
            if any(choice.get("text") for choice in event.get("choices") or ()):
                now = time.perf_counter()
                if chunks:
                    record.itl_s.append(now - last)
                else:
                    record.ttft_s = now - start
                chunks, last = chunks + 1, now
    if not chunks:
        raise RuntimeError("the stream ended without any text")
    record.e2e_s = time.perf_counter() - start
    record.output_tokens = usage if usage is not None else chunks
    return "".join(texts)


async def _sse_events(rsp: httpx.Response):
    """The JSON payloads of a server-sent event stream, up to `data: [DONE]`."""
    async for line in rsp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
