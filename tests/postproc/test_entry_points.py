"""What a new user runs first: `from postproc import PostprocWorker`, and a plain script (no `__main__` guard) that
builds an LLM with postproc worker processes at module level; each in a real interpreter of its own."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from raypd import LLM, SamplingParams

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 180  # two worker interpreters import transformers on a busy 2-core host
PROMPTS = ["héllo wörld, ça va", "plain ascii words"]

SCRIPT = """\
import json, sys, time
print("module level ran", flush=True)
from raypd import LLM, SamplingParams

for hook in sys.argv[2].split(","):  # one LLM after another, each with its own workers
    llm = LLM(sys.argv[1], block_size=4, num_postprocess_workers=2, post_processor_hook=hook or None)
    print("workers", json.dumps([p.pid for p in llm._postproc._procs]), flush=True)
    if sys.argv[3] == "hang":
        time.sleep(600)
    outs = llm.generate({prompts!r}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    print("texts", json.dumps([o.outputs[0].text for o in outs]), flush=True)
    llm.shutdown()
"""

HOOK = """\
from dataclasses import replace
from postproc.hooks import PostProcessorHook

class Upper(PostProcessorHook):
    def process(self, chunk, sampling_params):
        return replace(chunk, deltas=tuple(replace(d, text=d.text.upper()) for d in chunk.deltas))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _script(tmp_path: pathlib.Path) -> pathlib.Path:
    # The hook's module sits beside the script, importable only through the script's own sys.path entry.
    (tmp_path / "user_hooks.py").write_text(HOOK)
    script = tmp_path / "plain_script.py"
    script.write_text(SCRIPT.format(prompts=PROMPTS))
    return script


def _lines(out: str, tag: str) -> list[str]:
    return [line.removeprefix(tag).strip() for line in out.splitlines() if line.startswith(tag)]


def _gone(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited; a container's init may not reap orphans


def test_package_exports_the_reference_api_names():
    code = textwrap.dedent("""\
        import sys
        import postproc
        assert "postproc.worker" not in sys.modules  # lazy: `import postproc.pipes` needs no transformers
        from postproc import PostprocWorker, PostprocParams, PostProcessorHook, Terminate
        from postproc import worker, hooks
        assert (PostprocWorker, PostprocParams) == (worker.PostprocWorker, worker.PostprocParams)
        assert (PostProcessorHook, Terminate) == (hooks.PostProcessorHook, hooks.Terminate)
        assert PostprocWorker.Input._fields[:2] == ("rsp", "sampling_params")
        assert callable(PostprocWorker.default_record_creator) and sorted(postproc.__all__) == sorted(
            ["PostprocWorker", "PostprocParams", "PostProcessorHook", "Terminate"])
        try:
            postproc.Nothing
        except AttributeError as exc:
            assert "Nothing" in str(exc)
        else:
            raise AssertionError("no AttributeError")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd="/",
                         timeout=TIMEOUT_S)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_plain_script_without_main_guard_runs_with_worker_processes(tmp_path, tiny_llama):
    """Without a hook, then with one, in one run of the script (one interpreter start and one reference LLM serve
    both); the second LLM in the script must start and stop its workers as cleanly as the first."""
    script = _script(tmp_path)
    hooks = ["", "user_hooks.Upper"]
    out = subprocess.run([sys.executable, str(script), tiny_llama, ",".join(hooks), "run"], capture_output=True,
                         text=True, cwd=tmp_path, env=_env(), timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    # multiprocessing's spawn would have re-run the module in each worker (and failed there, bootstrapping)
    assert _lines(out.stdout, "module level ran") == [""]
    with LLM(tiny_llama, block_size=4) as reference:  # no workers: detokenized on the engine thread
        expected = [o.outputs[0].text for o in reference.generate(
            PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    got = [json.loads(line) for line in _lines(out.stdout, "texts")]
    assert got == [[t.upper() for t in expected] if hook else expected for hook in hooks]
    workers = [json.loads(line) for line in _lines(out.stdout, "workers")]
    assert len(workers) == len(hooks) and all(len(pids) == 2 for pids in workers), workers
    assert all(_gone(pid) for pids in workers for pid in pids)


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_workers_exit_when_their_parent_is_killed(tmp_path, tiny_llama):
    script = _script(tmp_path)
    proc = subprocess.Popen([sys.executable, str(script), tiny_llama, "", "hang"], stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=_env())
    try:
        deadline = time.monotonic() + TIMEOUT_S
        line = ""
        while not line.startswith("workers") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the script exited before starting its workers"
        pids = json.loads(line.removeprefix("workers"))
        assert len(pids) == 2 and not any(_gone(pid) for pid in pids)
    finally:
        proc.send_signal(signal.SIGKILL)  # no atexit, no finally: only the workers' own watch can end them
        proc.wait(30)
    deadline = time.monotonic() + 20
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if not _gone(pid)] == []
