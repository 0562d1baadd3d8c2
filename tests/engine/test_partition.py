"""A network partition between a prefill and a decode engine on simulated nodes: two network namespaces joined by a
veth pair, one engine process in each (tests/engine/netns_peer.py). While the link silently drops every packet the
decode side re-prefills within its transfer deadline and gets the colocated tokens; once healed, hand-offs are read
over NIXL again. Needs root and namespaces; elsewhere the test says why it is skipped."""

from __future__ import annotations

import itertools
import json
import os
import select
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Client
from pathlib import Path

import pytest

from llmapi.disaggregated_params import DisaggregatedParams
from llmapi.sampling_params import SamplingParams
from tests.netns import why_not

pytestmark = pytest.mark.skipif(why_not() is not None, reason=str(why_not()))

REPO = Path(__file__).resolve().parents[2]
PREFIX = "raypd-part-"  # never make cluster-demo's raypd-head/prefill/decode or its bridge
# (namespace, veth end in it, its address): only these addresses are ever sent to
NODES = (("raypd-part-prefill", "raypd-part-p", "10.0.9.1/24"), ("raypd-part-decode", "raypd-part-d", "10.0.9.2/24"))
TRANSFER_TIMEOUT_S = 3.0
LEASE_S = 6.0  # the cut request's lease must end (and free its blocks) before the test does
MARGIN_S = 1.5  # engine steps and the re-prefill itself, on two shared cores
START_TIMEOUT_S = 90.0
CALL_TIMEOUT_S = 30.0
HEAL_S = 3 * TRANSFER_TIMEOUT_S


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=20)


def _remove_stale() -> None:
    """What a killed earlier run left: our namespaces (their veth ends go with them) and root-side links."""
    for name in _ip("netns", "list").stdout.split():
        if name.startswith(PREFIX):
            _ip("netns", "delete", name, check=False)
    for _, link, _ in NODES:
        _ip("link", "delete", link, check=False)


@contextmanager
def two_nodes():
    """Two namespaces joined by a veth pair, addressed in 10.0.9.0/24; removed whatever happens."""
    _remove_stale()
    try:
        (ns_p, link_p, _), (ns_d, link_d, _) = NODES
        _ip("link", "add", link_p, "type", "veth", "peer", "name", link_d)
        for ns, link, addr in NODES:
            _ip("netns", "add", ns)
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", addr, "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        _remove_stale()


def cut(on: bool) -> None:
    """A silent partition: each veth end's egress goes to the blackhole qdisc, so packets vanish both ways (no
    'unreachable' reaches either side, as when a switch between nodes dies); the TCP connections stay open."""
    for ns, link, _ in NODES:
        verb = ("add", "dev", link, "root", "blackhole") if on else ("del", "dev", link, "root")
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", *verb], check=True, capture_output=True,
                       timeout=20)


@dataclass
class Peer:
    """An engine process in a namespace, and the connection the test drives it over."""

    proc: subprocess.Popen
    conn: object
    log: Path

    def call(self, verb: str, *args, timeout: float = CALL_TIMEOUT_S):
        self.conn.send((verb, *args))
        if not self.conn.poll(timeout):
            raise AssertionError(f"{verb}: no answer in {timeout} s; the peer's log:\n{self.log.read_text()[-4000:]}")
        status, value = self.conn.recv()
        assert status == "ok", f"{verb} failed in the peer:\n{value}"
        return value

    def stats(self) -> dict:
        return self.call("stats")


def _peer_env(link: str) -> dict[str, str]:
    """UCX over TCP on the veth only: left alone it picks shared memory between two processes of one host, which
    no network cut stops. Set for the peers only, never in this process."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "UCX_TLS": "tcp", "UCX_NET_DEVICES": link}


@contextmanager
def start_peer(ns: str, link: str, model_dir: str, options: dict, cluster_key: bytes, tmp: Path):
    sock, log, key = tmp / f"{ns}.sock", tmp / f"{ns}.log", os.urandom(16)
    with open(log, "w") as err:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "tests.engine.netns_peer",
                                 str(sock), model_dir, json.dumps(options)], cwd=REPO, env=_peer_env(link),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
    try:
        proc.stdin.write(f"{key.hex()}\n{cluster_key.hex()}\n")
        proc.stdin.close()
        _wait_listening(proc, log)
        with Client(str(sock), "AF_UNIX", authkey=key) as conn:
            peer = Peer(proc, conn, log)
            yield peer
            peer.call("exit")
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()  # `ip netns exec` execs python: this is the engine process itself
            proc.wait(timeout=10)


def _wait_listening(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            if proc.stdout.readline().strip() == "listening":
                return
        assert proc.poll() is None, f"the peer exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
    raise AssertionError(f"the peer did not start in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture
def nodes(tiny_llama, tmp_path):
    """(prefill, decode) peers, each in its namespace, both gone (with the namespaces) at the end."""
    with ExitStack() as stack:
        stack.enter_context(two_nodes())
        common = {"block_size": 4, "kv_transfer_timeout_s": TRANSFER_TIMEOUT_S, "kv_lease_s": LEASE_S}
        key = os.urandom(32)
        yield tuple(stack.enter_context(start_peer(ns, link, tiny_llama, common, key, tmp_path))
                    for ns, link, _ in NODES)


def hand_off(prefill: Peer, decode: Peer, prompt: str, params: SamplingParams) -> tuple[dict, dict]:
    """Prefills on one node, decodes on the other: (the decode side's result, how its counters moved)."""
    ctx = prefill.call("generate", prompt, params, DisaggregatedParams(request_type="context_only"), CALL_TIMEOUT_S)
    dp = ctx["disaggregated_params"]
    dp.request_type = "generation_only"
    before = decode.stats()
    gen = decode.call("generate", prompt, params, dp, CALL_TIMEOUT_S)
    after = decode.stats()
    return gen, {k: after[k] - before[k] for k in ("kv_bytes_read", "num_reprefills")}


def colocated(prefill: Peer, prompt: str, params: SamplingParams) -> list[list[int]]:
    return prefill.call("generate", prompt, params, None, CALL_TIMEOUT_S)["token_ids"]


def _read_again_after_healing(prefill: Peer, decode: Peer) -> None:
    """Hand-offs until one is read over NIXL. The first may still time out (and re-prefill, with the same tokens):
    TCP retransmits what the cut swallowed only when its backed-off timer fires, up to about the cut's length after
    healing, which is the transfer deadline here."""
    deadline = time.monotonic() + HEAL_S
    for i in itertools.count():
        prompt = f"after healing, request {i} of the"
        gen, moved = hand_off(prefill, decode, prompt, GREEDY)
        assert gen["token_ids"] == colocated(prefill, prompt, GREEDY)
        if moved["kv_bytes_read"] > 0:
            assert moved["num_reprefills"] == 0, moved
            return
        assert time.monotonic() < deadline, f"no hand-off read over NIXL in {HEAL_S} s after healing"


GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)


def test_partition_re_prefills_within_the_deadline_and_healing_restores_disaggregation(nodes):
    prefill, decode = nodes
    for i, params in enumerate((GREEDY, SEEDED)):
        prompt = f"before the partition, request {i} of the"
        gen, moved = hand_off(prefill, decode, prompt, params)
        assert gen["token_ids"] == colocated(prefill, prompt, params)
        assert moved["kv_bytes_read"] > 0 and moved["num_reprefills"] == 0, moved

    prompt = "while the link drops every packet, the"
    expected = colocated(prefill, prompt, GREEDY)
    cut(True)
    try:
        gen, moved = hand_off(prefill, decode, prompt, GREEDY)
    finally:
        cut(False)
    assert gen["token_ids"] == expected
    assert moved == {"kv_bytes_read": 0, "num_reprefills": 1}, "the read crossed a cut link: the cut is not real"
    assert gen["seconds"] < TRANSFER_TIMEOUT_S + MARGIN_S, f"the cut request took {gen['seconds']:.2f} s"

    healed = time.monotonic()
    _read_again_after_healing(prefill, decode)
    print(f"cut request: {gen['seconds']:.2f} s (deadline {TRANSFER_TIMEOUT_S} s); NIXL reads again "
          f"{time.monotonic() - healed:.2f} s after healing")
    prompt = "after healing, a seeded request of the"
    gen, moved = hand_off(prefill, decode, prompt, SEEDED)
    assert gen["token_ids"] == colocated(prefill, prompt, SEEDED)
    assert moved["kv_bytes_read"] > 0 and moved["num_reprefills"] == 0, moved

    # The cut request's blocks come back when its lease ends; the read ones when their release arrived.
    prefill.call("pools_full", LEASE_S + 5, timeout=LEASE_S + 15)
    decode.call("pools_full", 5.0)
