"""Finding what a command left running: every process whose working directory is the one it ran in."""

from __future__ import annotations

import os
import pathlib


def processes_in(directory: pathlib.Path) -> list[int]:
    """Processes whose working directory is `directory` (a CLI run there, and every Ray process it started)."""
    pids = []
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            if pathlib.Path(os.readlink(proc / "cwd")) == directory:
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids
