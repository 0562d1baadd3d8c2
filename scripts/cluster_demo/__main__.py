"""`ray up` for real on this machine: `make cluster-demo` (root; python scripts/cluster_demo).

Three nodes (scripts/cluster_demo/nodes.py: head 10.0.0.10, prefill 10.0.0.11, decode 10.0.0.21), then the steps of
configs/cluster/README.md as a user runs them from a laptop: `ray up` with configs/cluster/local.yaml (files.py says
what differs), the serve config deployed with `ray exec ... raypd serve --address auto --detach`, a completion through
the head's port 8000, each role's replicas checked on their own nodes, decode rescaled from 1 to 2 by redeploying,
`ray down`. Everything it made is removed at the end, on failure and on Ctrl-C or SIGTERM too. Exit code 0: all ok.
"""

from __future__ import annotations

import argparse
import os
import re
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
from ray.util import state

import files
import nodes

API_KEY = "raypd-demo-key"
HEAD_API = f"http://{files.HEAD.ip}:8265"  # the head's dashboard: Ray's state API
ENDPOINT = f"http://{files.HEAD.ip}:8000"
JOIN_TIMEOUT_S = 300.0
DEPLOY_TIMEOUT_S = 300.0
RAY_CLI_TIMEOUT_S = 600.0


class Laptop:
    """Where `ray up` runs (this machine's network, like a laptop on the nodes' LAN). Each ray command runs in PID and
    mount namespaces of its own with one private /tmp: the ssh connections it leaves open end with it, and Ray's
    local state (/tmp/ray/cluster-*.state, /tmp/ray_ssh_*) stays out of this machine's /tmp."""

    def __init__(self, fleet: nodes.Fleet):
        self.dir = fleet.work / "laptop"
        (self.dir / "tmp").mkdir(parents=True)
        self.cluster = files.write_yaml(self.dir / "cluster.yaml",
                                        files.cluster_file(fleet.key, pathlib.Path(sys.prefix)))
        self.ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

    def ray_cli(self, *args: str, timeout: float = RAY_CLI_TIMEOUT_S) -> str:
        cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--propagation", "private", "sh", "-c",
               'mount --bind "$0" /tmp && exec "$@"', str(self.dir / "tmp"), self.ray, *args]
        print(f"$ ray {' '.join(args)}", flush=True)
        start = time.monotonic()
        proc = nodes.start(cmd, cwd=files.REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            raise TimeoutError(f"ray {args[0]} took over {timeout:.0f} s:\n{out[-4000:]}") from None
        if proc.returncode != 0:
            raise RuntimeError(f"ray {args[0]} failed (exit {proc.returncode}):\n{out[-6000:]}")
        print(f"  ({time.monotonic() - start:.1f} s)", flush=True)
        return out

    def exec_on_head(self, command: str) -> str:
        return self.ray_cli("exec", str(self.cluster), command)

    def status_with_roles(self) -> str | None:
        """`ray status` on the head, once it lists both role resources (it lags the nodes' joining by seconds)."""
        out = self.exec_on_head("ray status")
        return out if " prefill" in out and " decode" in out else None

    def deploy(self, decode_replicas: int, validate: bool = False) -> str:
        """configs/cluster/README.md steps 3 and 5: send the serve config to the head, deploy it from there (after
        `raypd validate`, in the same `ray exec`: each ray command costs seconds of its own). Returns the output."""
        local = files.write_yaml(self.dir / "serve.yaml", files.serve_config(decode_replicas))
        self.ray_cli("rsync-up", str(self.cluster), str(local), f"~/raypd/{files.SERVE_CONFIG}")
        check = f"raypd validate {files.SERVE_CONFIG} && " if validate else ""
        return self.exec_on_head(f"cd ~/raypd && export RAYPD_API_KEY={API_KEY} && {check}"
                                 f"raypd serve {files.SERVE_CONFIG} --address auto --detach")


# ---- checks ----
def wait_for(what: str, timeout: float, probe):
    """Calls probe() until it returns something truthy; raises TimeoutError naming `what` and the last problem."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            got = probe()
            if got:
                return got
        except Exception as exc:  # the cluster is still coming up: keep the reason for the error
            last = exc
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s (last: {last!r})")


def node_ips() -> dict[str, str]:
    return {n.node_id: n.node_ip for n in state.list_nodes(HEAD_API, filters=[("state", "=", "ALIVE")], timeout=10)}


def nodes_joined() -> bool:
    """All three nodes alive, the prefill resource on the prefill node's address, decode on the decode node's."""
    alive = state.list_nodes(HEAD_API, filters=[("state", "=", "ALIVE")], detail=True, timeout=10)
    roles = {n.node_ip: {r for r in ("prefill", "decode") if r in n.resources_total} for n in alive}
    return roles == {files.HEAD.ip: set(), files.PREFILL.ip: {"prefill"}, files.DECODE.ip: {"decode"}}


def replicas() -> dict[str, list[tuple[str, str]]]:
    """deployment -> [(actor id, node address)] of its live Serve replicas."""
    ips = node_ips()
    out: dict[str, list[tuple[str, str]]] = {}
    for actor in state.list_actors(HEAD_API, filters=[("state", "=", "ALIVE")], limit=1000, timeout=10):
        if actor.class_name.startswith("ServeReplica:raypd:"):
            out.setdefault(actor.class_name.rsplit(":", 1)[1], []).append((actor.actor_id, ips.get(actor.node_id)))
    return out


def check_placement(decode_replicas: int) -> dict[str, list[tuple[str, str]]]:
    def placed():
        got = replicas()
        return got if len(got.get("decode", ())) == decode_replicas and got.get("prefill") else None

    got = wait_for(f"{decode_replicas} decode replica(s) alive", DEPLOY_TIMEOUT_S, placed)
    for role, node in (("prefill", files.PREFILL), ("decode", files.DECODE)):
        where = sorted({ip for _, ip in got[role]})
        assert where == [node.ip], f"{role} replicas run on {where}, not on the {node.name} node ({node.ip})"
    print(f"placement: " + ", ".join(f"{role} x{len(r)} on {sorted({ip for _, ip in r})}" for role, r in
                                     sorted(got.items())), flush=True)
    return got


def check_completion(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny-llama", prompt="Hello from the laptop", max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True})
    stream = client.completions.create(model="tiny-llama", prompt="Hello from the laptop", max_tokens=16,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert whole.usage.completion_tokens == 16 and streamed == whole.choices[0].text, (whole, streamed)
    print(f"completion through {ENDPOINT}: {whole.choices[0].text!r}", flush=True)


def kv_bytes_read() -> float:
    text = httpx.get(f"{ENDPOINT}/metrics", timeout=30).text
    line = next(line for line in text.splitlines() if line.startswith('raypd_kv{role="decode",what="kv_bytes_read"}'))
    return float(line.split()[-1])


def leftovers(fleet: nodes.Fleet) -> dict[str, list[str]]:
    """Processes still running on each node besides its sshd (and the namespace's own launcher)."""
    keep = ("sshd:", "/usr/sbin/sshd", "unshare ")
    return {n.name: [p for p in fleet.processes(n) if not p.startswith(keep)] for n in nodes.NODES}


# ---- the demo ----
def demo(fleet: nodes.Fleet, step) -> None:
    laptop = Laptop(fleet)
    with step("ray up (head, then the head's autoscaler starts both workers)"):
        laptop.ray_cli("up", str(laptop.cluster), "-y", "--no-config-cache")
        wait_for("both workers joined with their role resources", JOIN_TIMEOUT_S, nodes_joined)
    with step("ray exec: ray status, raypd validate, raypd serve --detach"):
        status = wait_for("`ray status` lists the prefill and decode resources", 60, laptop.status_with_roles)
        print("\n".join(line for line in status.splitlines() if re.search(r"\d (CPU|prefill|decode)\s*$", line)))
        out = laptop.deploy(decode_replicas=1, validate=True)
        print(out.split(f"{files.SERVE_CONFIG}: ok")[-1].split("Shared connection")[0].strip(), flush=True)
    client = openai.OpenAI(base_url=f"{ENDPOINT}/v1", api_key=API_KEY, timeout=60, max_retries=0)
    with step("completion through the head's port; prefill and decode on their own nodes"):
        wait_for("/health answers 200", DEPLOY_TIMEOUT_S,
                 lambda: httpx.get(f"{ENDPOINT}/health", timeout=10).status_code == 200)
        check_completion(client)
        before = check_placement(decode_replicas=1)
        # /metrics sums each role's stats from the replica directory, refreshed every second
        moved = wait_for("the decode replica read KV from the prefill node", 15, kv_bytes_read)
        print(f"KV read by decode over NIXL from the prefill node: {moved:.0f} bytes", flush=True)
    with step("rescale decode 1 -> 2: edit, rsync-up, raypd serve again"):
        laptop.deploy(decode_replicas=2)
        after = check_placement(decode_replicas=2)
        check_completion(client)
        old = {a for r in before.values() for a, _ in r}
        kept = sum(a in old for r in after.values() for a, _ in r)
        # Not an error: `raypd serve` redeploys through serve.run, to which Serve gives a new code version each time,
        # so it replaces every replica in turn (configs/cluster/README.md says how to rescale in place instead).
        print(f"the rescale kept {kept} of the {len(old)} replicas it found; Serve replaced the others one at a time")
    with step("ray down, and `ray stop` on each worker (the local provider's ray down stops the head only)"):
        with ThreadPoolExecutor(3) as pool:
            down = pool.submit(laptop.ray_cli, "down", str(laptop.cluster), "-y")
            # The workers are stopped once the head has no Ray left (its autoscaler would restart a worker it saw
            # go), not once `ray down` returns: after its `ray stop` on the head it sleeps 5 s before it looks
            # whether the head is gone.
            wait_for("the head without Ray processes", RAY_CLI_TIMEOUT_S,
                     lambda: down.done() or not leftovers(fleet)[files.HEAD.name])
            # --force: the head is gone, so nothing is left to drain; a graceful `ray stop` sat out most of its 16 s
            # grace period (raylet and its agents outlived SIGTERM by over 5 s on both workers, 12 s per stop)
            list(pool.map(lambda node: fleet.ssh(node, "source ~/.bashrc && ray stop --force", timeout=120),
                          (files.PREFILL, files.DECODE)))  # both workers at once
            down.result()
        try:
            wait_for("every node without Ray processes", 60, lambda: not any(leftovers(fleet).values()))
        except TimeoutError:
            raise AssertionError(f"Ray processes left running: {leftovers(fleet)}") from None


class Steps:
    """Times each step; on failure, prints the head's autoscaler and Serve logs."""

    def __init__(self, fleet: nodes.Fleet):
        self.fleet, self.times = fleet, []

    def __call__(self, name: str):
        return _Step(self, name)

    def logs(self) -> None:
        logs = self.fleet.node_dir(files.HEAD) / "tmp" / "ray" / "session_latest" / "logs"
        for pattern in ("monitor.log", "monitor.out", "serve/controller_*.log"):
            for path in sorted(logs.glob(pattern))[-1:]:
                print(f"---- {path.name} (last lines)\n{path.read_text(errors='replace')[-3000:]}", flush=True)


class _Step:
    def __init__(self, steps: Steps, name: str):
        self.steps, self.name = steps, name

    def __enter__(self):
        print(f"\n== {self.name}", flush=True)
        self.start = time.monotonic()

    def __exit__(self, kind, exc, tb):
        took = time.monotonic() - self.start
        self.steps.times.append((self.name, took))
        print(f"== {'ok' if kind is None else 'FAILED'} in {took:.1f} s: {self.name}", flush=True)
        if kind is not None and not issubclass(kind, KeyboardInterrupt):
            self.steps.logs()


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through every `finally`: the fleet is removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--clean", action="store_true", help="only remove what a killed run left, then exit")
    parser.add_argument("--nodes-only", action="store_true",
                        help="start the three nodes and wait (Ctrl-C removes them): `ray up` them by hand")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    nodes.ensure_tools()
    for thing in nodes.clean_stale():
        print(f"removed, left by an earlier run: {thing}", flush=True)
    if args.clean:
        return 0
    started = time.monotonic()
    with nodes.Fleet() as fleet:
        print(f"nodes up: " + ", ".join(f"{n.name} {n.ip}" for n in nodes.NODES) + f" (work dir {fleet.work})",
              flush=True)
        if args.nodes_only:
            laptop = Laptop(fleet)
            print(f"ssh -i {fleet.key} root@{files.HEAD.ip}; cluster file {laptop.cluster}; Ctrl-C ends", flush=True)
            signal.pause()
        steps = Steps(fleet)
        demo(fleet, steps)
    print(f"\ncluster demo passed in {time.monotonic() - started:.0f} s; removed the nodes, bridge, sshd, keys and "
          f"{fleet.work}", flush=True)
    for name, took in steps.times:
        print(f"  {took:6.1f} s  {name}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the nodes are already gone: the `with` above removed them
        print("cluster demo: interrupted; removed what it had made", file=sys.stderr)
        sys.exit(130)
