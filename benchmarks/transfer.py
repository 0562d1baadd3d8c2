"""Raw NIXL READ bandwidth between two processes: `python -m benchmarks.transfer`.

A target process registers a buffer; this process reads all of it, either as one descriptor or split into
per-block descriptors of typical KV block sizes. The per-block reads are scattered (remote blocks in reverse order),
as a real block table is, so NIXL cannot merge neighbouring descriptors back into one.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

from engine.kv.kv_transfer import block_dlist, make_nixl_agent, nixl_bind

MiB = 1 << 20
SIZES = tuple(s * MiB for s in (1, 4, 16, 64, 256))
# None: one descriptor. Blocks of 16 tokens, bf16: 2 MiB is Llama-3-8B, 256 KiB about TinyLlama-1.1B (352 KiB, rounded
# to divide the sizes), 16 KiB a tiny test model.
BLOCK_BYTES = (None, 2 * MiB, 256 * 1024, 16 * 1024)
IO_TIMEOUT_S = 60.0


def raw_read_bandwidth(nbytes: int, block_bytes: int | None = None, min_seconds: float = 0.5) -> float:
    """GB/s (1e9 bytes/s) of NIXL READs of `nbytes` from another process, as one descriptor (block_bytes None or
    == nbytes) or as nbytes // block_bytes block descriptors."""
    return measure(nbytes, [block_bytes], min_seconds)[0]


def measure(nbytes: int, block_sizes: list[int | None], min_seconds: float = 0.5) -> list[float]:
    """One target process, one bandwidth (GB/s) per entry of block_sizes."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    target = ctx.Process(target=_serve, args=(child, nbytes), daemon=True)
    target.start()
    try:
        metadata, base = _recv(conn)
        return _read_all(metadata, base, nbytes, block_sizes, min_seconds)
    finally:
        conn.send("stop")
        target.join(IO_TIMEOUT_S)
        if target.is_alive():
            target.kill()


def _serve(conn, nbytes: int) -> None:
    """Target process: registers a touched buffer, hands out its metadata, waits to be told to stop."""
    buf = np.full(nbytes, 7, dtype=np.uint8)  # touched, so page faults are not part of the measurement
    agent = make_nixl_agent("bench-target")
    agent.registerMem(nixl_bind.nixlRegDList(nixl_bind.DRAM_SEG, [(buf.ctypes.data, nbytes, 0, "")]), [])
    conn.send((agent.getLocalMD(), buf.ctypes.data))
    conn.poll(IO_TIMEOUT_S * 10)


def _read_all(metadata: bytes, base: int, nbytes: int, block_sizes: list[int | None], min_seconds: float):
    buf = np.zeros(nbytes, dtype=np.uint8)
    agent = make_nixl_agent("bench-reader")
    agent.registerMem(nixl_bind.nixlRegDList(nixl_bind.DRAM_SEG, [(buf.ctypes.data, nbytes, 0, "")]), [])
    peer = agent.loadRemoteMD(metadata).decode()
    results = []
    for block_bytes in block_sizes:
        size = block_bytes or nbytes
        if nbytes % size:
            raise ValueError(f"nbytes {nbytes} is not a multiple of block_bytes {size}")
        rows = nbytes // size
        local = _prep(agent, "", block_dlist(buf.ctypes.data, size, rows, 0))
        remote = _prep(agent, peer, block_dlist(base, size, rows, 0))
        xfer = agent.makeXferReq(nixl_bind.NIXL_READ, local, list(range(rows)), remote,
                                 list(range(rows))[::-1], b"", [], False)
        results.append(nbytes / _seconds_per_read(agent, xfer, min_seconds) / 1e9)
        for h in (local, remote):
            agent.releasedDlistH(h)
        agent.releaseXferReq(xfer)
    if not (buf == 7).all():
        raise RuntimeError("bench read did not deliver the target's bytes")
    return results


def _prep(agent, peer: str, rows: np.ndarray) -> int:
    name = peer or nixl_bind.NIXL_INIT_AGENT
    return agent.prepXferDlist(name, nixl_bind.nixlXferDList(nixl_bind.DRAM_SEG, rows), [])


def _seconds_per_read(agent, xfer: int, min_seconds: float) -> float:
    """Re-posts one prepared request; the first (warm-up: connection, registration caches) is not timed."""
    _read_once(agent, xfer)
    count, start = 0, time.perf_counter()
    while count < 3 or time.perf_counter() - start < min_seconds:
        _read_once(agent, xfer)
        count += 1
    return (time.perf_counter() - start) / count


def _read_once(agent, xfer: int) -> None:
    deadline = time.monotonic() + IO_TIMEOUT_S
    status = agent.postXferReq(xfer)
    while status == nixl_bind.NIXL_IN_PROG:
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench read did not finish within {IO_TIMEOUT_S} s")
        time.sleep(20e-6)
        status = agent.getXferStatus(xfer)
    if status != nixl_bind.NIXL_SUCCESS:
        raise RuntimeError(f"bench read failed with NIXL status {status}")


def _recv(conn):
    if not conn.poll(IO_TIMEOUT_S):
        raise TimeoutError(f"bench target sent no metadata within {IO_TIMEOUT_S} s")
    return conn.recv()


def _label(block_bytes: int | None) -> str:
    if block_bytes is None:
        return "1 desc"
    return f"{block_bytes // MiB} MiB blk" if block_bytes >= MiB else f"{block_bytes // 1024} KiB blk"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[s // MiB for s in SIZES])
    ap.add_argument("--block-bytes", type=int, nargs="+", default=[b for b in BLOCK_BYTES if b],
                    help="per-block descriptor sizes to compare with one descriptor")
    ap.add_argument("--min-seconds", type=float, default=0.5, help="time spent reading per cell")
    args = ap.parse_args(argv)
    modes = [None, *args.block_bytes]
    print(f"NIXL READ GB/s, UCX, DRAM->DRAM, two processes (min {args.min_seconds} s per cell)")
    print(f"{'size':>8} " + " ".join(f"{_label(m):>12}" for m in modes))
    for mib in args.sizes_mib:
        nbytes = mib * MiB
        usable = [m for m in modes if m is None or (m <= nbytes and nbytes % m == 0)]
        gbps = dict(zip(usable, measure(nbytes, usable, args.min_seconds)))
        cells = [f"{gbps[m]:12.2f}" if m in gbps else f"{'-':>12}" for m in modes]
        print(f"{mib:>5} MB " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
