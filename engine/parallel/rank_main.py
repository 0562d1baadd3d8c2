"""A tensor-parallel rank other than 0, as a process: `python -m engine.parallel.rank_main FD`, FD being its end of
the channel to rank 0 (a socket it inherited). It joins the group, builds its shard and KV pool, then replays rank
0's step plans (and, in an engine that exchanges KV, its orders to read KV into this rank's pool) until rank 0
says stop or goes away. Started as a module, not by multiprocessing's spawn, so a user's script without a main guard
is never re-imported. A rank of a Serve replica runs the same serve() inside a Ray actor (cluster/serving/ranks.py)."""

from __future__ import annotations

import datetime
import pickle
import sys
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.model.runner import ModelRunner, StepPlan
from engine.parallel.ranks import START_TIMEOUT_S, RankReady, RankSetup, join_group


def serve(channel: Connection) -> None:
    setup: RankSetup = channel.recv()
    if setup.num_threads:
        torch.set_num_threads(setup.num_threads)
    channel.send("joined")
    store = dist.TCPStore(setup.store_host, setup.store_port, setup.size, is_master=False,
                          timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    shard = join_group(setup.rank, setup.size, store, setup.device, setup.shm_path)
    model = CausalLM.from_pretrained(setup.model_dir, dtype=setup.dtype, device=setup.device, shard=shard)
    kv_cache = KVCache(model.kv_layout(setup.block_size), channel.recv(), setup.device)
    reader = _reader(setup, kv_cache)
    channel.send(RankReady(reader.transport.metadata() if reader else None))
    try:
        _replay(channel, ModelRunner(model, kv_cache), reader)
    finally:
        if reader is not None:
            reader.close()


def _reader(setup: RankSetup, kv_cache: KVCache):
    """This rank's side of KV hand-offs: its pool on a NIXL agent of its own (nixl only loaded then)."""
    if setup.kv_agent is None:
        return None
    from engine.kv.head_reads import RankReader
    from engine.kv.kv_transfer import NixlTransport

    return RankReader(NixlTransport(setup.kv_agent, kv_cache), kv_cache.layout, setup.rank)


def _replay(channel: Connection, runner: ModelRunner, reader) -> None:
    """Runs rank 0's messages in order until it says stop or goes away: step plans, and KV reads (each ReadDone
    sent back when the read ends; while reads are in flight this polls them between messages)."""
    while True:
        if reader is not None and reader.busy and not channel.poll(reader.wait_s()):
            for done in reader.poll():
                channel.send(done)
            continue
        try:
            message = pickle.loads(channel.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if message is None:
            return
        if isinstance(message, StepPlan):
            runner.replay(message)
        else:
            for done in reader.handle(message):
                channel.send(done)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
