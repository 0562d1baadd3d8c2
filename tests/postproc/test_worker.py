"""PostprocWorker over real zmq: in a thread fed by a real engine, and as processes behind the embedded LLM."""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace

import pytest
import zmq
from transformers import AutoTokenizer

from engine.core.engine import EngineConfig, LLMEngine
from raypd import LLM, RequestError, RequestOutput, SamplingParams
from postproc.hooks import PostProcessorHook, Terminate
from postproc.pipes import new_pipe_key, sign, tcp_address
from postproc.routing import Lane, PostprocSender
from postproc.worker import PostprocParams, PostprocWorker
from tests.pools import wait_pools_full
from tests.postproc.test_pipes import Tripwire

HOOKS = "tests.postproc.test_worker"
PROMPTS = ["héllo wörld, ça va", "日本語のテキスト", "naïve café über", "plain ascii words"]


# ---- hooks (imported by path, as a user's would be) ----
class UpperHook(PostProcessorHook):
    def process(self, chunk, sampling_params):
        return replace(chunk, deltas=tuple(replace(d, text=d.text.upper()) for d in chunk.deltas))


class SuppressHook(PostProcessorHook):
    def process(self, chunk, sampling_params):
        return None


class TerminateHook(PostProcessorHook):
    """Ends each request once it has 3 tokens: a per-request budget, as a moderation hook might."""

    def __init__(self):
        self.seen = Counter()

    def process(self, chunk, sampling_params):
        self.seen[chunk.request_id] += sum(len(d.token_ids) for d in chunk.deltas)
        return Terminate("hook-limit", chunk) if self.seen[chunk.request_id] >= 3 else chunk


class RaisingHook(PostProcessorHook):
    def process(self, chunk, sampling_params):
        if chunk.request_id == 1:
            raise ValueError("boom")
        return chunk


# ---- a frontend driving an engine through an in-thread worker ----
@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(tiny_llama, EngineConfig(block_size=4))


@contextmanager
def worker_thread(model_dir: str, hook: str | None = None):
    worker = PostprocWorker((tcp_address("127.0.0.1"), new_pipe_key()), [], model_dir, None, hook)
    thread = threading.Thread(target=worker.start, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.close()
        thread.join(5)
        assert not thread.is_alive(), "the worker loop did not stop on close()"


class Frontend:
    """Owner + engine loop in one: adds requests, sends each step, applies Outputs, forwards should_abort."""

    def __init__(self, engine: LLMEngine, worker: PostprocWorker, tokenizer):
        self.engine, self.worker, self.tokenizer = engine, worker, tokenizer
        self.outputs: queue.Queue = queue.Queue()
        self.lane = Lane(self.outputs.put)
        self.lane_index = worker.add_lane(self.lane.addr)  # after start(): lanes may grow at runtime
        self.sender = PostprocSender([worker.pull_pipe_addr])
        self.generated: Counter = Counter()  # tokens the engine produced, per request
        self.finals: dict[int, PostprocWorker.Output] = {}

    def run(self, requests: dict[int, tuple[str, SamplingParams]], timeout: float = 30) -> dict[int, RequestOutput]:
        results = {}
        for rid, (prompt, params) in requests.items():
            ids = self.tokenizer.encode(prompt)
            results[rid] = RequestOutput(rid, ids, params, prompt)
            self.engine.add_request(rid, ids, params)
            self.sender.submit(rid, params, PostprocParams(self.lane_index, tuple(ids)))
        deadline = time.monotonic() + timeout
        while not self.finals.keys() >= results.keys() or self.engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "requests did not finish in time"
            self._step(results)
        return results

    def _step(self, results: dict[int, RequestOutput]) -> None:
        responses = self.engine.step()
        for rsp in responses:
            self.generated[rsp.request_id] += sum(len(d.token_ids) for d in rsp.deltas)
        self.sender.send(responses)
        try:
            outs = [self.outputs.get(timeout=0.001 if responses else 0.2)]
        except queue.Empty:
            return
        while not self.outputs.empty():
            outs.append(self.outputs.get_nowait())
        for out in outs:
            for index in out.should_abort:  # the owner tells the engine, which frees the candidate's blocks
                self.engine.stop_candidate(out.client_id, index)
            if out.res is not None:
                results[out.client_id].put(out.res)
            if out.is_final:
                self.finals[out.client_id] = out

    def close(self) -> None:
        self.sender.close()
        self.lane.close()


@pytest.fixture
def frontend(engine, tokenizer, tiny_llama, request):
    with worker_thread(tiny_llama, getattr(request, "param", None)) as worker:
        fe = Frontend(engine, worker, tokenizer)
        yield fe
        fe.close()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests, "engine blocks not back to full"


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


# ---- the worker in a thread ----
def test_outputs_route_and_records_drop(frontend, tokenizer):
    results = frontend.run({i: (p, greedy(12)) for i, p in enumerate(PROMPTS)})
    for rid, r in results.items():
        out = r.result(timeout=5).outputs[0]
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        final = frontend.finals[rid]
        assert (final.client_id, final.is_final, final.finish_reason, final.num_generated_tokens) == (
            rid, True, "length", 12)
        assert not final.should_abort
    assert not frontend.worker._requests  # records are dropped at the final output


def test_stop_string_split_across_tokens_aborts_and_frees_blocks(frontend, tokenizer, engine):
    prompt = PROMPTS[0]
    free_ids = frontend.run({10: (prompt, greedy(20))})[10].result(timeout=5).outputs[0].token_ids
    pieces = [tokenizer.decode(free_ids[: k + 1]) for k in range(len(free_ids))]
    # A stop string from the last 2 chars of token k's text and the first 2 of token k+1's: it spans the boundary.
    grew = [len(pieces[k]) - len(pieces[k - 1]) for k in range(1, len(pieces))]  # grew[k - 1]: chars token k added
    k = next(k for k in range(2, 15) if grew[k - 1] >= 2 and grew[k] >= 2)
    stop = pieces[k + 1][len(pieces[k]) - 2 : len(pieces[k]) + 2]
    max_tokens = 400
    out = frontend.run({11: (prompt, greedy(max_tokens, stop=[stop]))})[11].result(timeout=5).outputs[0]
    expected = pieces[-1][: pieces[-1].index(stop)]
    assert (out.text, out.finish_reason, out.stop_reason) == (expected, "stop", stop)
    assert frontend.finals[11].should_abort == (0,)
    # should_abort reached the engine: it stopped long before max_tokens, and the fixture checks the pool is full.
    assert frontend.generated[11] < max_tokens // 2


def test_tampered_foreign_and_unsigned_messages_dropped_unread(frontend, tmp_path):
    marker = tmp_path / "unpickled"
    trip = pickle.dumps([Tripwire(marker)])
    key = frontend.worker.pull_pipe_addr[1]
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(frontend.worker.pull_pipe_addr[0])
    try:
        sock.send_multipart([sign(key, pickle.dumps([])), trip])  # tampered: a valid mac for another payload
        sock.send_multipart([sign(new_pipe_key(), trip), trip])  # foreign key
        sock.send_multipart([b"", trip])  # unsigned
        results = frontend.run({20: (PROMPTS[1], greedy(4))})  # the worker still serves
    finally:
        sock.close()
    assert results[20].result(timeout=5).outputs[0].length == 4
    deadline = time.monotonic() + 5  # another connection: the bad ones may be read after the good ones
    while frontend.worker.dropped < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert frontend.worker.dropped == 3
    assert not marker.exists()


@pytest.mark.parametrize("frontend", [f"{HOOKS}.UpperHook"], indirect=True)
def test_hook_emits_modified_chunks(frontend, tokenizer):
    out = frontend.run({30: (PROMPTS[2], greedy(10))})[30].result(timeout=5).outputs[0]
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True).upper()


@pytest.mark.parametrize("frontend", [f"{HOOKS}.SuppressHook"], indirect=True)
def test_hook_suppresses_chunks_but_the_request_still_ends(frontend):
    out = frontend.run({31: (PROMPTS[2], greedy(6))})[31].result(timeout=5).outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == ("", [], "length")


@pytest.mark.parametrize("frontend", [f"{HOOKS}.TerminateHook"], indirect=True)
def test_hook_terminates_with_reason_and_engine_stops(frontend):
    params = SamplingParams(max_tokens=300, temperature=1.0, seed=3, n=2, ignore_eos=True)
    r = frontend.run({32: (PROMPTS[3], params)})[32].result(timeout=5)
    assert [(c.finish_reason, c.stop_reason) for c in r.outputs] == [("stop", "hook-limit")] * 2
    assert sum(c.length for c in r.outputs) in (3, 4)  # the chunk that crossed the budget is kept
    assert sorted(frontend.finals[32].should_abort) == [0, 1]
    assert frontend.generated[32] < 100


@pytest.mark.parametrize("frontend", [f"{HOOKS}.RaisingHook"], indirect=True)
def test_raising_hook_fails_only_its_request(frontend):
    results = frontend.run({0: (PROMPTS[0], greedy(200)), 1: (PROMPTS[1], greedy(200)), 2: (PROMPTS[2], greedy(5))})
    with pytest.raises(RequestError, match="boom"):
        results[1].result(timeout=5)
    assert results[1].outputs[0].finish_reason == "error" and frontend.finals[1].finish_reason == "error"
    assert frontend.generated[1] < 100  # its candidates were stopped in the engine
    assert [results[i].result(timeout=5).outputs[0].length for i in (0, 2)] == [200, 5]
    later = frontend.run({3: (PROMPTS[3], greedy(3))})[3].result(timeout=5)
    assert later.outputs[0].length == 3


def test_hook_path_errors_are_clear(tiny_llama):
    for path, match in [("NoModule", "import path"), (f"{HOOKS}.Missing", "does not name")]:
        with pytest.raises(ValueError, match=match):
            PostprocWorker((tcp_address("127.0.0.1"), new_pipe_key()), [], tiny_llama, None, path)


# ---- the embedded LLM with 0, 1 and 3 worker processes ----
@pytest.fixture(scope="module")
def llms(tiny_llama):
    made = {n: LLM(tiny_llama, block_size=4, num_postprocess_workers=n) for n in (0, 1, 3)}
    yield made
    for llm in made.values():
        started = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - started < 20
    for llm in made.values():
        assert all(not p.is_alive() for p in (llm._postproc._procs if llm._postproc else ()))


def _mixed_params() -> list[SamplingParams]:
    return [
        greedy(24),
        SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=2, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.8, seed=9, best_of=3),
        greedy(40, stop=["e ", "ü"], include_stop_str_in_output=True),
    ]


def _summary(r: RequestOutput):
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
             [{t: lp.rank for t, lp in pos.items()} for pos in c.logprobs or []]) for c in r.outputs]


def _logprobs(r: RequestOutput) -> list[float]:
    return [c.cumulative_logprob for c in r.outputs] + [
        lp.logprob for c in r.outputs for pos in c.logprobs or [] for lp in pos.values()]


def test_identical_outputs_with_0_1_and_3_workers(llms):
    prompts = [p for p in PROMPTS for _ in range(4)]
    params = _mixed_params() * len(PROMPTS)
    runs = {n: llm.generate(prompts, params, use_tqdm=False, timeout=60) for n, llm in llms.items()}
    for n in (1, 3):
        assert [_summary(r) for r in runs[n]] == [_summary(r) for r in runs[0]]
        # Not bit-equal: a stop reaches the engine a few steps later through workers, so later batches differ
        # in size, and the logits with them in the last float bits (the tokens do not change).
        for r, ref in zip(runs[n], runs[0]):
            assert _logprobs(r) == pytest.approx(_logprobs(ref), rel=1e-4)
    finishes = [(c.finish_reason, c.stop_reason) for r in runs[0] for c in r.outputs]
    assert any(f == "stop" and isinstance(s, str) for f, s in finishes), "no stop string matched"


@pytest.mark.timeout(60)  # iterating a stream has no deadline of its own
@pytest.mark.parametrize("n", [0, 1, 3])
def test_streaming_diffs_concatenate_to_decoded_text(llms, n, tokenizer):
    texts = []
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=30, temperature=1.0, seed=i, ignore_eos=True)
        result = llms[n].generate_async(prompt, params, streaming=True)
        diffs = [step.outputs[0].text_diff for step in result]
        out = result.result(timeout=30).outputs[0]
        assert "".join(diffs) == out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        texts.append(out.text)
    assert any(ord(ch) > 127 for t in texts for ch in t), "no multi-byte character in any output"


def test_stop_string_abort_frees_blocks_through_worker_processes(llms, monkeypatch):
    llm = llms[3]
    stops, stop_candidate = [], llm.engine.stop_candidate
    monkeypatch.setattr(llm.engine, "stop_candidate", lambda rid, i: (stops.append((rid, i)), stop_candidate(rid, i)))
    free = llm.generate(PROMPTS[0], greedy(12)).outputs[0]
    stop = free.text[4:7]
    out = llm.generate(PROMPTS[0], greedy(400, stop=[stop]), timeout=30)
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    assert out.outputs[0].text == free.text[: free.text.index(stop)]
    wait_pools_full(llm)
    assert stops == [(out.request_id, 0)]  # should_abort reached the engine through the LLM's command queue


def test_dead_worker_fails_its_requests_by_name(llms):
    llm = llms[1]  # last use of this LLM: its only worker dies here
    running = llm.generate_async(PROMPTS[0], greedy(400))
    llm._postproc._procs[0].kill()
    with pytest.raises(RequestError, match="raypd-postproc-0 .* exited"):
        running.result(timeout=20)
    with pytest.raises(RequestError, match="raypd-postproc-0 .* exited"):
        llm.generate(PROMPTS[1], greedy(3), timeout=20)
    wait_pools_full(llm)


