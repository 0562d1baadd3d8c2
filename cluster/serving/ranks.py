"""Tensor-parallel ranks of a Serve replica: rank 0 is the replica itself, ranks 1..N-1 are Ray actors it starts in
the other bundles of its placement group (Serve reserves the group per replica from the role's
`placement_group_bundles`). Each rank actor connects back to rank 0 over TCP, proves it was started by this replica
(a token), and then runs the same loop as a local rank process (engine/parallel/rank_main.py). The actors are owned by
the replica: when Serve replaces it, they go with it.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import time
import uuid
from multiprocessing.connection import Connection

import ray
from ray.util.placement_group import get_current_placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.serving.nice import NICE_ENV, apply_nice
from engine.core.engine import EngineConfig
from engine.parallel.local import SHM_DIR
from engine.parallel.ranks import START_TIMEOUT_S, RankGroup, RankSetup, master_store
from engine.parallel.shm import ShmAllReduce

log = logging.getLogger(__name__)

_TOKEN_BYTES = 16


class RankActor:
    """Rank r of a replica's engine, in bundle r of its placement group, at its replica's nice."""

    def __init__(self) -> None:
        apply_nice()

    def run(self, host: str, port: int, token: bytes, rank: int) -> str:
        """Connects to rank 0 and serves it until told to stop; returns how it ended."""
        from engine.parallel.rank_main import serve

        sock = socket.create_connection((host, port), timeout=START_TIMEOUT_S)
        sock.settimeout(None)
        sock.sendall(token + rank.to_bytes(2, "big"))
        serve(Connection(sock.detach()))
        return "stopped when rank 0 told it to"

    def pid(self) -> int:
        return os.getpid()


class RayMembers:
    """Ranks 1..N-1 as actors (engine.parallel.ranks.Members): each one's `run` call ends when its rank does."""

    def __init__(self) -> None:
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.runs: dict[int, ray.ObjectRef] = {}

    def exited(self) -> dict[int, str]:
        ended = {}
        for rank, ref in self.runs.items():
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                try:
                    ended[rank] = ray.get(ref)
                except Exception as exc:  # the actor died (SIGKILL, node lost) or its loop raised
                    ended[rank] = f"was lost ({type(exc).__name__})"
        return ended

    def stop(self, timeout_s: float) -> None:
        if self.runs:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=timeout_s)
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()


def start_ray_ranks(model_dir: str, config: EngineConfig, name: str, kv_transfer: bool = True) -> RankGroup:
    """Starts ranks 1..N-1 of this replica's engine in bundles 1..N-1 of its placement group and joins the group
    with them (this process is rank 0); they all-reduce through shared memory when every bundle is on this node.
    The actors are named `raypd-rank::{name}::{rank}` (what `ray list actors` shows)."""
    size = config.tensor_parallel_size
    group = get_current_placement_group()
    if group is None or len(group.bundle_specs) < size:
        raise ValueError(f"tensor_parallel_size {size} on Ray needs the replica in a placement group of {size} "
                         "bundles (the role's deployment options ask Serve for it)")
    host = ray.util.get_node_ip_address()
    listener = socket.create_server((host, 0))
    token, group_id = os.urandom(_TOKEN_BYTES), uuid.uuid4().hex
    shm_path = _shm_path(group, size, group_id)
    members, store, channels = RayMembers(), master_store(size, host), {}
    try:
        actor = ray.remote(RankActor)
        for rank in range(1, size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank)
            members.actors[rank] = actor.options(  # max_concurrency 2: pid() answers while run() serves
                name=f"raypd-rank::{name}::{rank}", scheduling_strategy=strategy, max_concurrency=2, num_cpus=0,
                **_bundle_options(group.bundle_specs[rank])).remote()
            members.runs[rank] = members.actors[rank].run.remote(host, listener.getsockname()[1], token, rank)
        channels = _accept(listener, token, size, members)
        for rank, channel in channels.items():
            channel.send(RankSetup(rank, size, host, store.port, model_dir, config.dtype, config.device,
                                   config.num_threads, config.block_size, shm_path,
                                   f"raypd-{group_id[:12]}-r{rank}" if kv_transfer else None))
        ranks = RankGroup([channels[r] for r in range(1, size)], members, store)
        ranks.join(time.monotonic() + START_TIMEOUT_S, config.device, shm_path)
        return ranks
    except BaseException:
        for channel in channels.values():
            channel.close()
        members.stop(0.0)
        raise
    finally:
        listener.close()
        if shm_path is not None:
            os.unlink(shm_path)


def _shm_path(group, size: int, group_id: str) -> str | None:
    """A shared-memory all-reduce file when every bundle is on this node and the engine runs on CPUs; else None."""
    nodes = set(placement_group_table(group)["bundles_to_node_id"].values())
    if nodes != {ray.get_runtime_context().get_node_id()}:
        return None
    path = os.path.join(SHM_DIR, f"raypd-tp-{group_id}")
    ShmAllReduce.create(path, size)
    return path


def _bundle_options(bundle: dict[str, float]) -> dict:
    """The actor options that take all of a bundle: the GPUs (Ray then sets CUDA_VISIBLE_DEVICES) and custom
    resources; the CPUs stay in the bundle for the rank's threads. The replica's nice (its role's) goes with them."""
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    options = {"num_gpus": bundle.get("GPU", 0), "resources": custom}
    if os.environ.get(NICE_ENV):  # the replica's role has a nice: its ranks get it too
        options["runtime_env"] = {"env_vars": {NICE_ENV: os.environ[NICE_ENV]}}
    return options


def _accept(listener: socket.socket, token: bytes, size: int, members: RayMembers) -> dict[int, Connection]:
    """The channel of every rank, by rank: each connection must open with the token and a rank not yet seen."""
    channels: dict[int, Connection] = {}
    deadline = time.monotonic() + START_TIMEOUT_S
    listener.settimeout(0.5)
    while len(channels) < size - 1:
        gone = members.exited()
        if gone:
            rank, how = min(gone.items())
            raise RuntimeError(f"tensor-parallel rank {rank} of {size} {how} before it connected to rank 0")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks {sorted(set(range(1, size)) - set(channels))} did not "
                               f"connect within {START_TIMEOUT_S:.0f} s")
        try:
            sock, _ = listener.accept()
        except socket.timeout:
            continue
        sock.settimeout(10.0)
        try:
            hello = sock.recv(_TOKEN_BYTES + 2, socket.MSG_WAITALL)
        except OSError:
            hello = b""
        rank = int.from_bytes(hello[_TOKEN_BYTES:], "big") if len(hello) == _TOKEN_BYTES + 2 else 0
        if not hmac.compare_digest(hello[:_TOKEN_BYTES], token) or not 0 < rank < size or rank in channels:
            log.warning("refused a connection to rank 0 that was not one of its ranks")
            sock.close()
            continue
        sock.settimeout(None)
        channels[rank] = Connection(sock.detach())
    return channels
