"""KV transfer between a prefill and a decode engine, in two processes: `python -m benchmarks.disagg`.

For each prompt length: the prefill time of the prompt, the time the decode engine takes to import its KV (READ the
blocks, READ their generation numbers, validate), the GB/s that makes, and raw NIXL READ GB/s for the same bytes in
the same block size. Targets: >= 70% of raw bandwidth for >= 2k tokens; transfer <= 5% of prefill time.

`--burst`: a decode engine decoding a few streams gets a burst of long hand-offs whose blocks are more than its pool
holds. Imports wait for blocks; the streams' time per output token before the burst and while it is served, p50 and
p99, and whether every request completed with no re-prefill. Target: p99 during the burst <= 2x p99 before it.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import pathlib
import time

from benchmarks.transfer import raw_read_bandwidth
from engine.core.engine import EngineConfig, LLMEngine, nixl_connector
from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.sampling_params import SamplingParams

LENGTHS = (128, 512, 2048, 8192)
PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
TIMEOUT_S = 600.0


KEY = b"raypd-bench-disagg-cluster-key!!"  # both processes verify each other's handles with it


def _config(threads: int) -> EngineConfig:
    # No prefix caching: each repeat must prefill and move the whole prompt again.
    return EngineConfig(block_size=16, max_num_batched_tokens=8192, num_threads=threads, kv_cache_bytes=1 << 30,
                        cluster_key=KEY, enable_prefix_caching=False)


def _engine(model_dir: str, threads: int) -> LLMEngine:
    config = _config(threads)
    return LLMEngine(model_dir, config, nixl_connector(config))


def _prefill_server(conn, model_dir: str, threads: int) -> None:
    """The prefill engine: prefills what it is sent, then keeps stepping so release notifications free blocks."""
    engine = _engine(model_dir, threads)
    while True:
        if conn.poll(0.01):
            msg = conn.recv()
            if msg is None:
                break
            conn.send(_prefill(engine, *msg))
        engine.step()
    engine.close()


def _prefill(engine: LLMEngine, request_id: int, ids: list[int]):
    start = time.perf_counter()
    engine.add_request(request_id, ids, PARAMS, DisaggregatedParams(request_type="context_only"))
    while True:
        for rsp in engine.step():
            if rsp.final:
                return rsp.handoff.generation_params(), time.perf_counter() - start


def _import(engine: LLMEngine, request_id: int, ids: list[int], dp: DisaggregatedParams) -> float:
    """Seconds from the first READ until the request's KV is in place and validated (the engine's own clock)."""
    before = engine.connector.stats().kv_bytes_read
    engine.add_request(request_id, ids, PARAMS, dp, echo_first_tokens=False)
    deadline = time.monotonic() + TIMEOUT_S
    while engine.connector.stats().kv_bytes_read == before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"import of request {request_id} did not finish")
        engine.step()
    engine.abort_request(request_id)
    engine.step()
    return engine.connector.stats().last_import_s


def _measure(conn, decode: LLMEngine, n: int, repeats: int) -> tuple[float, float]:
    """Best prefill and best transfer seconds for an n-token prompt over `repeats` fresh prefills."""
    ids = [10 + (7 * j) % 4000 for j in range(n)]
    prefill, transfer = [], []
    for k in range(repeats):
        conn.send((n * 10 + k, ids))
        if not conn.poll(TIMEOUT_S):
            raise TimeoutError(f"prefill of {n} tokens took over {TIMEOUT_S} s")
        dp, seconds = conn.recv()
        prefill.append(seconds)
        transfer.append(_import(decode, n * 10 + k, ids, dp))
    return min(prefill), min(transfer)


def run(model_dir: str, lengths=LENGTHS, threads: int = 2, repeats: int = 3) -> list[dict]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    server = ctx.Process(target=_prefill_server, args=(child, model_dir, threads), daemon=True)
    server.start()
    decode = _engine(model_dir, threads)
    block_bytes = decode.kv_cache.layout.block_bytes
    rows = []
    try:
        for n in lengths:
            prefill_s, transfer_s = _measure(conn, decode, n, repeats)
            nbytes = decode.block_manager.blocks_for(n) * block_bytes
            raw = raw_read_bandwidth(nbytes, block_bytes)
            rows.append(dict(tokens=n, mb=nbytes / 1e6, prefill_ms=prefill_s * 1e3, transfer_ms=transfer_s * 1e3,
                             gbps=nbytes / transfer_s / 1e9, raw_gbps=raw))
    finally:
        conn.send(None)
        server.join(timeout=30)
        decode.close()
    return rows


def burst(model_dir: str, streams: int = 4, burst_size: int = 10, burst_tokens: int = 512, pool_blocks: int = 320,
          before_tokens: int = 128) -> dict:
    """The streams decode alone for `before_tokens` (the "before" window, after 16 tokens of warm-up); then every
    burst prompt is sent to the prefill process at once, and once all are prefilled their hand-offs are added
    together. The "during" window runs from the first hand-off added until the last burst request finished; then the streams are stopped."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    server = ctx.Process(target=_prefill_server, args=(child, model_dir, 1), daemon=True)
    server.start()
    config = dataclasses.replace(_config(1), num_blocks=pool_blocks)
    decode = LLMEngine(model_dir, config, nixl_connector(config))
    try:
        return _burst(conn, decode, streams, burst_size, burst_tokens, before_tokens)
    finally:
        conn.send(None)
        server.join(timeout=30)
        decode.close()


def _burst(conn, decode: LLMEngine, streams: int, burst_size: int, burst_tokens: int, before_tokens: int) -> dict:
    long = SamplingParams(max_tokens=2048, temperature=0, ignore_eos=True)  # stopped once the burst is served
    short = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for i in range(streams):
        decode.add_request(i, [10 + (11 * i + 3 * j) % 4000 for j in range(64)], long)
    prompts = {1000 + k: [10 + (13 * k + 7 * j) % 4000 for j in range(burst_tokens)] for k in range(burst_size)}
    stamps: dict[int, list[float]] = {i: [] for i in range(streams)}  # when each stream token came
    counts = {rid: 0 for rid in prompts}  # tokens each burst request generated
    window, sent, queued, ready = [None, None], False, 0, []
    deadline = time.monotonic() + TIMEOUT_S
    while window[1] is None:
        if time.monotonic() > deadline:
            raise TimeoutError("the burst did not finish")
        if not sent and min(len(t) for t in stamps.values()) >= before_tokens:
            for rid, ids in prompts.items():
                conn.send((rid, ids))
            sent = True
        while sent and conn.poll(0):
            ready.append(conn.recv()[0])
        if window[0] is None and len(ready) == burst_size:  # every hand-off arrives at once: a burst
            for dp in ready:
                decode.add_request(dp.ctx_request_id, prompts[dp.ctx_request_id], short, dp)
            window[0] = time.perf_counter()
        _step(decode, stamps, counts)
        queued = max(queued, decode.stats()["num_waiting_imports"])
        if all(c == short.max_tokens for c in counts.values()):
            window[1] = time.perf_counter()
    for i in stamps:
        decode.abort_request(i)
    while decode.has_unfinished_requests():
        decode.step()
    done = sum(c == short.max_tokens for c in counts.values())
    return _burst_row(decode, stamps, window, burst_size, burst_tokens + short.max_tokens, queued, done)


def _step(decode: LLMEngine, stamps: dict[int, list[float]], counts: dict[int, int]) -> None:
    for rsp in decode.step():
        now = time.perf_counter()
        for d in rsp.deltas:
            if rsp.request_id in stamps:
                stamps[rsp.request_id] += [now] * len(d.token_ids)
            else:
                counts[rsp.request_id] += len(d.token_ids)


def _burst_row(decode: LLMEngine, stamps, window, burst_size: int, burst_request_tokens: int, queued: int,
               done: int) -> dict:
    stats = decode.stats()
    before = [b - a for t in stamps.values() for a, b in zip(t[16:], t[17:]) if b < window[0]]
    during = [b - a for t in stamps.values() for a, b in zip(t, t[1:]) if window[0] <= a and b <= window[1]]
    burst_blocks = burst_size * decode.block_manager.blocks_for(burst_request_tokens)
    return dict(pool_blocks=decode.block_manager.num_blocks, burst_blocks=burst_blocks, streams=len(stamps),
                burst=burst_size, completed=f"{done}/{burst_size}", reprefills=stats["num_reprefills"],
                preemptions=stats["num_preemptions"], max_waiting_imports=queued,
                before_p50=_ms(before, 50), before_p99=_ms(before, 99), during_p50=_ms(during, 50),
                during_p99=_ms(during, 99), ratio_p99=_ms(during, 99) / _ms(before, 99))


def _ms(gaps: list[float], q: int) -> float:
    ordered = sorted(gaps)
    return 1e3 * ordered[min(len(ordered) - 1, len(ordered) * q // 100)]


def burst_table(r: dict) -> str:
    return "\n".join([
        "| pool blocks | burst blocks | streams | burst | TPOT p50 / p99 before | TPOT p50 / p99 during | p99 ratio | "
        "completed | re-prefills | preemptions | most imports queued |", "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {r['pool_blocks']} | {r['burst_blocks']} | {r['streams']} | {r['burst']} | {r['before_p50']:.1f} / "
        f"{r['before_p99']:.1f} ms | {r['during_p50']:.1f} / {r['during_p99']:.1f} ms | {r['ratio_p99']:.2f}x | "
        f"{r['completed']} | {r['reprefills']} | {r['preemptions']} | {r['max_waiting_imports']} |"])


def table(rows: list[dict]) -> str:
    lines = ["| prompt tokens | KV MB | prefill ms | transfer ms | transfer GB/s | raw NIXL GB/s | % of raw | "
             "transfer / prefill |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['mb']:.1f} | {r['prefill_ms']:.0f} | {r['transfer_ms']:.2f} | "
                     f"{r['gbps']:.2f} | {r['raw_gbps']:.2f} | {100 * r['gbps'] / r['raw_gbps']:.0f}% | "
                     f"{100 * r['transfer_ms'] / r['prefill_ms']:.2f}% |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disagg", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint dir (default: the bench-size tiny model, built if missing)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--burst", action="store_true", help="a burst of hand-offs larger than the decode pool")
    args = parser.parse_args(argv)
    model = args.model or _bench_model()
    print(burst_table(burst(model)) if args.burst else table(run(model, args.lengths, args.threads)))


def _bench_model() -> str:
    from raypd.tools.tiny import build_tiny_model

    path = pathlib.Path("models/tiny-llama-bench-16k")
    if not (path / "config.json").exists():
        build_tiny_model(path, size="bench", max_position_embeddings=16384)
    return str(path)


if __name__ == "__main__":
    main()
