"""One embedded engine (kv_transfer="nixl") in its own process, driven over a filesystem AF_UNIX socket, so that a
test can run it inside a network namespace: `ip netns exec NS python -m tests.engine.netns_peer SOCKET MODEL OPTIONS`.

The socket's authkey, then the cluster key (both engines of a hand-off sign and check KV handles with it), come on
stdin as hex lines, never in argv, which any process can read. OPTIONS is a JSON object of EngineConfig fields.
Each message is a tuple (verb, *args); each reply is ("ok", value) or ("error", traceback text)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from multiprocessing.connection import Listener

# As tests/conftest.py, before torch loads: spinning OpenMP threads would starve the other engine on a small host.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from raypd import LLM  # noqa: E402
from tests.pools import wait_pools_full  # noqa: E402


def _generate(llm: LLM, prompt, params, disaggregated_params, timeout: float) -> dict:
    """Tokens of each output, the hand-off (context-only), and how long the call took."""
    start = time.monotonic()
    out = llm.generate(prompt, params, use_tqdm=False, timeout=timeout, disaggregated_params=disaggregated_params)
    return {"token_ids": [list(o.token_ids) for o in out.outputs], "seconds": time.monotonic() - start,
            "disaggregated_params": out.disaggregated_params}


def _pools_full(llm: LLM, timeout: float) -> None:
    wait_pools_full(llm, timeout=timeout)


VERBS = {
    "generate": _generate,
    "stats": lambda llm: llm.loop.call(lambda engine: engine.stats()),
    "pools_full": _pools_full,
}


def serve(conn, llm: LLM) -> None:
    """Answers messages until "exit" or the test hangs up."""
    while True:
        try:
            verb, *args = conn.recv()
        except EOFError:
            return
        if verb == "exit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", VERBS[verb](llm, *args)))
        except Exception:  # the test sees the peer's traceback, and the peer keeps serving
            conn.send(("error", traceback.format_exc()))


def main() -> None:
    socket_path, model_dir, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    authkey, cluster_key = (bytes.fromhex(sys.stdin.readline().strip()) for _ in range(2))
    torch.set_num_threads(1)
    llm = LLM(model_dir, kv_transfer="nixl", cluster_key=cluster_key, **options)
    try:
        with Listener(socket_path, "AF_UNIX", authkey=authkey) as listener:
            print("listening", flush=True)  # the test connects only after this line: accept() answers at once
            with listener.accept() as conn:
                serve(conn, llm)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
