"""The embedded LLM through its public API: sampling, candidates, stops, timeouts, aborts, streaming."""

from __future__ import annotations

import asyncio
import time

import pytest

from raypd import LLM, RequestOutput, SamplingParams
from tests.pools import wait_pools_full


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, block_size=4) as llm:
        yield llm


@pytest.fixture(autouse=True)
def pool_back_to_full(llm):
    yield
    wait_pools_full(llm)


def test_single_and_batch_generate(llm):
    one = llm.generate("Hello world", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert isinstance(one, RequestOutput) and one.finished
    assert len(one.outputs[0].token_ids) == 5 and one.outputs[0].finish_reason == "length"
    assert one.outputs[0].text == llm.tokenizer.decode(one.outputs[0].token_ids, skip_special_tokens=True)
    many = llm.generate(["a b c", [5, 6, 7, 8]], [SamplingParams(max_tokens=3), SamplingParams(max_tokens=4)], use_tqdm=False)
    assert [len(r.outputs[0].token_ids) for r in many] == [3, 4]
    assert many[1].prompt is None and many[1].prompt_token_ids == [5, 6, 7, 8]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate("The weather today", params).outputs[0].token_ids
    crowd = llm.generate(["The weather today", "noise one", "other noise"] * 2, params, use_tqdm=False)
    assert all(r.outputs[0].token_ids == alone for r in crowd[::3])
    other_seed = SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)
    assert llm.generate("The weather today", other_seed).outputs[0].token_ids != alone


def test_n_candidates_share_the_prompt(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=7, ignore_eos=True)
    out = llm.generate("Once upon a time", params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # candidate k of a seeded request is the same whatever n is: draws depend on (seed, k, position)
    again = llm.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=7, ignore_eos=True))
    assert again.outputs[1].token_ids == out.outputs[1].token_ids
    assert set(out.metrics) == {0, 1, 2} and "prompt_tokens" in out.metrics[0] and "prompt_tokens" not in out.metrics[1]


def test_best_of_returns_the_most_likely(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, n=2, best_of=4, seed=3, ignore_eos=True)
    out = llm.generate("best of", params)
    assert len(out.outputs) == 2
    all_four = llm.generate("best of", SamplingParams(max_tokens=6, temperature=1.0, n=4, seed=3, ignore_eos=True))
    best = sorted(c.cumulative_logprob for c in all_four.outputs)[-2:]
    assert sorted(c.cumulative_logprob for c in out.outputs) == pytest.approx(best)


def test_stop_token_ids_and_max_tokens(llm):
    free = llm.generate("count with me", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)).outputs[0]
    stop_at = free.token_ids[4]
    out = llm.generate("count with me", SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at])).outputs[0]
    first = free.token_ids.index(stop_at)
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)


def test_stop_string_truncates_text(llm):
    free = llm.generate("tell a story", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)).outputs[0]
    stop = free.text[5:8]
    for include in (False, True):
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
        out = llm.generate("tell a story", params).outputs[0]
        cut = free.text.index(stop) + (len(stop) if include else 0)
        assert out.text == free.text[:cut]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert len(out.token_ids) < len(free.token_ids)


def test_streaming_diffs_concatenate_to_final_text(llm):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    result = llm.generate_async("stream me", params, streaming=True)
    texts, tokens, steps = [], [], 0
    for step in result:
        texts.append(step.outputs[0].text_diff)
        tokens.extend(step.outputs[0].token_ids_diff)
        steps += 1
    assert steps > 1
    assert "".join(texts) == result.outputs[0].text
    assert tokens == result.outputs[0].token_ids


def test_async_iteration_and_aresult(llm):
    async def main():
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        streamed = [s.outputs[0].token_ids_diff async for s in llm.generate_async("async", params, streaming=True)]
        done = await llm.generate_async("async", params).aresult(timeout=30)
        return sum(streamed, []), done.outputs[0].token_ids

    streamed, final = asyncio.run(main())
    assert streamed == final


def test_result_timeout_raises_and_engine_keeps_serving(llm):
    long = llm.generate_async("long", SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True))
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        long.result(timeout=0.3)
    assert time.monotonic() - start < 2
    short = llm.generate("short", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert short.finished
    long.abort()
    assert long.aborted()
    long.result(timeout=10)
    assert long.outputs[0].finish_reason == "cancelled"


def test_abort_mid_stream_frees_blocks(llm):
    result = llm.generate_async("abort me", SamplingParams(max_tokens=500, temperature=0, ignore_eos=True), streaming=True)
    next(iter(result))
    result.abort()
    result.result(timeout=10)
    assert result.outputs[0].finish_reason == "cancelled"
    wait_pools_full(llm)


def test_metrics_recorded(llm):
    out = llm.generate("metrics", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    m = out.metrics_dict
    assert m["ttft"] > 0 and m["e2e"] >= m["ttft"] and m["tpot"] > 0
    assert m["prompt_tokens"] == len(out.prompt_token_ids) and m["generation_tokens"] == 5
    assert m["request_queue_time"] >= 0


def test_invalid_input_is_refused_clearly(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="context length"):
        llm.generate_async("x", SamplingParams(max_tokens=5000))
    with pytest.raises(TypeError, match="prompt"):
        llm.generate_async(3.5)
    with pytest.raises(ValueError, match="streamed"):
        llm.generate_async("x", SamplingParams(n=1, best_of=2), streaming=True)
    assert llm.generate("still fine", SamplingParams(max_tokens=2)).finished


def test_gpu_check_runs_its_stages_on_the_cpu(tiny_llama):
    """The GPU check's stages (parity, decode timing, the NIXL read, two ranks) on this CPU: what keeps the script
    from breaking unnoticed between the runs a GPU is lent for."""
    from raypd.tools import gpu_check

    assert gpu_check.main(["--device", "cpu", "--model", tiny_llama]) == 0
