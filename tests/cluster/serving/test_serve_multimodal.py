"""configs/local.yaml's deployment (an encoder replica beside prefill and decode) serving a tiny LLaVA, through the real
`openai` client: images in chat messages give the embedded engine's text; bad images are a 400 naming the content part
and reach no engine. Prefill and decode each run two tensor-parallel ranks here (rank 1 an actor in the replica's
placement group): a decode rank killed mid-stream takes its replica along, Serve replaces the group, the streams end
with the same tokens, and no rank process outlives the deployment."""

from __future__ import annotations

import base64
import io
import os
import pathlib
import signal
import struct
import threading
import time
import zlib

import httpx
import numpy as np
import openai
import pytest
import ray
import yaml
from PIL import Image
from ray import serve

from cluster.serving.app import build_from_config
from cluster.config import parse_config
from cluster.serving.directory import Directory
from raypd import LLM, SamplingParams
from tests.cluster.conftest import delete_apps
from tests.cluster.procs import processes_titled, thread_nices
from tests.cluster.serving.test_faults import _wait
from tests.engine.images import random_images

KEY = "sk-raypd-mm"
APP = "raypd-mm"
REPO = pathlib.Path(__file__).resolve().parents[3]
MAX_IMAGE_BYTES = 64 * 1024


def _config(model: str, port: int):
    """configs/local.yaml with the test's model, port, key and smaller pools, in float32: token-exact against the
    embedded LLM (one rank). Prefill and decode are split over two ranks each: the encoder's embeddings reach both
    prefill ranks, and each decode rank reads its heads from the prefill rank that holds them."""
    raw = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    raw.update(model=model, served_model_name="tiny-llava", dtype="float32")
    raw.update(http={"host": "127.0.0.1", "port": port, "api_key": KEY})
    raw["engine"].update(block_size=4, kv_cache_bytes="32MiB")
    raw["multimodal"].update(max_image_bytes=MAX_IMAGE_BYTES, encoder_cache_bytes="4MiB")
    raw["prefill"].update(tensor_parallel_size=2, resources={"prefill": 0.25})
    raw["decode"].update(tensor_parallel_size=2, resources={"decode": 0.25})
    # One request at a time here: the idle rule would serve each whole on decode; the prefill replica splicing the
    # encoder's embeddings is what this file checks (colocated mode below covers the whole path).
    raw["router"].update(local_prefill_when_idle=False)
    return parse_config(raw)


@pytest.fixture(scope="module")
def llava(llava_factory):
    return str(llava_factory())


@pytest.fixture(scope="module")
def server(serve_port, postprocs, llava):
    port = serve_port
    config = _config(llava, port)
    assert config.has_vision_tower and config.encoder.replicas == 1
    postprocs.serving(llava)
    serve.run(build_from_config(config), name=APP, route_prefix="/")
    assert "encoder" in serve.status().applications[APP].deployments
    yield f"http://127.0.0.1:{port}", port
    delete_apps(*serve.status().applications)
    _wait(lambda: not _rank_processes(), 60, "rank processes outlived the deployment")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def embedded(llava):
    with LLM(llava, block_size=4) as llm:
        yield llm


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _reference(embedded: LLM, messages: list[dict], images: list, params: SamplingParams) -> str:
    """The embedded engine on the prompt the ingress renders (the chat template, an image part as {"type": "image"})."""
    tok = embedded.tokenizer
    parts = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
              [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]} for m in messages]
    text = tok.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    return embedded.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, params).outputs[0].text


def test_an_image_in_a_chat_message_gives_the_embedded_engines_text(client, embedded):
    a, b = random_images(2, seed=60)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in "}, image_part(data_url(png(a))),
                                             {"type": "text", "text": " this picture?"}]}]
    got = client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert got.choices[0].message.content == _reference(embedded, messages, [a], params)
    assert got.usage.prompt_tokens > 16  # the image's 16 placeholder tokens count as prompt
    assert len(_rank_actors("prefill")) == 1 and len(_rank_actors("decode")) == 1  # each replica: two ranks
    two = [{"role": "user", "content": [image_part(data_url(png(a))), image_part(data_url(png(b), "image/png")),
                                        {"type": "text", "text": "which came first?"}]}]
    stream = client.chat.completions.create(model="tiny-llava", messages=two, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == _reference(embedded, two, [a, b], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))


def test_text_only_requests_keep_working(client, embedded):
    messages = [{"role": "user", "content": "no picture today"}]
    got = client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == _reference(embedded, messages, [], SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))
    done = client.completions.create(model="tiny-llava", prompt="plain words", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    ref = embedded.generate("plain words", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert done.choices[0].text == ref.outputs[0].text
    tool = {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="tools: the chat template .* does not render tools"):
        client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=2, tools=[tool])


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height and holds no pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def _encoder_and_prefill_counters() -> tuple[float, float]:
    directory = Directory(APP)
    return (directory.totals("encoder").get("images_encoded", 0.0),
            directory.totals("prefill").get("prefix_cache_query_tokens", 0.0))


def _bad_cases(tmp: pathlib.Path) -> list[tuple[list, str, str]]:
    """(content parts, the part the 400 must name, what it must say)."""
    good = png(random_images(1, seed=61)[0])
    noise = Image.fromarray(np.random.RandomState(62).randint(0, 256, (200, 200, 3), dtype=np.uint8))  # ~120 KB PNG
    (tmp / "local.png").write_bytes(good)
    return [
        ([image_part(data_url(b"not an image at all"))], "messages[0].content[0]", "not a decodable image"),
        ([{"type": "text", "text": "look: "}, image_part(data_url(good[: len(good) // 2]))], "messages[0].content[1]",
         "truncated"),
        ([image_part(data_url(_png_header(30000, 30000)))], "messages[0].content[0]", "decompression bomb"),
        ([image_part(data_url(_png_header(5000, 5000)))], "messages[0].content[0]", "pixels is over the limit"),
        ([image_part(data_url(png(noise)))], "messages[0].content[0]", "bytes is over the limit"),
        ([image_part("data:text/plain;base64,aGVsbG8=")], "messages[0].content[0]", "media type"),
        ([image_part("https://example.com/cat.png")], "messages[0].content[0]", "allow_remote_urls"),
        ([image_part(f"file://{tmp / 'local.png'}")], "messages[0].content[0]", "allowed_local_media_path"),
        ([{"type": "text", "text": "<image> and "}, image_part(data_url(good))], "messages", "placeholder"),
        ([{"type": "text", "text": "an <image> with no image"}], "messages", "no image was sent"),
        ([image_part(data_url(good))] * 17, "messages[0].content[16]", "max_images_per_request"),
    ]


def test_bad_images_are_a_400_naming_the_part_and_reach_no_engine(server, tmp_path):
    time.sleep(2.5)  # the directory's counters are refreshed every second: let the earlier tests' settle
    before = _encoder_and_prefill_counters()
    assert before[0] >= 2 and before[1] > 0  # the earlier tests' images and prompts did reach them
    auth = {"Authorization": f"Bearer {KEY}"}
    for parts, param, what in _bad_cases(tmp_path):
        body = {"model": "tiny-llava", "messages": [{"role": "user", "content": parts}], "max_tokens": 4}
        r = httpx.post(f"{server[0]}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 400, (what, r.status_code, r.text)
        error = r.json()["error"]
        assert error["param"] == param and what in error["message"], (what, error)
    r = httpx.post(f"{server[0]}/v1/chat/completions", headers=auth, timeout=60, json={
        "model": "tiny-llava", "messages": [{"role": "user", "content": [{"type": "input_audio", "x": 1}]}]})
    assert r.status_code == 400 and "messages.0.content" in r.json()["error"]["message"]
    time.sleep(2.5)
    assert _encoder_and_prefill_counters() == before
    assert httpx.get(f"{server[0]}/health", timeout=30).status_code == 200


def _rank_actors(role: str) -> dict[str, int]:
    """name -> pid of the rank actors (ranks 1..N-1) of the role's replicas in this application."""
    found = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"raypd-rank::SERVE_REPLICA::{APP}#{role}#")]
    return {a["name"]: ray.get(ray.get_actor(a["name"], namespace=a["namespace"]).pid.remote(), timeout=30)
            for a in found}


def _rank_processes() -> list[int]:
    return processes_titled("RankActor")


def test_the_decode_replica_and_its_rank_run_at_decodes_nice(server):
    # configs/local.yaml's decode.nice: every thread of the decode replica and of its second rank runs that many levels
    # below the prefill replica and its rank (the engine's own threads start after the replica set it), at most 19
    nice = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())["decode"]["nice"]
    [prefill], [decode] = (processes_titled(f"ServeReplica:{APP}:{role}") for role in ("prefill", "decode"))
    [base] = thread_nices(prefill)
    assert nice and thread_nices(decode) == {min(19, base + nice)}
    ranks = sorted(n for pid in _rank_processes() for n in thread_nices(pid))
    assert ranks == [base, min(19, base + nice)], ranks


def test_a_killed_decode_rank_takes_its_replica_and_loses_no_stream(server, client, embedded):
    """SIGKILL of decode rank 1 while six streams (one with an image) run: the replica exits, the streams resume
    elsewhere with the text they would have had, and Serve starts a new group of two ranks."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [f"rank fault {i}: one two three four" for i in range(5)]
    image = random_images(1, seed=64)[0]
    chat = [{"role": "user", "content": [image_part(data_url(png(image))), {"type": "text", "text": "and then"}]}]
    want = [r.outputs[0].text for r in embedded.generate(prompts, params, use_tqdm=False)]
    want.append(_reference(embedded, chat, [image], params))
    texts, chunks, errors = [""] * 6, [0] * 6, []

    def one(i: int) -> None:
        kwargs = dict(model="tiny-llava", max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True})
        try:
            if i < 5:
                for c in client.completions.create(prompt=prompts[i], **kwargs):
                    texts[i] += c.choices[0].text
                    chunks[i] += 1
            else:
                for c in client.chat.completions.create(messages=chat, **kwargs):
                    texts[i] += (c.choices[0].delta.content or "") if c.choices else ""
                    chunks[i] += 1
        except Exception as exc:  # collected: the test asserts there are none
            errors.append(repr(exc))

    (name, pid), = _rank_actors("decode").items()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    _wait(lambda: min(chunks) >= 3, 60, "the streams did not start")
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert not errors and texts == want, (errors, texts)
    _wait(lambda: httpx.get(f"{server[0]}/health", timeout=5).status_code == 200 and _rank_actors("decode")
          and name not in _rank_actors("decode"), 120, "the decode group was not replaced")


def test_colocated_mode_takes_images_too(server, client, llava):
    config = _config(llava, server[1])
    config = config.model_copy(update={"mode": "colocated", "decode": config.decode.model_copy(
        update={"tensor_parallel_size": 1})})
    serve.run(build_from_config(config), name=f"{APP}-colocated", route_prefix="/colocated")
    try:
        colocated = openai.OpenAI(base_url=f"{server[0]}/colocated/v1", api_key=KEY, timeout=60, max_retries=0)
        messages = [{"role": "user", "content": [image_part(data_url(png(random_images(1, seed=63)[0]))),
                                                 {"type": "text", "text": "side by side"}]}]
        kwargs = dict(model="tiny-llava", messages=messages, max_tokens=8, temperature=0,
                      extra_body={"ignore_eos": True})
        assert colocated.chat.completions.create(**kwargs).choices[0].message.content == \
            client.chat.completions.create(**kwargs).choices[0].message.content
        assert "prefill" not in serve.status().applications[f"{APP}-colocated"].deployments
    finally:
        serve.delete(f"{APP}-colocated", _blocking=False)  # the next tests need not wait for it
