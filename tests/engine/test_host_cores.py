"""Engines on one host lend each other idle cores (engine/parallel/host_cores.py): the shared table, its locks across
real processes, and an engine's prompt steps borrowing while its decode steps do not."""

import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.core.engine import EngineConfig, LLMEngine
from engine.parallel import host_cores
from engine.parallel.host_cores import _SLOT_BYTES, HostCores
from llmapi.sampling_params import SamplingParams

HOLD_SLOT = """
import sys, time
from engine.parallel.host_cores import HostCores
cores = HostCores(1, path=__import__("pathlib").Path(sys.argv[1]), cores=2)
with cores.forward(1000):
    print(cores.slot, flush=True)
    time.sleep(60)
"""


def test_a_prompt_step_takes_the_cores_no_other_engine_claims(tmp_path):
    path = tmp_path / "table"
    a, b = HostCores(1, path=path, cores=2, grace_s=0.2), HostCores(1, path=path, cores=2, grace_s=0.2)
    try:
        assert a.slot != b.slot
        assert a.threads_for(345) == 2 and a.threads_for(16) == 1  # b idle; a decode-sized step never borrows
        with b.forward(16):
            assert a.threads_for(345) == 1  # b computes on its one thread
        assert a.threads_for(345) == 1  # b just finished a step: still busy for its grace period
        time.sleep(0.25)
        assert a.threads_for(345) == 2
        with a.forward(345) as threads:
            assert threads == 2 and torch.get_num_threads() == 2
            assert b.threads_for(345) == 1  # never fewer than its own threads
        assert torch.get_num_threads() == 1 and a.borrowed_steps == 1
    finally:
        a.close()
        b.close()
        torch.set_num_threads(1)


def test_another_processs_claim_counts_and_its_slot_is_freed_when_it_dies(tmp_path):
    path = tmp_path / "table"
    child = subprocess.Popen([sys.executable, "-c", HOLD_SLOT, str(path)], stdout=subprocess.PIPE, text=True,
                             cwd=os.getcwd())
    try:
        slot = int(child.stdout.readline())
        ours = HostCores(1, path=path, cores=2)
        assert ours.slot != slot
        assert ours.others() == 2 and ours.threads_for(345) == 1  # it took both cores: ours keeps its one
        fd = os.open(path, os.O_RDWR)
        with pytest.raises(OSError):  # the child's lock on its slot, held by the kernel
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, _SLOT_BYTES, slot * _SLOT_BYTES)
    finally:
        child.kill()
        child.wait(timeout=30)
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, _SLOT_BYTES, slot * _SLOT_BYTES)  # dropped with the process
    os.close(fd)
    ours.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to borrow")
def test_an_engine_borrows_for_prompts_not_for_decode_and_not_from_a_busy_peer(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(host_cores, "table_path", lambda: tmp_path / "table")
    found = {}

    def run():  # an engine runs on a thread of its own in every host (EngineLoop): threads are set per thread
        engine = LLMEngine(tiny_llama, EngineConfig(num_threads=1, borrow_idle_cores=True, num_blocks=64))
        try:
            engine.add_request(0, list(range(10, 210)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
                assert torch.get_num_threads() == 1
            found["alone"] = engine.stats()["borrowed_core_steps"]
            peer = HostCores(len(os.sched_getaffinity(0)), path=tmp_path / "table")
            with peer.forward(0):  # a peer computing on every core
                engine.add_request(1, list(range(20, 220)), SamplingParams(max_tokens=1, ignore_eos=True))
                while engine.has_unfinished_requests():
                    engine.step()
            peer.close()
            found["beside a busy peer"] = engine.stats()["borrowed_core_steps"]
        finally:
            engine.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    assert found == {"alone": 1, "beside a busy peer": 1}  # the prompt step only; then none


def test_batch_invariant_engines_never_borrow(tiny_llama):
    engine = LLMEngine(tiny_llama, EngineConfig(num_threads=1, borrow_idle_cores=True, batch_invariant=True,
                                                    num_blocks=64))
    try:
        assert isinstance(engine.executor.cores, host_cores.FixedThreads)
    finally:
        engine.close()
