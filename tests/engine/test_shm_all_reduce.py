"""The shared-memory all-reduce of ranks on one host: two ranks (threads here, each with its own mapping of the
file, as processes have), tensors larger than a slot, the same bits on every rank, a dead peer named."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading

import pytest
import torch

from engine.parallel import shm
from engine.parallel.shm import ShmAllReduce


def _reduce_on_two_ranks(path, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    ranks = [ShmAllReduce(str(path), r, 2, timeout_s=30) for r in range(2)]
    out, errors = [None, None], []

    def run(r: int) -> None:
        try:
            for _ in range(3):  # phases alternate: later calls reuse the first call's slots
                out[r] = parts[r].clone()
                ranks[r](out[r])  # summed in place
        except BaseException as exc:  # reported on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_ranks_sum_a_tensor_larger_than_a_slot(tmp_path, dtype):
    path = tmp_path / "tp"
    ShmAllReduce.create(str(path), 2)
    elements = 2 * shm.SLOT_BYTES // torch.empty((), dtype=dtype).element_size() + 77  # three pieces
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(elements, generator=gen).to(dtype) for _ in range(2)]
    a, b = _reduce_on_two_ranks(path, parts)
    assert torch.equal(a, b)  # the same bits on both ranks
    assert torch.equal(a, parts[0] + parts[1])  # summed in rank order


def test_a_peer_that_is_gone_is_named_not_waited_for(tmp_path):
    path = tmp_path / "tp"
    ShmAllReduce.create(str(path), 2)
    me = ShmAllReduce(str(path), 0, 2, timeout_s=30)
    rank1 = ("import os, sys; from engine.parallel.shm import ShmAllReduce; "
             "ShmAllReduce(sys.argv[1], 1, 2, timeout_s=30); print(os.getpid())")  # maps the file, then ends
    dead = subprocess.run([sys.executable, "-c", rank1, str(path)], capture_output=True, text=True, check=True,
                          cwd=pathlib.Path(__file__).resolve().parents[2])
    with pytest.raises(RuntimeError, match=f"rank 1 \\(pid {int(dead.stdout)}\\) is gone"):
        me(torch.ones(4))
