"""Waiting for KV pools to be whole again: every test ends with every block back where it came from."""

from __future__ import annotations

import time


def wait_pools_full(*llms, timeout: float = 10.0) -> None:
    """Waits (bounded) until each embedded LLM holds no request and its block pool is full (cached blocks that no
    request holds count as free); fails naming the LLM."""
    deadline = time.monotonic() + timeout
    for i, llm in enumerate(llms):
        bm, engine = llm.engine.block_manager, llm.engine
        while (bm.num_free_blocks != bm.num_blocks or engine.requests) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.requests, f"LLM {i}: requests left in the engine: {list(engine.requests)}"
        assert bm.num_free_blocks == bm.num_blocks, (
            f"LLM {i}: {bm.num_blocks - bm.num_free_blocks} KV blocks not back in the pool")
        bm.check()  # free (cached or not) and referenced never overlap
