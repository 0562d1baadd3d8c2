"""`serve run configs/serve.yaml`, the file as it is, in a real Ray of its own: the OpenAI API through the real
`openai` client, the Grafana dashboard's series in its /metrics, an in-place rescale with `serve deploy`, and Ctrl-C
stopping everything it started."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from ray.util import state

from raypd.tools.tiny import build_tiny_llava
from raypd import LLM, SamplingParams
from tests.cluster.procs import processes_in, wait_healthy

REPO = pathlib.Path(__file__).resolve().parents[3]
SERVE_CONFIG = REPO / "configs" / "serve.yaml"
DASHBOARD = REPO / "configs" / "grafana" / "raypd-dashboard.json"
START_TIMEOUT_S = 240.0  # a fresh Ray, its dashboard and four replicas, on a shared 2-core host
DASHBOARD_API = "http://127.0.0.1:8265"  # Ray's default dashboard port: what `serve deploy` talks to


def _bin(name: str) -> str:
    return shutil.which(name, path=os.path.dirname(sys.executable)) or name


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0



def _stop(proc: subprocess.Popen, workdir: pathlib.Path, timeout: float = 60.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends to serve run's process group
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _ctrl_c_as_in_a_terminal() -> None:
    """In the child before exec: SIGINT stops it as Ctrl-C does in a terminal. A shell that starts pytest in the
    background (`pytest &` in a script) leaves SIGINT ignored, an ignored signal stays ignored across exec, and
    Python then installs no KeyboardInterrupt handler: serve run never saw the Ctrl-C and was killed 60 s later."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def served(own_serve, tmp_path_factory):
    """`serve run configs/serve.yaml` from a directory laid out as the repo root after `make serve`."""
    work = tmp_path_factory.mktemp("serve-config").resolve()
    (work / "configs").mkdir()
    for name in ("serve.yaml", "local.yaml"):
        shutil.copy(REPO / "configs" / name, work / "configs" / name)
    build_tiny_llava(work / "models" / "tiny-llava")  # what `make serve` builds; the name clients ask for
    port = yaml.safe_load(SERVE_CONFIG.read_text())["http_options"]["port"]
    for busy in (port, 8265):
        assert _port_free(busy), f"port {busy} is in use: configs/serve.yaml's endpoint and Ray's dashboard need it"
    # RAY_ADDRESS=local: a Ray of its own even while the session's test cluster runs.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "local",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = open(work / "serve-run.log", "wb")
    proc = subprocess.Popen([_bin("serve"), "run", "configs/serve.yaml"], cwd=work, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_ctrl_c_as_in_a_terminal)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, work / "serve-run.log", START_TIMEOUT_S)
        _wait_serving(base, START_TIMEOUT_S)
        yield {"base": base, "proc": proc, "work": work, "env": env}
    finally:
        _stop(proc, work)
        for pid in processes_in(work):  # anything serve run failed to stop: the test below reports it
            os.kill(pid, signal.SIGKILL)



def _wait_serving(base: str, timeout: float) -> None:
    """/health answers 200 before the engine replicas have registered (a role never seen is not missing), and
    Serve may still be initializing them: a request then fails after 4 calls nobody took. Wait for one to work."""
    deadline = time.monotonic() + timeout
    while True:
        got = httpx.post(f"{base}/v1/completions", timeout=60,
                         json={"model": "tiny-llava", "prompt": "ready?", "max_tokens": 1})
        if got.status_code == 200:
            return
        assert time.monotonic() < deadline, f"no completion served in {timeout} s: {got.status_code} {got.text}"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served['base']}/v1", api_key="unused", timeout=60, max_retries=0)


def test_serves_the_openai_api(served, client):
    assert [m.id for m in client.models.list().data] == ["tiny-llava"]
    got = client.completions.create(model="tiny-llava", prompt="The quick brown", max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    with LLM(str(served["work"] / "models" / "tiny-llava")) as reference:  # greedy: the same tokens in any engine
        ref = reference.generate("The quick brown", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert got.choices[0].text == ref.outputs[0].text and got.usage.completion_tokens == 10
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=8, temperature=0)
    parts = client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=8, temperature=0,
                                           stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == whole.choices[0].message.content


# ---- the Grafana dashboard ----
def _queries(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_dashboard_is_importable_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "raypd"
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    for p in dashboard["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and p["targets"], p["title"]
        assert all(t["datasource"] == p["datasource"] and t["expr"] for t in p["targets"]), p["title"]


def test_every_series_the_dashboard_queries_is_in_metrics(served, client):
    """A role's series come from the replica directory as the ingress last read it: a scrape can miss a role whose
    replica was not seen live at that read (its heartbeat late on a loaded host), so a few periods are allowed."""
    client.completions.create(model="tiny-llava", prompt="metrics", max_tokens=4)
    deadline = time.monotonic() + 15.0
    while (missing := _missing_series(served["base"])) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert missing == [], f"queried by the dashboard, absent from /metrics: {missing}"


def _missing_series(base: str) -> list[str]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    samples = [(s.name, s.labels) for family in text_string_to_metric_families(text) for s in family.samples]
    missing = []
    for expr in _queries(json.loads(DASHBOARD.read_text())):
        grouped = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")}
        grouped -= {"le"}  # a histogram's bucket label
        for name, matchers in re.findall(r"(raypd_\w+)(\{[^}]*\})?", expr):
            wanted = dict(re.findall(r'(\w+)="([^"]*)"', matchers))
            if not any(n == name and wanted.items() <= labels.items() and grouped <= labels.keys()
                       for n, labels in samples):
                missing.append(f"{name}{matchers} (by {sorted(grouped)})")
    return missing


# ---- rescale and stop ----
def _replicas() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for actor in state.list_actors(DASHBOARD_API, filters=[("state", "=", "ALIVE")], timeout=30):
        if actor.class_name.startswith("ServeReplica:raypd:"):
            out.setdefault(actor.class_name.rsplit(":", 1)[1], set()).add(actor.actor_id)
    return out


def test_serve_deploy_rescales_decode_in_place(served, client):
    before = _replicas()
    assert {role: len(ids) for role, ids in before.items()} == {"encoder": 1, "prefill": 1, "decode": 1, "ingress": 1}
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    config["applications"][0]["deployments"] = [{"name": "decode", "num_replicas": 2}]
    (served["work"] / "rescaled.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in served["env"].items() if k != "RAY_ADDRESS"}
    subprocess.run([_bin("serve"), "deploy", "rescaled.yaml", "--address", DASHBOARD_API], cwd=served["work"],
                   env=env, check=True, capture_output=True, timeout=120)
    deadline = time.monotonic() + START_TIMEOUT_S
    while len((after := _replicas()).get("decode", ())) < 2:
        assert time.monotonic() < deadline, f"decode did not reach 2 replicas: {after}"
        time.sleep(0.5)
    # Same application code and args: Serve only applies the new count, every replica it had is still there.
    assert all(before[role] <= after[role] for role in before) and after["prefill"] == before["prefill"]
    assert client.completions.create(model="tiny-llava", prompt="after", max_tokens=4).usage.completion_tokens == 4


def test_ctrl_c_stops_everything_serve_run_started(served):
    _stop(served["proc"], served["work"])
    assert served["proc"].returncode == 0
    deadline = time.monotonic() + 30
    while processes_in(served["work"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_in(served["work"]) == []
    assert _port_free(int(served["base"].rsplit(":", 1)[1]))
