"""raypd bench against a small real HTTP server started here: FastAPI + uvicorn on 127.0.0.1, streaming OpenAI-style
SSE completions with fixed delays. The bench client is meant for any OpenAI endpoint, so a stand-in endpoint whose
timings are known is what lets the test check the numbers it measures."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import statistics
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from benchmarks.client import BenchResult, run_benchmark, run_benchmark_apart
from benchmarks.workload import BenchConfig, make_workload
from cluster.cli import main

TTFT_S, SLOW_TTFT_S, ITL_S = 0.05, 0.3, 0.02
SLOW_ABOVE_WORDS = 20  # prompts longer than this get SLOW_TTFT_S: lets a test know which requests meet a TTFT SLO
MODEL = "fake-model"
HANG_MODEL = "hangs"


@dataclasses.dataclass
class ServerState:
    bodies: list = dataclasses.field(default_factory=list)
    first_chunk_s: list = dataclasses.field(default_factory=list)  # per request: arrival to first chunk, as served
    in_flight: int = 0
    peak: int = 0

    def reset(self) -> None:
        self.bodies.clear()
        self.first_chunk_s.clear()
        self.peak = 0


def _chunk(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _fake_openai(state: ServerState) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrived = time.perf_counter()
        body = await request.json()
        state.bodies.append(body)
        if body["model"] not in (MODEL, HANG_MODEL):
            return JSONResponse({"error": {"message": f"model {body['model']!r} not found"}}, status_code=404)
        return StreamingResponse(_stream(state, body["max_tokens"], _ttft(body), arrived),
                                 media_type="text/event-stream")

    return app


def _ttft(body: dict) -> float:
    if body["model"] == HANG_MODEL:
        return 60.0  # far past any request timeout a test sets
    return SLOW_TTFT_S if len(body["prompt"].split()) > SLOW_ABOVE_WORDS else TTFT_S


async def _stream(state: ServerState, n: int, ttft: float, arrived: float):
    state.in_flight += 1
    state.peak = max(state.peak, state.in_flight)
    try:
        await asyncio.sleep(ttft)
        state.first_chunk_s.append(time.perf_counter() - arrived)
        for i in range(n):
            if i:
                await asyncio.sleep(ITL_S)
            yield _chunk({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
        yield _chunk({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})
        yield "data: [DONE]\n\n"
    finally:
        state.in_flight -= 1


@pytest.fixture(scope="module")
def endpoint():
    state = ServerState()
    server = uvicorn.Server(uvicorn.Config(_fake_openai(state), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, name="fake-openai", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/v1", state
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def server(endpoint):
    url, state = endpoint
    state.reset()
    return url, state


def _config(url: str, **overrides) -> BenchConfig:
    base = dict(base_url=url, model=MODEL, num_requests=8, input_len=10, output_len=6, request_timeout_s=20.0)
    return BenchConfig(**{**base, **overrides})


def test_measures_the_servers_delays(server):
    url, state = server
    result = run_benchmark(_config(url, concurrency=4))
    assert (result.completed, result.failed, result.output_tokens) == (8, 0, 8 * 6)
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 6 for b in state.bodies)
    ttft, itl, tpot = (result.latency_ms(m) for m in ("ttft", "itl", "tpot"))
    # Lower bounds are exact (the server sleeps at least this long); upper bounds leave room for a busy 2-core host.
    # TTFT's counts from the server's first chunks as it actually sent them: twice in fresh-clone CI runs, right after
    # installing, the client measured 193-211 ms against the 50 ms asked for (never reproduced; a host stall would
    # make the server's own sleeps that long too), so a stalled host no longer reads as a client measuring wrong.
    served_ms = statistics.median(state.first_chunk_s) * 1e3
    assert TTFT_S * 1e3 <= ttft.p50 < served_ms + 100
    assert ITL_S * 1e3 * 0.75 <= itl.p50 < ITL_S * 1e3 + 40
    assert ITL_S * 1e3 * 0.9 <= tpot.p50 < ITL_S * 1e3 + 40
    assert len(result.samples_ms("itl")) == 8 * 5
    for metric in ("ttft", "tpot", "itl", "e2e"):
        p = result.latency_ms(metric)
        assert 0 < p.p50 <= p.p90 <= p.p99
    assert result.latency_ms("e2e").p50 >= (TTFT_S + 5 * ITL_S) * 1e3
    assert result.request_throughput == pytest.approx(8 / result.duration_s)
    assert result.output_throughput == pytest.approx(48 / result.duration_s)


def test_goodput_counts_only_requests_within_the_slos(server):
    url, _ = server
    # Prompts of 10..30 words: those over SLOW_ABOVE_WORDS take SLOW_TTFT_S to start, the rest TTFT_S.
    config = _config(url, input_len=20, range_ratio=0.5, num_requests=10, slo_ttft_ms=150)
    run = run_benchmark(config)
    fast = sum(r.prompt_words <= SLOW_ABOVE_WORDS for r in run.records)
    assert 0 < fast < 10, "the seed should give both kinds of prompt"
    # The slow ones start no sooner than SLOW_TTFT_S (the server sleeps that long). A busy 2-core host can hold the
    # fast ones past a fixed SLO (a CI run once saw all five over 150 ms), so the SLO goes between what was seen.
    slowest_fast = max(r.ttft_s for r in run.records if r.prompt_words <= SLOW_ABOVE_WORDS)
    assert slowest_fast < SLOW_TTFT_S
    config = dataclasses.replace(config, slo_ttft_ms=(slowest_fast + SLOW_TTFT_S) / 2 * 1e3)
    result = BenchResult(config, run.duration_s, run.records)
    assert result.completed == 10 and result.good_requests == fast
    assert result.goodput == pytest.approx(fast / result.duration_s)
    tight_tpot = BenchResult(dataclasses.replace(config, slo_ttft_ms=None, slo_tpot_ms=ITL_S * 1e3 / 4),
                             result.duration_s, result.records)
    assert tight_tpot.good_requests == 0
    no_slo = BenchResult(dataclasses.replace(config, slo_ttft_ms=None), result.duration_s, result.records)
    assert no_slo.good_requests is None and no_slo.goodput is None


def test_concurrency_caps_requests_in_flight(server):
    url, state = server
    slow = dict(input_len=SLOW_ABOVE_WORDS + 5, output_len=2, num_requests=6)
    assert run_benchmark(_config(url, concurrency=2, **slow)).completed == 6
    assert state.peak == 2
    state.reset()
    assert run_benchmark(_config(url, **slow)).completed == 6  # no cap, rate inf: all at once
    assert state.peak == 6


def test_poisson_arrivals_and_seeded_prompts():
    rate = 50.0
    specs = make_workload(BenchConfig("http://127.0.0.1:1/v1", MODEL, num_requests=2000, request_rate=rate,
                                      input_len=100, output_len=50, range_ratio=0.2))
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(specs, specs[1:])]
    assert specs[0].arrival_s == 0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(1 / rate, rel=0.1)
    assert all(80 <= s.prompt_words == len(s.prompt.split()) <= 120 and 40 <= s.max_tokens <= 60 for s in specs)
    burst = make_workload(BenchConfig("http://127.0.0.1:1/v1", MODEL, num_requests=2000, input_len=100,
                                      output_len=50, range_ratio=0.2))
    assert all(s.arrival_s == 0 for s in burst)
    assert [s.prompt for s in burst] == [s.prompt for s in specs]  # the rate changes arrivals, not prompts


def test_a_client_in_a_process_of_its_own_measures_like_one_in_this_process(server):
    url, state = server
    result = run_benchmark_apart(_config(url, num_requests=6, concurrency=2))
    assert (result.completed, result.failed, result.output_tokens) == (6, 0, 36)
    assert state.peak <= 2 and len(state.first_chunk_s) == 6
    assert all(r.ttft_s >= TTFT_S for r in result.records)  # the server's delay, seen from the other process


def test_failures_are_recorded_not_raised(server):
    url, _ = server
    missing = run_benchmark(_config(url, model="no-such-model", num_requests=2))
    assert missing.failed == 2 and "HTTP 404" in missing.errors()[0] and missing.latency_ms("ttft") is None
    start = time.monotonic()
    hung = run_benchmark(_config(url, model=HANG_MODEL, num_requests=2, request_timeout_s=0.5))
    assert hung.failed == 2 and all("timed out after 0.5 s" in e for e in hung.errors())
    assert time.monotonic() - start < 10


def test_bench_command_prints_a_table_and_writes_json_and_plot(server, tmp_path, capsys):
    url, _ = server
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--base-url", url, "--model", MODEL, "--num-requests", "6", "--request-rate", "40",
               "--input-len", "8", "--output-len", "4", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "1000",
               "--num-warmups", "1", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "ttft p99 (ms)" in table and "goodput (req/s)" in table
    saved = json.loads(out_json.read_text())[url]
    assert saved["completed"] == 6 and saved["good_requests"] == 6 and len(saved["requests"]) == 6
    assert saved["config"]["request_rate"] == 40 and "api_key" not in saved["config"]
    median_ttft_ms = statistics.median(r["ttft_s"] for r in saved["requests"]) * 1e3
    assert math.isclose(saved["latency_ms"]["ttft"]["p50"], median_ttft_ms)
    assert saved["latency_ms"]["itl"]["p99"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_bench_command_fails_on_failed_requests_and_bad_settings(server, capsys):
    url, _ = server
    assert main(["bench", "--base-url", url, "--model", "nope", "--num-requests", "1"]) == 1
    assert "HTTP 404" in capsys.readouterr().err
    assert main(["bench", "--base-url", url, "--model", MODEL, "--range-ratio", "1.5"]) == 2
    assert "range_ratio" in capsys.readouterr().err
