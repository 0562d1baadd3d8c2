"""`python -m postproc.worker_main REPLY_FD`: one postproc worker process of the embedded LLM (postproc.pool starts it).

A plain entry point, not multiprocessing's spawn: spawn re-imports the parent's `__main__`, so a script that builds an
`LLM(..., num_postprocess_workers=N)` at module level, without an `if __name__ == "__main__":` guard, would start
workers from inside its own workers. Here the parent's module is never imported.

Protocol: the parent writes one JSON line of settings on stdin (pipe keys in hex; stdin, not argv, so no other user
sees them in `ps`) and keeps stdin open; the worker answers on REPLY_FD with its bound pull address (or why it could
not start), then serves until a Shutdown message. Stdin reaching EOF means the parent is gone, whatever killed it:
the worker then exits at once instead of outliving it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from multiprocessing.connection import Connection


def encode_addr(addr: tuple[str, bytes | None]) -> list:
    return [addr[0], addr[1].hex() if addr[1] is not None else None]


def decode_addr(value: list) -> tuple[str, bytes | None]:
    return value[0], bytes.fromhex(value[1]) if value[1] is not None else None


def _exit_when_parent_goes() -> None:
    sys.stdin.buffer.read()  # returns at EOF: the parent closed the pipe or died
    os._exit(0)


def main(reply_fd: int) -> None:
    settings = json.loads(sys.stdin.buffer.readline())
    sys.path[:] = settings["sys_path"]  # as spawn does: the parent's path finds the hook's module
    reply = Connection(reply_fd, readable=False)
    threading.Thread(target=_exit_when_parent_goes, name="raypd-parent-watch", daemon=True).start()
    try:
        from postproc.worker import PostprocWorker

        worker = PostprocWorker(decode_addr(settings["pull_addr"]), [decode_addr(settings["lane_addr"])],
                                settings["tokenizer_dir"], None, settings["hook"])
    except BaseException as exc:
        reply.send_bytes(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        raise
    reply.send_bytes(json.dumps({"pull_addr": encode_addr(worker.pull_pipe_addr)}).encode())
    reply.close()
    worker.start()
    # Outputs still queued reach their lane (up to the pipes' linger), then skip the interpreter's teardown: with
    # torch imported (by transformers) it takes seconds, and nothing here needs it.
    import zmq.asyncio

    zmq.asyncio.Context.instance().term()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
