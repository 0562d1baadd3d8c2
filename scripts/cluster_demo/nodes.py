"""Three "machines" inside this one: network namespaces on a private bridge, each running its own sshd.

Each node is a network namespace (its own IP on bridge raypd-br0) plus its own PID and mount namespaces, in which:
- /tmp and the home directory are the node's own (bind mounts), at the same paths on every node, as on real machines:
  `ray up` syncs the repo into each node's ~/raypd, and Ray's session files and `ray stop` see only that node;
- sshd runs as the namespace's first process with a host key and an authorized key generated for this run.
Stopping a node kills that first process, and the kernel then kills everything started in the node. Every process
started here also dies with the process that started it (PR_SET_PDEATHSIG), so even a demo killed with SIGKILL leaves
no process behind; `clean_stale()` removes the namespaces, bridge and work folders such a run leaves.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time

BRIDGE = "raypd-br0"
BRIDGE_IP = "10.0.0.1"
PREFIX_LEN = 24
WORK_PREFIX = "raypd-cluster-demo-"
WORK_PARENT = pathlib.Path("/var/tmp")  # not /tmp: each node mounts its own /tmp over it
SSH_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class Node:
    name: str  # head, prefill, decode
    ip: str

    @property
    def netns(self) -> str:
        return f"raypd-{self.name}"

    @property
    def veth(self) -> str:
        return f"raypd-v-{self.name}"  # at most 15 characters, the kernel's limit


# The addresses of configs/cluster/local.yaml's head, first prefill and first decode machine, so its per-IP role rule
# (worker_start_ray_commands) applies to these nodes unchanged.
NODES = (Node("head", "10.0.0.10"), Node("prefill", "10.0.0.11"), Node("decode", "10.0.0.21"))


def run(*cmd: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {out.returncode}): {out.stderr.strip()}")
    return out


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the demo's process ends, however it ends."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def start(cmd: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(cmd, preexec_fn=_die_with_parent, start_new_session=True, **kwargs)


# ---- what the host needs ----
def ensure_tools() -> None:
    """Root, iproute2 and unshare are required; sshd, ssh-keygen and rsync are installed with apt-get if missing."""
    if os.geteuid() != 0:
        raise SystemExit("cluster demo: needs root (network namespaces, a bridge, sshd)")
    missing = [tool for tool in ("ip", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"cluster demo: missing {', '.join(missing)} (iproute2, util-linux)")
    wanted = {"/usr/sbin/sshd": "openssh-server", "ssh-keygen": "openssh-client", "ssh": "openssh-client",
              "rsync": "rsync"}
    packages = sorted({pkg for tool, pkg in wanted.items() if shutil.which(tool) is None})
    if not packages:
        return
    if shutil.which("apt-get") is None:
        raise SystemExit(f"cluster demo: install {' '.join(packages)}")
    print(f"cluster demo: installing {' '.join(packages)} with apt-get", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:  # a fresh machine has no package lists
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True, capture_output=True, timeout=600)
        subprocess.run(install, env=env, check=True, capture_output=True, timeout=600)


def clean_stale() -> list[str]:
    """Removes what an earlier run that was killed outright left: namespaces, the bridge, work folders."""
    removed = []
    existing = run("ip", "netns", "list", check=False).stdout.split()
    for node in NODES:
        if node.netns in existing:
            for pid in run("ip", "netns", "pids", node.netns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            run("ip", "netns", "delete", node.netns, check=False)
            removed.append(f"netns {node.netns}")
    for link in [BRIDGE] + [node.veth for node in NODES]:
        if run("ip", "link", "show", link, check=False).returncode == 0:
            run("ip", "link", "delete", link, check=False)
            removed.append(f"link {link}")
    for path in WORK_PARENT.glob(f"{WORK_PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def _check_subnet_free() -> None:
    routes = run("ip", "-4", "route", "show", f"{BRIDGE_IP}/{PREFIX_LEN}", check=False).stdout.strip()
    if routes:
        raise SystemExit(f"cluster demo: {BRIDGE_IP}/{PREFIX_LEN} is already routed on this machine ({routes}); "
                         "the demo's nodes need that subnet")


class Fleet:
    """The bridge, the nodes and their sshd, an SSH key that logs in to each; `close()` removes all of it."""

    def __init__(self):
        self.work = pathlib.Path(tempfile.mkdtemp(prefix=WORK_PREFIX, dir=WORK_PARENT))
        self.home = self.work / "home"  # the mount point of every node's own home
        self.key = self.work / "id_ed25519"
        self._procs: dict[str, subprocess.Popen] = {}
        self._bridge = False
        self._netns: list[str] = []

    def __enter__(self) -> Fleet:
        try:
            _check_subnet_free()
            self._make_files()
            self._make_bridge()
            for node in NODES:
                self._make_node(node)
            for node in NODES:
                self._wait_ssh(node)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- set-up ----
    def _make_files(self) -> None:
        self.home.mkdir()
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "raypd-cluster-demo", "-f", str(self.key))
        (self.work / "authorized_keys").write_text(self.key.with_suffix(".pub").read_text())
        # root's home is the node's own folder, at one path on every node (configs name ~/raypd/models/...)
        passwd = pathlib.Path("/etc/passwd").read_text().splitlines()
        root = passwd[[line.split(":")[0] for line in passwd].index("root")].split(":")
        root[5] = str(self.home)
        (self.work / "passwd").write_text("\n".join([":".join(root)] + [p for p in passwd if not
                                                                         p.startswith("root:")]) + "\n")

    def _make_bridge(self) -> None:
        self._bridge = True
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "add", f"{BRIDGE_IP}/{PREFIX_LEN}", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")

    def node_dir(self, node: Node) -> pathlib.Path:
        return self.work / "nodes" / node.name

    def _make_node(self, node: Node) -> None:
        d = self.node_dir(node)
        for sub in ("home", "tmp", "etc"):
            (d / sub).mkdir(parents=True)
        (d / "tmp").chmod(0o1777)
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "etc" / "host_key"))
        (d / "etc" / "sshd_config").write_text(self._sshd_config(node))
        self._netns.append(node.netns)
        run("ip", "netns", "add", node.netns)
        run("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
        run("ip", "link", "set", node.veth, "master", BRIDGE, "up")
        run("ip", "-n", node.netns, "addr", "add", f"{node.ip}/{PREFIX_LEN}", "dev", "eth0")
        run("ip", "-n", node.netns, "link", "set", "eth0", "up")
        run("ip", "-n", node.netns, "link", "set", "lo", "up")
        # A default route, so Ray finds the node's address the way it does on a real machine (the address that
        # would reach the internet); the host forwards nothing, so nothing leaves the bridge.
        run("ip", "-n", node.netns, "route", "add", "default", "via", BRIDGE_IP)
        mounts = (f"mount -t tmpfs -o mode=755 tmpfs /run && mkdir /run/sshd && "
                  f"mount --bind {d / 'tmp'} /tmp && mount --bind {d / 'home'} {self.home} && "
                  f"mount --bind {self.work / 'passwd'} /etc/passwd && "
                  f"exec /usr/sbin/sshd -D -e -f {d / 'etc' / 'sshd_config'}")
        log = open(d / "sshd.log", "wb")
        self._procs[node.name] = start(
            ["ip", "netns", "exec", node.netns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
             "--propagation", "private", "sh", "-c", mounts], stdout=log, stderr=subprocess.STDOUT)

    def _sshd_config(self, node: Node) -> str:
        d = self.node_dir(node)
        return "\n".join([
            f"ListenAddress {node.ip}", "Port 22", f"HostKey {d / 'etc' / 'host_key'}", "PidFile none",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", f"AuthorizedKeysFile {self.work / 'authorized_keys'}",
            "AllowTcpForwarding yes", "PrintMotd no", "Subsystem sftp internal-sftp", ""])

    def _wait_ssh(self, node: Node) -> None:
        deadline = time.monotonic() + SSH_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._procs[node.name].poll() is not None:
                log = (self.node_dir(node) / "sshd.log").read_text(errors="replace")
                raise RuntimeError(f"sshd of node {node.name} exited: {log[-2000:]}")
            try:
                with socket.create_connection((node.ip, 22), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"sshd of node {node.name} ({node.ip}) did not listen within {SSH_TIMEOUT_S:.0f} s")

    def ssh(self, node: Node, command: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return run("ssh", "-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                   "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", f"root@{node.ip}", command, check=False,
                   timeout=timeout)

    def processes(self, node: Node) -> list[str]:
        """Command lines of every process running in the node, sshd included."""
        out = []
        for pid in run("ip", "netns", "pids", node.netns, check=False).stdout.split():
            try:
                out.append(pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
            except OSError:
                pass
        return out

    # ---- tear-down ----
    def close(self) -> None:
        for proc in self._procs.values():  # the node's first process: its death ends every process in the node
            proc.kill()
        for proc in self._procs.values():
            proc.wait(30)
        self._procs.clear()
        for node in NODES:
            # Our end first: the namespace itself can outlive its processes for minutes (the kernel keeps it while
            # closed TCP connections to the other nodes time out) and would hold the pair's name until then.
            if node.netns in self._netns:
                run("ip", "link", "delete", node.veth, check=False)
                run("ip", "netns", "delete", node.netns, check=False)
        self._netns.clear()
        if self._bridge:
            run("ip", "link", "delete", BRIDGE, check=False)
            self._bridge = False
        shutil.rmtree(self.work, ignore_errors=True)
