"""A tensor-parallel rank other than 0, as a process: `python -m engine.parallel.rank_main FD`, FD being its end of
the channel to rank 0 (a socket it inherited). It joins the group, builds its shard and KV pool, then replays rank
0's step plans until rank 0 says stop or goes away. Started as a module, not by multiprocessing's spawn, so a user's
script without a main guard is never re-imported."""

from __future__ import annotations

import datetime
import pickle
import sys
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.model.runner import ModelRunner
from engine.parallel.ranks import START_TIMEOUT_S, RankSetup, join_group


def serve(channel: Connection) -> None:
    setup: RankSetup = channel.recv()
    if setup.num_threads:
        torch.set_num_threads(setup.num_threads)
    channel.send("joined")
    store = dist.TCPStore(setup.store_host, setup.store_port, setup.size, is_master=False,
                          timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    shard = join_group(setup.rank, setup.size, store, setup.device, setup.shm_path)
    model = CausalLM.from_pretrained(setup.model_dir, dtype=setup.dtype, device=setup.device, shard=shard)
    runner = ModelRunner(model, KVCache(model.kv_layout(setup.block_size), channel.recv(), setup.device))
    channel.send("ready")
    while True:
        try:
            plan = pickle.loads(channel.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if plan is None:
            return
        runner.replay(plan)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
