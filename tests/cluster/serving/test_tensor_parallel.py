"""Tensor-parallel replicas on real Serve: prefill and decode each a placement group of two bundles, rank 1 an actor
in the second, KV over NIXL between ranks of both sides; the real openai client against a colocated engine of one
rank. A decode rank killed mid-stream takes its replica with it: Serve replaces the group, the streams resume
elsewhere with the same tokens, and no rank process is left behind."""

from __future__ import annotations

import os
import pathlib
import signal

import httpx
import openai
import pytest
import ray
from ray import serve

from cluster.config import parse_config
from cluster.serving.app import POSTPROC_NAMESPACE, deploy
from raypd import LLM, SamplingParams
from tests.cluster.conftest import FAULT_SUMMARY
from tests.cluster.serving import test_faults
from tests.cluster.serving.test_faults import Streams, _free_port, _wait

APP = "raypd-tp"
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_llama):
    port = _free_port()
    role = {"replicas": 1, "num_cpus": 0}
    config = parse_config({
        "model": tiny_llama, "served_model_name": "tiny", "dtype": "float32",
        "engine": {"block_size": 4, "num_threads": 1, "kv_cache_bytes": "16MiB"},
        "prefill": {**role, "tensor_parallel_size": 2, "resources": {"prefill": 0.25}},
        "decode": {**role, "tensor_parallel_size": 2, "resources": {"decode": 0.25}},
        "postproc": role, "ingress": role, "http": {"host": "127.0.0.1", "port": port},
    })
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy(config, APP)
    base = f"http://127.0.0.1:{port}"
    _wait(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 120, "the deployment is not healthy")
    yield base
    _delete()


_deleted = []


def _delete() -> None:
    if _deleted:
        return
    _deleted.append(True)
    for app in (APP, f"{APP}-health"):
        serve.delete(app)
    serve.shutdown()
    try:
        ray.kill(ray.get_actor("raypd-postproc-0", namespace=POSTPROC_NAMESPACE))
    except ValueError:  # already gone
        pass


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    with LLM(tiny_llama, block_size=4, dtype="float32") as llm:
        yield llm


def _rank_actors(role: str) -> dict[str, int]:
    """name -> pid of the rank actors of the role's replicas."""
    found = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("raypd-rank::") and f"#{role}#" in a["name"]]
    return {a["name"]: ray.get(ray.get_actor(a["name"], namespace=a["namespace"]).pid.remote(), timeout=30)
            for a in found}


def _kv_stat(server: str, what: str) -> float:
    lines = httpx.get(f"{server}/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines
               if line.startswith("raypd_kv{") and 'role="decode"' in line and f'what="{what}"' in line)


def test_tensor_parallel_replicas_serve_colocated_tokens(server, client, reference):
    """Both roles run rank 1 in an actor of their placement group; every decode rank reads its heads from the
    prefill rank that holds them, and the answers are those of one colocated rank."""
    assert len(_rank_actors("prefill")) == 1 and len(_rank_actors("decode")) == 1
    prompts = [f"tensor parallel {i}: the quick brown fox jumps" for i in range(4)]
    want = [r.outputs[0].text for r in reference.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)]
    got = [client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert got == want
    _wait(lambda: _kv_stat(server, "kv_bytes_read") > 0 and _kv_stat(server, "tp_all_reduce_calls") > 0, 30,
          "the decode replica reported no KV read or no all-reduce")


def test_a_killed_decode_rank_takes_its_replica_and_loses_no_stream(server, client, reference, monkeypatch):
    monkeypatch.setattr(test_faults, "MAX_TOKENS", MAX_TOKENS)
    prompts = [f"rank fault {i}: one two three four" for i in range(6)]
    want = [r.outputs[0].text for r in reference.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)]
    (name, pid), = _rank_actors("decode").items()
    streams = Streams(client, prompts)
    streams.wait_midstream()
    os.kill(pid, signal.SIGKILL)
    streams.join()
    lost = streams.lost(want)
    FAULT_SUMMARY.append(("SIGKILL rank 1 of the TP2 decode replica", f"{len(prompts)} streams x {MAX_TOKENS} tok",
                          f"{len(prompts) - lost} completed exactly", lost))
    assert not streams.errors and lost == 0, (streams.errors, streams.texts)
    _wait(lambda: httpx.get(f"{server}/health", timeout=5).status_code == 200 and _rank_actors("decode")
          and name not in _rank_actors("decode"), 120, "the decode group was not replaced")


def _rank_processes() -> list[int]:
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"RankActor" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:  # ended meanwhile
            continue
    return found


def test_no_rank_process_outlives_the_deployment(server):
    assert _rank_processes()
    _delete()
    _wait(lambda: not _rank_processes(), 60, "rank processes are left after the deployment was deleted")
