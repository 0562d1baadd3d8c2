"""A real two-node Ray cluster on this host: the head carries the `prefill` resource, the second node `decode`."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
import ray

# Token auth is on by default in this Ray; the CLI and the driver must agree, so the test cluster runs without it.
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}
# HTTP through HAProxy to the ingress replicas, as `raypd serve` runs it (cluster/serving/haproxy.py).
for name, value in (("RAY_SERVE_ENABLE_HA_PROXY", "1"), ("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")):
    os.environ.setdefault(name, value)
    ENV.setdefault(name, value)


def _ray(*args: str) -> None:
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable))
    subprocess.run([ray_cli, *args], env=ENV, check=True, timeout=120, capture_output=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    port = _free_port()
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--object-store-memory=100000000",
              "--disable-usage-stats"]
    _ray("start", "--head", f"--port={port}", "--include-dashboard=false", '--resources={"prefill": 1}', *common)
    try:
        _ray("start", f"--address=127.0.0.1:{port}", '--resources={"decode": 1}', *common)
        ray.init(address=f"127.0.0.1:{port}", _node_ip_address="127.0.0.1", log_to_driver=False)
        yield f"127.0.0.1:{port}"
    finally:
        ray.shutdown()
        subprocess.run([shutil.which("ray", path=os.path.dirname(sys.executable)), "stop", "--force"], env=ENV,
                       timeout=60, capture_output=True)


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
