"""A real two-node Ray cluster on this host: the head carries the `prefill` resource, the second node `decode`."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import ray
from ray import serve

from cluster.serving.app import POSTPROC_NAMESPACE, POSTPROC_PREFIX
from cluster.serving.ray_env import serve_env

# Token auth is off for the CLI and the driver alike: tests/conftest.py sets it for every Ray of the session.
# Serve's pace and HTTP through HAProxy to the ingress replicas, as `raypd serve` runs it (cluster/serving/ray_env.py).
SERVE_ENV = serve_env(len(os.sched_getaffinity(0))) | {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
for name, value in SERVE_ENV.items():
    os.environ.setdefault(name, value)


def _ray(*args: str) -> None:
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable))
    subprocess.run([ray_cli, *args], check=True, timeout=120, capture_output=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster(request):
    port = _free_port()
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--object-store-memory=100000000",
              "--disable-usage-stats"]
    _ray("start", "--head", f"--port={port}", "--include-dashboard=false", '--resources={"prefill": 1}', *common)
    try:
        _ray("start", f"--address=127.0.0.1:{port}", '--resources={"decode": 1}', *common)
        ray.init(address=f"127.0.0.1:{port}", _node_ip_address="127.0.0.1", log_to_driver=False)
        yield f"127.0.0.1:{port}"
    finally:
        _shutdown_serve(request.config.stash)  # its HAProxy would outlive `ray stop`, holding its ports
        ray.shutdown()
        subprocess.run([shutil.which("ray", path=os.path.dirname(sys.executable)), "stop", "--force"],
                       timeout=60, capture_output=True)


# The port of the Serve the session's cluster runs, while one runs (see serve_port).
_SERVE_PORT = pytest.StashKey[int]()


@pytest.fixture(scope="module")
def serve_port(request, ray_cluster) -> int:
    """One Serve (controller, proxy, HAProxy) for every module that deploys applications on the session's cluster:
    starting and stopping it in each module cost ~5 s. No application of another module stays deployed while one runs
    (one left behind by a failed teardown is deleted first), and none of its own after it."""
    stash = request.config.stash
    if _SERVE_PORT not in stash:
        port = _free_port()
        # One proxy, on the head: the cluster's two nodes share this host, so a second node's HAProxy found its ports
        # taken, and Serve restarted it every ~3 s for the whole session (an actor process and a Serve import each).
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        stash[_SERVE_PORT] = port
    delete_apps(*serve.status().applications)
    yield stash[_SERVE_PORT]
    delete_apps(*serve.status().applications)


@pytest.fixture(scope="module")
def own_serve(request) -> None:
    """For a module that runs a Serve in a Ray of its own: the session's Serve, if one runs, is shut down first. HAProxy
    binds fixed ports (stats 8404, metrics 9101) on every address, and a second one on this host fails to start."""
    _shutdown_serve(request.config.stash)


def _shutdown_serve(stash) -> None:
    if _SERVE_PORT in stash:
        serve.shutdown()
        del stash[_SERVE_PORT]


def delete_apps(*names: str, timeout_s: float = 120.0) -> None:
    """Deletes the applications side by side (one at a time took ~3 s each) and waits until all are gone."""
    for name in names:
        serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while left := set(names) & set(serve.status().applications):
        assert time.monotonic() < deadline, f"Serve did not delete the applications {sorted(left)}"
        time.sleep(0.2)


class Postprocs:
    """The postproc workers are named, detached actors that every build on the cluster shares
    (cluster.serving.app.start_postprocs), each with one model's tokenizer: the modules serving the same model keep
    them (their start cost ~3 s a module), one serving another model has them killed first."""

    def __init__(self):
        self.model: str | None = None

    def serving(self, model: str) -> None:
        """Call before building the module's first application of `model`."""
        if self.model not in (None, model):
            self.kill()
        self.model = model

    def kill(self) -> None:
        names = _postproc_names()
        for name in names:
            ray.kill(ray.get_actor(name, namespace=POSTPROC_NAMESPACE))
        deadline = time.monotonic() + 60  # a name is free again once Ray has marked its actor dead
        while _postproc_names():
            assert time.monotonic() < deadline, f"the postproc workers {names} did not die"
            time.sleep(0.2)
        self.model = None


def _postproc_names() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == POSTPROC_NAMESPACE and a["name"].startswith(POSTPROC_PREFIX)]


@pytest.fixture(scope="session")
def postprocs(ray_cluster) -> Postprocs:
    found = Postprocs()
    found.kill()  # none should be there yet: whatever is, serves an unknown model
    yield found
    found.kill()


# Rows the fault-injection suite adds (tests/cluster/serving/test_faults.py): (what was done, load, outcome, requests lost).
FAULT_SUMMARY: list[tuple[str, str, str, int]] = []


def pytest_terminal_summary(terminalreporter):
    if not FAULT_SUMMARY:
        return
    write = terminalreporter.write_line
    write("")
    write("fault injection (tests/cluster/serving/test_faults.py)")
    write(f"{'fault / input':<46} | {'load held':<24} | {'outcome':<40} | lost")
    for fault, load, outcome, lost in FAULT_SUMMARY:
        write(f"{fault:<46} | {load:<24} | {outcome:<40} | {lost}")
