"""Postproc actors on a real Ray cluster, shared by two frontends (the test process and a Ray actor).

The engine is driven here, standing in for a decode worker: it pushes each step to the actor `request_id % 2`,
and the test process, as request owner, forwards should_abort to it.
"""

from __future__ import annotations

import queue
import time

import pytest
import ray
from transformers import AutoTokenizer

from engine.core.engine import EngineConfig, LLMEngine
from llmapi import SamplingParams
from postproc.actor import PostprocActor
from postproc.routing import Lane, PostprocSender
from postproc.worker import PostprocParams

PROMPTS = ["héllo wörld, ça va", "日本語のテキスト", "naïve café über", "plain ascii words", "one more"]
B_OFFSET = 1_000_000  # request ids are unique across frontends: B's live in their own range


@ray.remote(num_cpus=0)
class FrontendActor:
    """A second request owner: its own lane, registered with every postproc actor; keeps what arrives on it."""

    def __init__(self, postprocs):
        self.outputs: queue.Queue = queue.Queue()
        self.lane = Lane(self.outputs.put, host=ray.util.get_node_ip_address())
        self.lanes = ray.get([p.add_lane.remote(self.lane.addr) for p in postprocs])
        self.got: dict[int, list] = {}

    def lane_indices(self) -> list[int]:
        return self.lanes

    def collect(self, expected: list[int], timeout: float) -> dict[int, list]:
        """client_id -> its Outputs, once every expected request has its final one (or the deadline passes)."""
        deadline = time.monotonic() + timeout
        while not all(self.got.get(i) and self.got[i][-1].is_final for i in expected):
            if time.monotonic() > deadline:
                break
            try:
                out = self.outputs.get(timeout=0.1)
            except queue.Empty:
                continue
            self.got.setdefault(out.client_id, []).append(out)
        return self.got


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    started = not ray.is_initialized()
    if started:
        # "local": a cluster of our own, even when another is running on this host (other test sessions)
        ray.init(address="local", include_dashboard=False, num_cpus=2, logging_level="ERROR")
    actor = ray.remote(num_cpus=0)(PostprocActor)
    postprocs = [actor.remote(tiny_llama) for _ in range(2)]
    addrs = ray.get([p.pull_pipe_addr.remote() for p in postprocs], timeout=120)
    yield postprocs, addrs
    assert all(ray.get([p.shutdown.remote() for p in postprocs], timeout=30))
    for p in postprocs:
        ray.kill(p)
    if started:
        ray.shutdown()


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def _merge(outputs) -> tuple[str, list[int], str | None, object]:
    text, ids, finish, stop = "", [], None, None
    for out in outputs:
        for d in out.res.deltas:
            text, ids = text + d.text, ids + list(d.token_ids)
            finish, stop = d.finish_reason or finish, d.stop_reason if d.finish_reason else stop
    return text, ids, finish, stop


def test_two_frontends_each_receive_exactly_their_own(cluster, tiny_llama):
    postprocs, addrs = cluster
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4))
    frontend_b = FrontendActor.remote(postprocs)
    lanes_b = ray.get(frontend_b.lane_indices.remote(), timeout=120)
    got_a: dict[int, list] = {}
    lane_a = Lane(lambda out: got_a.setdefault(out.client_id, []).append(out), host=ray.util.get_node_ip_address())
    lanes_a = ray.get([p.add_lane.remote(lane_a.addr) for p in postprocs], timeout=30)
    sender = PostprocSender(addrs)
    stop = tokenizer.decode(_free_run(engine, tokenizer, PROMPTS[0]))[3:6]
    requests = {i: (p, _greedy(16), lanes_a) for i, p in enumerate(PROMPTS)}
    requests.update({B_OFFSET + i: (p, _greedy(16), lanes_b) for i, p in enumerate(PROMPTS)})
    requests[len(PROMPTS)] = (PROMPTS[0], _greedy(300, stop=[stop]), lanes_a)  # A's: forwards should_abort
    try:
        for rid, (prompt, params, lanes) in requests.items():
            ids = tokenizer.encode(prompt)
            engine.add_request(rid, ids, params)
            sender.submit(rid, params, PostprocParams(lanes[sender.worker_of(rid)], tuple(ids)))
        a_ids = [rid for rid in requests if rid < B_OFFSET]
        generated = _run_engine(engine, sender, got_a, a_ids, deadline=time.monotonic() + 60)
        got_b = ray.get(frontend_b.collect.remote([rid for rid in requests if rid >= B_OFFSET], 30), timeout=60)
    finally:
        sender.close()
        lane_a.close()
        ray.kill(frontend_b)
    assert set(got_a) == set(a_ids) and set(got_b) == set(requests) - set(a_ids)
    for rid, outs in [*got_a.items(), *got_b.items()]:
        text, ids, finish, _ = _merge(outs)
        assert [o.is_final for o in outs].count(True) == 1 and outs[-1].is_final
        if rid % B_OFFSET < len(PROMPTS):
            assert text == tokenizer.decode(ids, skip_special_tokens=True)
            assert (len(ids), finish) == (16, "length")
            assert _merge(got_b[B_OFFSET + rid % B_OFFSET]) == _merge(got_a[rid % B_OFFSET])  # same prompt, same text
    text, ids, finish, stop_reason = _merge(got_a[len(PROMPTS)])
    assert (finish, stop_reason) == ("stop", stop)
    assert text == tokenizer.decode(ids)[: tokenizer.decode(ids).index(stop)]
    assert generated[len(PROMPTS)] < 100  # should_abort stopped it in the engine long before max_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.requests


def _free_run(engine: LLMEngine, tokenizer, prompt: str) -> list[int]:
    engine.add_request(-1, tokenizer.encode(prompt), _greedy(12))
    ids: list[int] = []
    while engine.has_unfinished_requests():
        ids += [t for rsp in engine.step() for d in rsp.deltas for t in d.token_ids]
    return ids


def _run_engine(engine: LLMEngine, sender: PostprocSender, got_a: dict, a_ids: list[int], deadline: float) -> dict:
    """Steps the engine until it is idle and A has every final; A, as owner, forwards should_abort to the engine.
    Returns the number of tokens the engine generated per request."""
    forwarded: set[tuple[int, int]] = set()
    generated: dict[int, int] = {}
    while engine.has_unfinished_requests() or not all(got_a.get(i) and got_a[i][-1].is_final for i in a_ids):
        assert time.monotonic() < deadline, "requests did not finish in time"
        responses = engine.step()
        for rsp in responses:
            generated[rsp.request_id] = generated.get(rsp.request_id, 0) + sum(len(d.token_ids) for d in rsp.deltas)
        sender.send(responses)
        for rid, outs in list(got_a.items()):
            for index in (i for out in list(outs) for i in out.should_abort):
                if (rid, index) not in forwarded:
                    forwarded.add((rid, index))
                    engine.stop_candidate(rid, index)
        if not engine.has_unfinished_requests():
            time.sleep(0.01)
    return generated
