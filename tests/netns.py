"""Whether this machine lets tests build simulated nodes out of network namespaces (root, iproute2, unshare)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def why_not() -> str | None:
    """None when namespaces, veth pairs and bridges can be made here; else why not, for a skip reason."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "needs root: network namespaces, a bridge and sshd"
    if not (shutil.which("ip") and shutil.which("unshare")):
        return "needs iproute2 and util-linux (ip, unshare)"
    probe = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"this machine does not allow new namespaces: {probe.stderr.decode().strip()}"
    return None
