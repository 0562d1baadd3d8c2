"""The Serve application through the real `openai` client: completions, chat, streaming, errors, metrics, rescale."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import httpx
import jsonschema
import openai
import pytest
import torch
from ray import serve
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.serving.app import build_from_config, cluster_key
from cluster.config import parse_config
from cluster.edge.chat_template import ChatTemplate
from cluster.edge.openai_protocol import ChatCompletionRequest
from cluster.serving.directory import Directory
from cluster.serving.ray_env import haproxy_threads
from engine.kv.kv_handle import KVHandle
from llmapi.disaggregated_params import DisaggregatedParams
from protocol import Submit
from raypd import LLM, GuidedDecodingParams, SamplingParams
from tests.cluster.procs import processes_running
from tests.teach import teach

KEY = "sk-raypd-test"


def _config(model: str, port: int, decode_replicas: int = 1, prefill_replicas: int = 1):
    role = {"replicas": 1, "num_cpus": 0}
    return parse_config({
        "model": model, "served_model_name": "tiny", "dtype": "float32",  # token-exact against the embedded LLM
        # a lease outlasts every redeploy here (the prefill rescale reads KV leased before it)
        "engine": {"block_size": 4, "num_threads": 1, "kv_cache_bytes": "64MiB", "kv_lease_s": 60},
        "prefill": {**role, "replicas": prefill_replicas}, "decode": {**role, "replicas": decode_replicas},
        "postproc": {**role, "replicas": 2},
        "ingress": role,
        "http": {"host": "127.0.0.1", "port": port, "api_key": KEY},
    })


@pytest.fixture(scope="module")
def server(serve_port, postprocs, tiny_llama):
    """The module's applications are deleted by serve_port when it ends."""
    postprocs.serving(tiny_llama)
    serve.run(build_from_config(_config(tiny_llama, serve_port)), name="raypd", route_prefix="/")
    return f"http://127.0.0.1:{serve_port}", serve_port


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    with LLM(tiny_llama, block_size=4) as llm:
        yield llm


def test_decode_met_the_prefill_replica_before_any_request(server):
    # the first test to run: no request has been sent yet
    deadline = time.monotonic() + 10
    while 'raypd_kv{role="decode",what="peers_met"} 1.0' not in httpx.get(f"{server[0]}/metrics", timeout=30).text:
        assert time.monotonic() < deadline, "the decode replica has not met the prefill replica"
        time.sleep(0.2)


def test_completion_matches_the_embedded_engine(client, reference):
    got = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    ref = reference.generate("The quick brown", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert got.choices[0].text == ref.outputs[0].text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, client):
    prompt = " ".join(f"word{i}" for i in range(40))  # well over a few 4-token blocks
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 4
    assert again.choices[0].text == first.choices[0].text
    deadline = time.monotonic() + 10  # the directory refreshes each role's stats every second
    while True:
        metrics = _kv_metrics(httpx.get(f"{server[0]}/metrics", timeout=30).text)
        if metrics.get(("prefill", "prefix_cache_hit_tokens"), 0) >= again.usage.prompt_tokens_details.cached_tokens:
            break
        assert time.monotonic() < deadline, f"prefill's prefix-cache counters did not show the hit: {metrics}"
        time.sleep(0.2)
    assert metrics[("prefill", "prefix_cache_query_tokens")] >= 2 * first.usage.prompt_tokens


def _kv_metrics(text: str) -> dict[tuple[str, str], float]:
    found = {}
    for line in text.splitlines():
        if line.startswith("raypd_kv{"):
            labels, value = line[len("raypd_kv{"):].split("} ")
            parts = dict(p.split("=") for p in labels.split(","))
            found[(parts["role"].strip('"'), parts["what"].strip('"'))] = float(value)
    return found


def test_streamed_completion_with_usage(client):
    stream = client.completions.create(model="tiny", prompt="Stream", max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = client.completions.create(model="tiny", prompt="Stream", max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello 你好"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, seed=1)
    assert whole.choices[0].message.role == "assistant"
    parts = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, seed=1,
                                           stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == whole.choices[0].message.content


def test_n_logprobs_stop_and_seed(client):
    got = client.completions.create(model="tiny", prompt="Once", max_tokens=8, temperature=1.0, n=2, seed=3,
                                    logprobs=2, extra_body={"ignore_eos": True})
    assert len(got.choices) == 2 and [c.index for c in got.choices] == [0, 1]
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 8 and all(len(t) == 2 for t in lp.top_logprobs)
    again = client.completions.create(model="tiny", prompt="Once", max_tokens=8, temperature=1.0, n=2, seed=3,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in got.choices]
    free = got.choices[0].text
    stop = free[3:6]
    cut = client.completions.create(model="tiny", prompt="Once", max_tokens=8, temperature=1.0, seed=3, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_bad_requests_get_clear_4xx_and_the_server_stays_healthy(server, client):
    base = server[0]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{base}/v1/completions", content=b"{not json", headers=auth, timeout=30)
    assert r.status_code == 400 and "error" in r.json()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="tiny", prompt=[5] * 2000, max_tokens=100)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=7)
    with pytest.raises(openai.BadRequestError, match="prompt: must not be empty"):
        client.completions.create(model="tiny", prompt=[[5, 6], []], max_tokens=2)  # a batch of token id lists
    with pytest.raises(openai.BadRequestError, match="out of range"):
        client.completions.create(model="tiny", prompt=[[5, 6], [10**9]], max_tokens=2)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: .* is text-only"):
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "see"}, image]}])
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    assert client.completions.create(model="tiny", prompt="still here", max_tokens=2).choices


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                          "rank": {"type": "integer", "minimum": 1, "maximum": 50},
                                          "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
          "required": ["city", "rank", "tags"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}


def test_json_schema_chat_streaming_and_not_always_validates(client):
    """Disaggregated: the prefill replica samples each first token under the grammar, decode continues its matcher."""
    messages = [{"role": "user", "content": "a place, as JSON"}]
    for seed in range(3):
        kwargs = dict(model="tiny", messages=messages, temperature=1.0, seed=seed, max_completion_tokens=120,
                      response_format=JSON_SCHEMA, user="someone")
        whole = client.chat.completions.create(n=2, **kwargs)
        for choice in whole.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        parts = client.chat.completions.create(stream=True, **kwargs)
        text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text == whole.choices[0].message.content  # same seed, candidate 0: same tokens


def test_json_object_completion_and_max_completion_tokens(client, reference):
    # The random tiny model mostly wanders inside a JSON string until max_tokens: take a seed whose draw closes the
    # object on the embedded engine, then the edge must give the same complete object.
    seed = _json_object_seed(reference, SamplingParams(max_tokens=200, temperature=0.7,
                                                       guided_decoding=GuidedDecodingParams(json_object=True)))
    got = client.completions.create(model="tiny", prompt="{", max_tokens=200, temperature=0.7, seed=seed,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert got.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(got.choices[0].text), dict)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=50,
                                          max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"


def _json_object_seed(reference, params: SamplingParams) -> int:
    """The first seed in 1..63 whose draw closes the object alone on the embedded engine. Seeds are tried 16 at a
    time in one batch (one at a time, each that wanders to max_tokens took ~0.7 s: the search took ~8 s); a seed
    that stopped in the batch is confirmed alone, as the edge will run it."""
    for first in range(1, 64, 16):
        seeds = range(first, min(first + 16, 64))
        batch = reference.generate(["{"] * len(seeds), [dataclasses.replace(params, seed=s) for s in seeds],
                                   use_tqdm=False)
        for seed, got in zip(seeds, batch):
            if got.outputs[0].finish_reason == "stop" and reference.generate(
                    "{", dataclasses.replace(params, seed=seed)).outputs[0].finish_reason == "stop":
                return seed
    raise AssertionError("no seed in 1..63 closes the JSON object")


def test_penalties_min_p_and_logit_bias_at_the_edge_equal_the_embedded_engine(client, reference):
    edge = dict(presence_penalty=0.7, frequency_penalty=0.4, logit_bias={"300": 4.0, "301": -100})
    extra = dict(repetition_penalty=1.3, min_p=0.05, ignore_eos=True)
    got = client.completions.create(model="tiny", prompt="again and again", max_tokens=16, temperature=0.8, seed=5,
                                    n=2, extra_body=extra, **edge)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=5, n=2, presence_penalty=0.7, frequency_penalty=0.4,
                            logit_bias={300: 4.0, 301: -100}, **extra)
    ref = reference.generate("again and again", params)
    assert [c.text for c in got.choices] == [o.text for o in ref.outputs]
    plain = reference.generate("again and again", SamplingParams(max_tokens=16, temperature=0.8, seed=5, n=2,
                                                                  ignore_eos=True))
    assert [o.text for o in ref.outputs] != [o.text for o in plain.outputs]
    forced = client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0, logit_bias={"300": 100},
                                       extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 4 and forced.choices[0].text == reference.tokenizer.decode([300] * 4)


def test_echo_prepends_the_prompt_with_its_logprobs(client, reference):
    prompt = "Echo this back"
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == prompt + plain.choices[0].text
    with_lp = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                        logprobs=1, extra_body={"ignore_eos": True})
    lp = with_lp.choices[0].logprobs
    num_prompt = with_lp.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 5 and "".join(lp.tokens[:num_prompt]) == prompt
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    ref = reference.generate(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=1))
    ids = ref.prompt_token_ids
    expected = [ref.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    assert lp.token_logprobs[1:num_prompt] == pytest.approx(expected, abs=1e-4)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == got.choices[0].text


@pytest.mark.parametrize("kwargs, field", [
    (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                  "schema": {"type": "nope"}}}}),
     "response_format"),
    (dict(extra_body={"response_format": {"type": "json_schema"}}), "response_format"),
    (dict(logit_bias={"abc": 1}), "logit_bias"),
    (dict(logit_bias={"5": 250}), "logit_bias"),
    (dict(logit_bias={"99999999": 1}), "logit_bias"),
    (dict(presence_penalty=5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"min_p": 2}), "min_p"),
])
def test_invalid_sampling_values_get_a_400_naming_the_field(client, kwargs, field):
    with pytest.raises(openai.BadRequestError, match=field):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, **kwargs)


def test_models_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    client.completions.create(model="tiny", prompt="metrics", max_tokens=4)
    text = httpx.get(f"{server[0]}/metrics", timeout=30).text
    assert "raypd_ttft_seconds_count" in text and 'raypd_requests_total{finish_reason="length"}' in text
    assert 'raypd_kv{role="decode",what="kv_blocks_total"}' in text


def test_haproxy_runs_the_threads_sized_for_this_host(server, client):
    # HTTP reached the ingress through HAProxy (Serve's direct ingress), whose worker threads haproxy_threads sets
    client.completions.create(model="tiny", prompt="threads", max_tokens=2)
    haproxies = processes_running("haproxy")
    assert haproxies, "no HAProxy process serves the test cluster"
    threads = {len(os.listdir(f"/proc/{pid}/task")) for pid in haproxies}
    assert threads == {haproxy_threads(len(os.sched_getaffinity(0)))}


def test_live_rescale_of_decode_under_streaming_load(server, client, tiny_llama):
    failures, done = [], []

    def stream_one(i: int) -> None:
        try:
            chunks = list(client.completions.create(model="tiny", prompt=f"load {i}", max_tokens=40, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            done.append(len(text) > 0 and chunks[-1].choices[0].finish_reason == "length")
        except Exception as exc:  # collected: the test asserts there are none
            failures.append(repr(exc))

    threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    serve.run(build_from_config(_config(tiny_llama, server[1], decode_replicas=2, prefill_replicas=2)),
              name="raypd", route_prefix="/")
    for t in threads:
        t.join(timeout=120)
    assert not failures and all(done) and len(done) == 6
    for role in ("prefill", "decode"):
        assert serve.status().applications["raypd"].deployments[role].replica_states.get("RUNNING") == 2
    # every live decode replica has met every live prefill replica, before any transfer needed it
    directory = Directory("raypd")
    deadline = time.monotonic() + 15
    while True:
        prefill = {e.card.name for e in directory.entries("prefill")}
        decode = directory.entries("decode")
        if len(prefill) == 2 and len(decode) == 2 and all(prefill <= set(e.peers) for e in decode):
            break
        assert time.monotonic() < deadline, f"decode replicas did not meet the prefill replicas: {prefill} {decode}"
        time.sleep(0.3)


def test_a_rescale_of_prefill_to_one_under_load_reprefills_nothing(server, client, tiny_llama, reference):
    """Both prefill replicas hold KV nobody has read yet when a redeploy with one prefill replica stops them while
    prompts arrive (an in-process redeploy replaces every replica; a YAML rescale would stop one). A stopping replica
    leaves the directory, then waits until its leases are read (replicas.drain): the KV is read from it afterwards, by
    an engine of our own, with no re-prefill and the same tokens. Serve's own drain waits only for calls in flight:
    without ours, the replica would be gone about 2 s after its last call."""
    config = _config(tiny_llama, server[1], decode_replicas=2, prefill_replicas=1)
    directory = Directory("raypd")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    held = _lease_on_every_prefill_replica(directory, reference, params)
    old = {e.card.name for e in directory.entries("prefill")}
    failures, done = [], []

    def one(i: int) -> None:
        try:
            got = client.completions.create(model="tiny", prompt=f"scale down {i}: " + "one two three " * 25,
                                            max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
            done.append(got.choices[0].finish_reason == "length")
        except Exception as exc:  # collected: the test asserts there are none
            failures.append(repr(exc))

    rescale = threading.Thread(target=serve.run, args=(build_from_config(config),),
                               kwargs=dict(name="raypd", route_prefix="/"))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads[:8] + [rescale] + threads[8:]:
        t.start()
        time.sleep(0.05)
    by_replica: dict[str, list] = {}
    for ids, ctx in held:
        by_replica.setdefault(KVHandle.open(ctx.handoff.opaque_state, cluster_key()).agent, []).append((ids, ctx))
    assert set(by_replica) == old
    with LLM(tiny_llama, engine_config=config.engine_config(cluster_key(), "decode"), kv_transfer="nixl") as reader:
        deadline = time.monotonic() + 90
        while by_replica:  # Serve stops the old replicas one after the other
            listed = {e.card.name for e in directory.entries("prefill")}
            for name in [n for n in by_replica if n not in listed]:  # it left: it drains now
                time.sleep(3.0)  # past Serve's own drain loop
                for ids, ctx in by_replica.pop(name):
                    got = reader.generate(ids, params, disaggregated_params=ctx.handoff.generation_params())
                    assert got.outputs[0].token_ids == reference.generate(ids, params).outputs[0].token_ids
            assert time.monotonic() < deadline, f"Serve did not stop the prefill replicas {sorted(by_replica)}"
            time.sleep(0.2)
        assert reader.loop.call(lambda e: e.stats())["num_reprefills"] == 0
    for t in threads + [rescale]:
        t.join(timeout=120)
    assert not failures and all(done) and len(done) == 16, failures
    assert serve.status().applications["raypd"].deployments["prefill"].replica_states.get("RUNNING") == 1


def _lease_on_every_prefill_replica(directory: Directory, reference, params) -> list:
    """Context-only requests sent straight to the prefill replicas, a few at once (the router spreads what is in
    flight), until each replica holds a lease nobody has read: their (prompt ids, final response) pairs."""
    prefill = serve.get_deployment_handle("prefill", "raypd").options(stream=True)
    held, leases = [], []
    for round_ in range(4):
        prompts = [reference.tokenizer.encode(f"leased {round_} {i}: " + "four five six " * 8) for i in range(6)]
        calls = [prefill.serve.remote(Submit(9000 + 10 * round_ + i, ids, params, DisaggregatedParams("context_only")))
                 for i, ids in enumerate(prompts)]
        held += [(ids, list(call)[-1]) for ids, call in zip(prompts, calls)]
        deadline = time.monotonic() + 3.0  # stats reach the directory every period
        while time.monotonic() < deadline:
            leases = [e.stats.get("kv_leases", 0) for e in directory.entries("prefill")]
            if len(leases) == 2 and all(leases):
                return held
            time.sleep(0.3)
    pytest.fail(f"the prefill replicas never both held a lease: {leases}")


def test_a_request_that_ends_at_prefill_frees_the_prefill_blocks_at_once(client):
    got = client.completions.create(model="tiny", prompt="just one", max_tokens=1, temperature=0)
    assert got.choices[0].finish_reason == "length"
    prefill = serve.get_deployment_handle("prefill", app_name="raypd")
    deadline = time.monotonic() + 5.0  # the lease would hold them for 60 s
    while True:
        free, total = prefill.kv_blocks.remote().result(timeout_s=30)
        if free == total:
            break
        assert time.monotonic() < deadline, f"prefill still holds {total - free} blocks"
        time.sleep(0.05)


def test_colocated_mode_serves_the_same_tokens(server, client, tiny_llama):
    config = _config(tiny_llama, server[1]).model_copy(update={"mode": "colocated"})
    serve.run(build_from_config(config), name="raypd-colocated", route_prefix="/colocated")
    try:
        colocated = openai.OpenAI(base_url=f"{server[0]}/colocated/v1", api_key=KEY, timeout=60, max_retries=0)
        kwargs = dict(model="tiny", prompt="side by side", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
        assert colocated.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text
        chat = dict(model="tiny", messages=[{"role": "user", "content": "JSON"}], temperature=1.0, seed=2,
                    max_tokens=120, response_format=JSON_SCHEMA, presence_penalty=0.5)
        text = colocated.chat.completions.create(**chat).choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text == client.chat.completions.create(**chat).choices[0].message.content
        assert "prefill" not in serve.status().applications["raypd-colocated"].deployments
    finally:
        serve.delete("raypd-colocated", _blocking=False)  # the next tests need not wait for it


# ---- tool calling and evaluation harnesses' requests ----

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TAUGHT_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n'
                '</tool_call>')


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(stream) -> tuple[str, list[tuple[str, dict]], str]:
    """(content, calls, finish reason) a client accumulating the deltas by tool call index ends with."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for c in choice.delta.tool_calls or []:
                call = calls.setdefault(c.index, {"id": c.id, "name": "", "arguments": ""})
                call["name"] += (c.function.name or "") if c.function else ""
                call["arguments"] += (c.function.arguments or "") if c.function else ""
            finish = choice.finish_reason or finish
    assert all(c["id"] for c in calls.values())  # each call's first delta carries its id
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], finish


def _forced_calls_validate(client, model: str) -> None:
    """tool_choice required and a named function: calls whose arguments validate, the same streamed and not."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel in (("required", False), ("required", True), (named, True)):
        kwargs = dict(model=model, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice, temperature=1.0,
                      seed=4, max_completion_tokens=160, parallel_tool_calls=parallel)
        whole = client.chat.completions.create(**kwargs)
        got = whole.choices[0]
        calls = _calls(got.message)
        assert got.finish_reason == "tool_calls" and calls, (choice, got)
        assert len(calls) == 1 or parallel
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
        assert choice == "required" or [name for name, _ in calls] == ["get_weather"]
        assert _streamed(client.chat.completions.create(stream=True, **kwargs)) == (
            got.message.content or "", calls, "tool_calls")


def test_tool_choice_required_and_named_give_calls_that_validate(client):
    """Disaggregated: the prefill replica samples the first token under the call grammar, decode the rest."""
    _forced_calls_validate(client, "tiny")
    with pytest.raises(openai.BadRequestError, match="tools.0.function.parameters"):
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}])
    with pytest.raises(openai.BadRequestError, match="tool_choice: function 'nope' is not among the tools"):
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    # a conversation that carries a call and its result renders and is served
    turns = ASK + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = client.chat.completions.create(model="tiny", messages=turns, tools=[WEATHER], tool_choice="none",
                                           max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.tool_calls is None


@pytest.fixture(scope="module")
def tool_caller(tiny_llama, tmp_path_factory):
    """tiny_llama taught to answer ASK (with WEATHER and CLOCK offered) by calling get_weather in Hermes format."""
    body = ChatCompletionRequest(model="x", messages=ASK, tools=[WEATHER, CLOCK])
    prompt = ChatTemplate(AutoTokenizer.from_pretrained(tiny_llama)).render(
        [m.template_message(images=False) for m in body.messages], body.tool_plan().template_tools())
    return teach(tiny_llama, tmp_path_factory.mktemp("tool-caller"), prompt, TAUGHT_REPLY)


def test_auto_tool_choice_parses_the_models_calls_colocated(server, tool_caller):
    config = _config(tool_caller, server[1]).model_copy(update={"mode": "colocated"})
    serve.run(build_from_config(config), name="raypd-tools", route_prefix="/tools")
    try:
        tools = openai.OpenAI(base_url=f"{server[0]}/tools/v1", api_key=KEY, timeout=60, max_retries=0)
        kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], temperature=0, max_tokens=150)
        got = tools.chat.completions.create(**kwargs).choices[0]  # tool_choice "auto": the default with tools
        expected = [("get_weather", {"city": "Paris", "days": 1})]
        assert (got.message.content, _calls(got.message), got.finish_reason) == ("Let me check.\n", expected,
                                                                                 "tool_calls")
        assert _streamed(tools.chat.completions.create(stream=True, **kwargs)) == ("Let me check.\n", expected,
                                                                                   "tool_calls")
        plain = tools.chat.completions.create(tool_choice="none", **kwargs).choices[0]
        assert plain.message.content == TAUGHT_REPLY and plain.message.tool_calls is None
        assert plain.finish_reason == "stop"
        _forced_calls_validate(tools, "tiny")
    finally:
        serve.delete("raypd-tools", _blocking=False)


def test_loglikelihood_requests_as_evaluation_harnesses_send_them(client, reference, tiny_llama):
    """lm-evaluation-harness's local-completions: token id prompts, echo, logprobs 1, max_tokens 0 (or 1, scored
    without its last position); the prompt's logprobs must be the model's (transformers' in fp32)."""
    prompts = [reference.tokenizer.encode(t) for t in ("The cat sat on the mat", "Two plus two is four")]
    got = client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=1,
                                    temperature=0, seed=1234)
    one = client.completions.create(model="tiny", prompt=prompts, max_tokens=1, echo=True, logprobs=1,
                                    temperature=0, seed=1234)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    assert got.usage.completion_tokens == 0 and one.usage.completion_tokens == 2
    for ids, choice, with_one in zip(prompts, got.choices, one.choices):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)  # (T, vocab)
        expected = [logits[i - 1, ids[i]].item() for i in range(1, len(ids))]
        lp = choice.logprobs
        assert choice.text == reference.tokenizer.decode(ids) and choice.finish_reason == "length"
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        assert with_one.logprobs.token_logprobs[:-1] == lp.token_logprobs
        assert len(with_one.logprobs.tokens) == len(ids) + 1
    stream = client.completions.create(model="tiny", prompt="Echo only", max_tokens=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == "Echo only"
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 generates nothing"):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)


def test_deleting_the_app_does_not_wait_for_kv_nobody_will_read(server, tiny_llama):
    """The last test here (it deletes the app): a prefill replica holding a lease when the whole application stops
    stops at once (replicas.drain sees the app deleting), not at the end of the lease (60 s here)."""
    ids = AutoTokenizer.from_pretrained(tiny_llama).encode("held " * 20)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prefill = serve.get_deployment_handle("prefill", "raypd").options(stream=True)
    responses = list(prefill.serve.remote(Submit(77, ids, params, DisaggregatedParams("context_only"))))
    assert responses[-1].handoff is not None  # its KV is leased, and nobody will read it
    directory, deadline = Directory("raypd"), time.monotonic() + 10
    while not directory.totals("prefill").get("kv_leases"):
        assert time.monotonic() < deadline, "the prefill replica's lease never showed in the directory"
        time.sleep(0.2)
    start = time.monotonic()
    serve.delete("raypd")
    assert time.monotonic() - start < 15
