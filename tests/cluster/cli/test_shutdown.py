"""`raypd serve` shuts down gracefully: SIGTERM mid-stream stops new requests (503), lets the stream finish, then
stops Serve and its own Ray, exiting 0 with nothing left running. Replica warnings reach its console."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import yaml

from raypd.tools.tiny import build_tiny_llava
from tests.cluster.procs import processes_in, wait_healthy

REPO = pathlib.Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 240.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def test_sigterm_drains_in_flight_streams_then_stops_everything(own_serve, tmp_path):
    work = tmp_path.resolve()
    build_tiny_llava(work / "models" / "tiny-llava")
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    port = _free_port()
    config["http"]["port"] = port
    config["shutdown_grace_s"] = 60
    (work / "raypd.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "local",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log_path = work / "raypd-serve.log"
    raypd = shutil.which("raypd", path=os.path.dirname(sys.executable))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([raypd, "serve", "raypd.yaml"], cwd=work, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log_path, START_TIMEOUT_S, ready_line="raypd: serving")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
        got: dict = {"text": "", "reason": None, "chunks": 0}

        def stream() -> None:
            for chunk in client.completions.create(model="tiny-llava", prompt="drain me", max_tokens=2000,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                got["chunks"] += 1
                got["text"] += chunk.choices[0].text
                got["reason"] = chunk.choices[0].finish_reason or got["reason"]

        streaming = threading.Thread(target=stream)
        streaming.start()
        while got["chunks"] < 5:
            assert streaming.is_alive(), "the stream ended before SIGTERM"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        # Every ingress replica sees the drain within a watch period or two (they look every second, more slowly
        # on a loaded machine); from then on new requests get 503 while the stream goes on.
        deadline = time.monotonic() + 10.0
        while True:
            refused = httpx.post(f"{base}/v1/completions", timeout=30,
                                 json={"model": "tiny-llava", "prompt": "late", "max_tokens": 2})
            if refused.status_code != 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        stream_alive_at_refusal = streaming.is_alive()
        assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
        # /health (cluster.serving.health, from what the ingress publishes each second) says so too
        deadline = time.monotonic() + 10.0
        while (health := httpx.get(f"{base}/health", timeout=30)).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"], health.text
        assert health.headers.get("retry-after"), health.headers
        assert stream_alive_at_refusal, "the stream ended before the drain began: nothing shows it was waited for"
        streaming.join(120)
        assert got["reason"] == "length" and got["chunks"] >= 1500, got  # it finished, whole
        assert proc.wait(90) == 0
        out = log_path.read_text()
        assert "raypd: stopped" in out and "Traceback" not in out, out[-3000:]
        deadline = time.monotonic() + 2.0  # its children exit moments after it
        while processes_in(work) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not processes_in(work), "processes left running after raypd serve exited"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in processes_in(work):
            os.kill(pid, signal.SIGKILL)
