"""KV transfer between a prefill and a decode engine, in two processes: `python -m benchmarks.disagg`.

For each prompt length: the prefill time of the prompt, the time the decode engine takes to import its KV (READ the
blocks, READ their generation numbers, validate), the GB/s that makes, and raw NIXL READ GB/s for the same bytes in
the same block size. Targets: >= 70% of raw bandwidth for >= 2k tokens; transfer <= 5% of prefill time.
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args(argv)
    model = args.model or _bench_model()
    print(table(run(model, args.lengths, args.threads)))


def _bench_model() -> str:
    from raypd.tools.tiny import build_tiny_model

    path = pathlib.Path("models/tiny-llama-bench-16k")
    if not (path / "config.json").exists():
        build_tiny_model(path, size="bench", max_position_embeddings=16384)
    return str(path)


if __name__ == "__main__":
    main()
