"""PostprocActor: one PostprocWorker inside a Ray actor, its loop on a thread of the actor. A thin wrapper.

Wire it up: engines connect a PostprocSender to every actor's `pull_pipe_addr()`; each frontend binds a Lane and
registers it with every actor (`add_lane`), keeping the index each returns (it goes in PostprocParams.lane of the
requests routed to that actor). Use as `ray.remote(num_cpus=...)(PostprocActor)` or inside a Serve deployment.
"""

from __future__ import annotations

import threading

import ray

from postproc.pipes import new_pipe_key, tcp_address
from protocol import PipeAddr
from postproc.worker import PostprocWorker

_STOP_TIMEOUT_S = 5.0


class PostprocActor:
    def __init__(self, tokenizer_dir: str, post_processor_hook: str | None = None, pull_key: bytes | None = None,
                 host: str | None = None):
        """Binds the pull pipe on this node's address (or `host`), signed with `pull_key` (a fresh key if None)."""
        host = host or ray.util.get_node_ip_address()
        pull = (tcp_address(host), pull_key or new_pipe_key())
        self._worker = PostprocWorker(pull, [], tokenizer_dir, None, post_processor_hook)
        self._thread = threading.Thread(target=self._worker.start, name="raypd-postproc", daemon=True)
        self._thread.start()

    def pull_pipe_addr(self) -> PipeAddr:
        """(address, key) for engines to connect to; the key travels over Ray's control plane."""
        return self._worker.pull_pipe_addr

    def add_lane(self, addr: PipeAddr) -> int:
        """Registers a frontend's lane; returns its index here (idempotent per address)."""
        return self._worker.add_lane(addr)

    def dropped(self) -> int:
        return self._worker.dropped

    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> bool:
        """Stops the loop; True if it ended within the deadline."""
        self._worker.close()
        self._thread.join(_STOP_TIMEOUT_S)
        return not self._thread.is_alive()
