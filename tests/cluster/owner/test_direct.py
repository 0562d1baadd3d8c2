"""The owner's side of direct starts (cluster/owner/direct.py) over real pipes: which decode replica it picks, what
reaches the replica's control pipe, how the replica's replies come back as the call's stream, and what fails the start.
The whole path on Serve, with a decode replica killed under it, is tested in test_faults."""

from __future__ import annotations

import asyncio

import pytest

from cluster.owner.control import ControlClient
from cluster.owner.direct import DirectStarts, ReplicaGone
from cluster.serving.directory import Entry
from cluster.routing.policy import ReplicaState
from llmapi.sampling_params import SamplingParams
from postproc.pipes import PullPipe, PushPipe, new_pipe_key, tcp_address
from protocol import Accepted, Done, PostprocRoute, Reply, Start, Submit

ROUTE = PostprocRoute((0, 0))


def _entry(replica: str, load_tokens: int) -> Entry:
    return Entry("decode", replica, None, {}, 1, routing=ReplicaState(load_tokens, 16).to_json())


def _submit(request_id: int) -> Submit:
    return Submit(request_id, [5, 6, 7], SamplingParams(max_tokens=4), route=ROUTE)


class Replica:
    """A decode replica's control pipe, read by the test."""

    def __init__(self, name: str):
        self.name = name
        self.pipe = PullPipe((tcp_address("127.0.0.1"), new_pipe_key()))

    def accepted(self) -> Accepted:
        return Accepted(self.pipe.addr, self.name)


@pytest.fixture
def replicas():
    made = [Replica("r1"), Replica("r2")]
    yield made
    for r in made:
        r.pipe.close()


def _with_direct(body) -> None:
    """Runs `await body(direct)` with a DirectStarts on a fresh event loop, closed after."""
    async def run():
        direct = DirectStarts(ControlClient(), asyncio.get_running_loop(), "127.0.0.1")
        try:
            await body(direct)
        finally:
            direct.close()
    asyncio.run(run())


async def _start(direct: DirectStarts, replica: Replica, request_id: int):
    """Starts a request on `replica`: (the stream's first item, pending; the Start as the replica read it)."""
    stream = direct.call((replica.name, replica.pipe.addr), _submit(request_id))
    first = asyncio.ensure_future(stream.__anext__())
    return stream, first, await asyncio.to_thread(replica.pipe.get, 5.0)


def test_a_replica_is_chosen_only_when_every_live_one_is_known_and_the_least_loaded_wins(replicas):
    async def body(direct):
        assert direct.choose([1, 2, 3], None) is None  # nothing in the directory yet
        direct.update([_entry("r1", 500), _entry("r2", 100)])
        direct.learn(replicas[0].accepted())
        assert direct.choose([1, 2, 3], None) is None  # r2 is live and its pipe unknown: it might be the best
        direct.learn(replicas[1].accepted())
        assert direct.choose([1, 2, 3], None) == ("r2", replicas[1].pipe.addr)
        direct.update([_entry("r1", 500)])  # r2 left the directory
        await asyncio.sleep(0.05)
        assert direct.choose([1, 2, 3], None) == ("r1", replicas[0].pipe.addr)
        direct.learn(Accepted(replicas[1].pipe.addr, None))  # a replica without a Serve id is never chosen
        direct.update([_entry("r1", 500), _entry("r2", 0)])
        assert direct.choose([1, 2, 3], None) is None
    _with_direct(body)


def test_the_start_reaches_the_replica_and_its_replies_are_the_calls_stream(replicas):
    replica = replicas[0]

    async def body(direct):
        direct.update([_entry("r1", 0)])
        stream, first, start = await _start(direct, replica, 41)
        assert isinstance(start, Start)
        assert (start.submit.request_id, start.submit.prompt_token_ids, start.submit.route) == (41, [5, 6, 7], ROUTE)
        with PushPipe(start.reply) as back:
            back.put(Reply(41, replica.accepted()))
            assert await asyncio.wait_for(first, 5) == replica.accepted()
            back.put(Reply(99, Done()))  # another request's reply: not this stream's
            back.put(Reply(41, Done()))
            assert [item async for item in stream] == [Done()]
    _with_direct(body)


def test_an_error_the_replica_reports_is_raised_by_the_stream(replicas):
    async def body(direct):
        _, first, start = await _start(direct, replicas[0], 7)
        with PushPipe(start.reply) as back:
            back.put(Reply(7, ValueError("prompt (3 tokens) + max_tokens (4) exceeds the context length 5")))
            with pytest.raises(ValueError, match="context length"):
                await asyncio.wait_for(first, 5)
    _with_direct(body)


def test_a_replica_that_leaves_the_directory_fails_its_started_requests(replicas):
    replica = replicas[0]

    async def body(direct):
        direct.update([_entry("r1", 0)])
        direct.learn(replica.accepted())
        _, first, _ = await _start(direct, replica, 8)
        direct.update([])  # killed: its entry went stale
        with pytest.raises(ReplicaGone, match="left the replica directory"):
            await asyncio.wait_for(first, 5)
        assert direct.choose([1], None) is None  # and its pipe is forgotten
    _with_direct(body)


def test_a_start_no_replica_takes_fails_at_once():
    gone = PullPipe((tcp_address("127.0.0.1"), new_pipe_key()))
    addr = gone.addr
    gone.close()  # nothing listens there any more

    async def body(direct):
        stream = direct.call(("r1", addr), _submit(9))
        with pytest.raises(ReplicaGone, match="takes no messages"):
            await asyncio.wait_for(stream.__anext__(), 5)
    _with_direct(body)
