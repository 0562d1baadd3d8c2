"""The owner's side of the token path, without Ray: outputs handed from the lane's thread to the owner's loop
(cluster.owner.lanes.ToLoop), results fed on their consumer's own loop, and the SSE pieces of one or several results."""

import asyncio
import threading

import pytest

from cluster.owner.lanes import ToLoop
from cluster.edge.streaming import pieces
from llmapi.outputs import RequestDelta, TokenDelta
from llmapi.result import RequestError, RequestOutput
from llmapi.sampling_params import SamplingParams
from postproc.routing import Output


def _out(client_id: int) -> Output:
    return Output(client_id, None, False, None, None, None, (), None, None)


def _result(request_id: int, n: int = 1) -> RequestOutput:
    return RequestOutput(request_id, [1, 2, 3], SamplingParams(max_tokens=8, n=n), None, streaming=True)


def _step(request_id: int, text: str, finish: str | None = None, index: int = 0) -> RequestDelta:
    return RequestDelta(request_id, (TokenDelta(index, (len(text),), 0.0, None, finish, text=text),),
                        finished=finish is not None)


def test_outputs_from_another_thread_arrive_in_order_on_the_loop():
    async def main():
        loop, got, threads = asyncio.get_running_loop(), [], set()

        def deliver(out):
            threads.add(threading.get_ident())
            got.append(out)

        hand = ToLoop(loop, deliver)
        sender = threading.Thread(target=lambda: [hand(_out(i)) for i in range(500)])
        sender.start()
        sender.join()
        for _ in range(200):
            if len(got) == 500:
                break
            await asyncio.sleep(0.005)
        return got, threads

    got, threads = asyncio.run(main())
    assert [out.client_id for out in got] == list(range(500))
    assert threads == {threading.get_ident()}  # asyncio.run's loop runs on this thread


def test_one_failing_delivery_does_not_drop_the_rest_of_its_burst(caplog):
    async def main():
        got = []

        def deliver(out):
            if out.client_id == 1:
                raise RuntimeError("broken output")
            got.append(out.client_id)

        hand = ToLoop(asyncio.get_running_loop(), deliver)
        for i in range(4):  # one burst: a single flush takes all four
            hand(_out(i))
        await asyncio.sleep(0.05)
        return got

    assert asyncio.run(main()) == [0, 2, 3]
    assert "broken output" in caplog.text


def test_a_result_fed_on_its_consumers_loop_wakes_the_consumer():
    async def main():
        result = _result(7)
        consumer = asyncio.ensure_future(pieces([result]).__anext__())
        await asyncio.sleep(0)  # the consumer now waits on the result
        result.put(_step(7, "hi"))  # put on the same loop, as the owner does
        return await asyncio.wait_for(consumer, 2)

    piece = asyncio.run(main())
    assert (piece.prompt, piece.index, piece.text, piece.finish_reason) == (0, 0, "hi", None)


def test_a_result_fed_from_another_thread_wakes_the_consumer():
    async def main():
        result = _result(8)
        consumer = asyncio.ensure_future(pieces([result]).__anext__())
        await asyncio.sleep(0)
        threading.Thread(target=result.put, args=(_step(8, "yo"),)).start()
        return await asyncio.wait_for(consumer, 2)

    assert asyncio.run(main()).text == "yo"


def _collect(results, feed):
    async def main():
        async def consume():
            return [p async for p in pieces(results)]

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)
        for result, delta in feed:
            result.put(delta)
            await asyncio.sleep(0)
        return await asyncio.wait_for(task, 2)

    return asyncio.run(main())


def test_one_result_streams_each_step_and_its_end_once():
    r = _result(1)
    got = _collect([r], [(r, _step(1, "a")), (r, _step(1, "b")), (r, _step(1, "", "stop"))])
    assert [(p.text, p.finish_reason) for p in got] == [("a", None), ("b", None), ("", "stop")]


def test_several_results_stream_in_arrival_order_with_their_prompt_index():
    a, b = _result(1), _result(2)
    got = _collect([a, b], [(b, _step(2, "b1")), (a, _step(1, "a1")), (a, _step(1, "a2", "length")),
                            (b, _step(2, "b2", "stop"))])
    assert [(p.prompt, p.text, p.finish_reason) for p in got] == [
        (1, "b1", None), (0, "a1", None), (0, "a2", "length"), (1, "b2", "stop")]


@pytest.mark.parametrize("count", [1, 2])
def test_a_failed_result_raises_to_the_stream(count):
    results = [_result(i) for i in range(count)]
    failed = RequestDelta(0, (), finished=True, error="the decode worker was lost")
    with pytest.raises(RequestError, match="decode worker was lost"):
        _collect(results, [(results[0], failed)])


def _queued_then_streamed(result, deltas):
    """Every delta queued before the stream reads any: a consumer behind the engine."""
    async def main():
        got = []
        for d in deltas:
            result.put(d)
        try:
            async for p in pieces([result]):
                got.append(p)
        except RequestError as exc:
            got.append(exc)
        return got

    return asyncio.run(main())


def test_steps_queued_behind_a_busy_consumer_stream_as_one_piece():
    r = _result(3)
    got = _queued_then_streamed(r, [_step(3, "a"), _step(3, "b"), _step(3, "c", "length")])
    assert [(p.text, p.token_ids, p.finish_reason) for p in got] == [("abc", [1, 1, 1], "length")]


def test_a_failure_queued_behind_steps_comes_after_their_text():
    r = _result(4)
    failed = RequestDelta(4, (), finished=True, error="the decode worker was lost")
    got = _queued_then_streamed(r, [_step(4, "a"), _step(4, "b"), failed, _step(4, "late")])
    assert [p.text for p in got[:-1]] == ["ab"]
    assert isinstance(got[-1], RequestError) and "decode worker was lost" in str(got[-1])
