"""Offline throughput against vLLM's CPU backend: the same seeded workloads, the same checkpoints, one system at a time.

    python -m benchmarks.offline_peers [--workloads bench-fp32,bench-bf16,bench-32k-fp32,qwen-0.5b-bf16,qwen-0.5b-fp32,
                                              qwen3-moe-fp32,mixtral-fp32,deepseek-v3-fp32]
                                 [--systems raypd,vllm]
                                 [--vllm-python .venv-vllm/bin/python] [--threads 2] [--repeats 1] [--out FILE.md]

`make bench-peers` creates vLLM's venv (.venv-vllm, see ../shared/BENCH.md) and runs this. Each run is a process of
its own (raypd in this venv, vLLM through scripts/vllm_offline.py in its venv), so nothing of one system is warm or
loaded when the other runs; each warms up on a small batch first, then `generate`s every request at once (all arrive
at t=0), greedily, each request's exact output length with EOS ignored. Both use their own defaults otherwise (prefill
budget, KV pool), at the same thread count. A benchmark, not a test: greedy agreement is a sanity check only, since
the two round differently (bf16 most of all).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

FIRST_ORDINARY_ID = 10  # the tiny tokenizers' special tokens sit below this id
RESULTS_DIR = pathlib.Path("out/bench_peers")  # every run's result, so a one-system rerun can show the other's last


@dataclass(frozen=True)
class Checkpoint:
    path: str
    arch: str
    size: str
    dtype: str  # the checkpoint's own
    config: tuple[tuple[str, object], ...] = ()  # config overrides on the size's shapes

    def ensure(self) -> str:
        if not (pathlib.Path(self.path) / "config.json").exists():
            from raypd.tools.tiny import build_tiny_model

            print(f"building {self.path} ({self.arch}, size {self.size}, {self.dtype})", flush=True)
            build_tiny_model(self.path, arch=self.arch, size=self.size, dtype=self.dtype, **dict(self.config))
        return self.path


BENCH = Checkpoint("models/tiny-llama-bench", "llama", "bench", "float32")
# The bench layers with Llama 2's 32k vocabulary (~37M): the head then costs as much as the layers, per decoded token.
BENCH_32K = Checkpoint("models/tiny-llama-bench-32k", "llama", "bench", "float32", config=(("vocab_size", 32000),))
QWEN_05B = Checkpoint("models/qwen2.5-0.5b-shapes", "qwen2", "0.5b", "bfloat16")
# Mixture of experts at the bench size: 8 experts, 2 per token (raypd.tools.tiny's MoE shapes).
QWEN3_MOE = Checkpoint("models/tiny-qwen3-moe-bench", "qwen3_moe", "bench", "float32")
MIXTRAL = Checkpoint("models/tiny-mixtral-bench", "mixtral", "bench", "float32")
# DeepSeek-V3's latent attention and grouped routing at the bench size, with V2/V3's own per-head and latent widths
# (a latent of 512 + 64: the only one vLLM's CPU MLA kernel takes).
DEEPSEEK_V3 = Checkpoint("models/tiny-deepseek-v3-bench", "deepseek_v3", "bench", "float32", config=(
    ("kv_lora_rank", 512), ("qk_rope_head_dim", 64), ("qk_nope_head_dim", 128), ("v_head_dim", 128)))


@dataclass(frozen=True)
class Workload:
    name: str
    checkpoint: Checkpoint
    dtype: str  # what both systems run in
    requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]


WORKLOADS = {w.name: w for w in (
    Workload("bench-fp32", BENCH, "float32", 32, (16, 256), (16, 128)),
    Workload("bench-bf16", BENCH, "bfloat16", 32, (16, 256), (16, 128)),
    Workload("bench-32k-fp32", BENCH_32K, "float32", 32, (16, 256), (16, 128)),
    Workload("qwen-0.5b-bf16", QWEN_05B, "bfloat16", 16, (64, 512), (16, 128)),
    # the same in fp32: like for like on a CPU without native bf16, where vLLM's bf16 is emulated
    Workload("qwen-0.5b-fp32", QWEN_05B, "float32", 16, (64, 512), (16, 128)),
    Workload("qwen3-moe-fp32", QWEN3_MOE, "float32", 32, (16, 256), (16, 128)),
    Workload("mixtral-fp32", MIXTRAL, "float32", 32, (16, 256), (16, 128)),
    Workload("deepseek-v3-fp32", DEEPSEEK_V3, "float32", 32, (16, 256), (16, 128)),
)}


def token_ids(model_dir: str, count: int, length_range, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(rng.randint(*length_range))] for _ in range(count)]


def make_spec(w: Workload, seed: int, threads: int) -> dict:
    """Prompts drawn from the tokenizer's ids (the model's vocab may be padded past it, as Qwen2.5's is)."""
    from transformers import AutoTokenizer

    path = w.checkpoint.ensure()
    vocab = len(AutoTokenizer.from_pretrained(path))
    rng = random.Random(seed)
    prompts = token_ids(path, w.requests, w.prompt_range, vocab, rng)
    lens = [rng.randint(*w.output_range) for _ in prompts]
    warm = random.Random(seed + 1)
    warm_prompts = token_ids(path, 4, (8, 64), vocab, warm)
    return dict(model=str(pathlib.Path(path).resolve()), dtype=w.dtype, max_model_len=2048, threads=threads,
                prompts=prompts, output_lens=lens, warmup_prompts=warm_prompts, warmup_lens=[8, 4, 6, 5])


# ---- raypd's side (runs in a process of its own: python -m benchmarks.offline_peers --run-raypd SPEC OUT) ----
def run_raypd(spec_path: str, out_path: str) -> None:
    import torch

    from engine.core.engine import EngineConfig, LLMEngine
    from llmapi.sampling_params import SamplingParams

    spec = json.loads(pathlib.Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    engine = LLMEngine(spec["model"], EngineConfig(dtype=spec["dtype"], batch_invariant=spec["batch_invariant"]))
    init_s = time.perf_counter() - start

    def generate(prompts, lens):
        """Per request: its tokens, and each token's logprob (from the running cumulative logprob, at no cost)."""
        for i, (p, n) in enumerate(zip(prompts, lens)):
            engine.add_request(i, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        outputs: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        cumulative = [0.0] * len(prompts)
        while engine.has_unfinished_requests():
            for rsp in engine.step():
                for delta in rsp.deltas:
                    i = rsp.request_id
                    outputs[i].extend(delta.token_ids)
                    if delta.token_ids:
                        logprobs[i].append(delta.cumulative_logprob - cumulative[i])
                        cumulative[i] = delta.cumulative_logprob
        return outputs, logprobs

    generate(spec["warmup_prompts"], spec["warmup_lens"])
    start = time.perf_counter()
    outputs, logprobs = generate(spec["prompts"], spec["output_lens"])
    wall = time.perf_counter() - start
    c = engine.config
    note = f"raypd, max_num_batched_tokens={c.max_num_batched_tokens}, max_num_seqs={c.max_num_seqs}" + \
        (", batch_invariant" if c.batch_invariant else "")
    result = dict(wall_s=wall, init_s=init_s, outputs=outputs, logprobs=logprobs, note=note)
    pathlib.Path(out_path).write_text(json.dumps(result))


# ---- against transformers ----
def hf_agreement(spec: dict, results: dict[str, dict]) -> dict[str, tuple[float, float | None]]:
    """Per system: the fraction of its tokens that transformers, in the same dtype and fed the same sequence
    (teacher-forced, one forward per request), also ranks first; and the largest difference between its logprob
    of a token and transformers' (raypd's, which the run records). Free-running greedy sequences of a random model
    part at the first near tie and never meet again, so they say little about bf16 rounding; this does."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"])).eval()
    found = {}
    for system, r in results.items():
        agree = total = 0
        worst = None
        for i, (prompt, out) in enumerate(zip(spec["prompts"], r["outputs"])):
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]  # (len(out), vocab)
            ref = torch.log_softmax(logits.float(), dim=-1)
            tokens = torch.tensor(out)
            agree += int((ref.argmax(-1) == tokens).sum())
            total += len(out)
            if "logprobs" in r:
                diff = float((ref[torch.arange(len(out)), tokens] - torch.tensor(r["logprobs"][i])).abs().max())
                worst = diff if worst is None else max(worst, diff)
        found[system] = (agree / max(1, total), worst)
    return found


# ---- orchestration ----
SYSTEMS = ("raypd", "vllm", "vllm-tuned")


def vllm_env(system: str, vllm_python: str) -> dict:
    """vllm: its defaults, which on 2 cores compute on one (the other is reserved for its front end).
    vllm-tuned: what its CPU docs ask for best speed, as far as this box allows: compute threads bound to both
    cores, none reserved, Intel's OpenMP preloaded (tcmalloc is not installed here)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its venv must see nothing of this one
    env["VLLM_TARGET_DEVICE"] = "cpu"
    if system == "vllm-tuned":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        iomp = pathlib.Path(vllm_python).absolute().parents[1] / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
    return env


def run_system(system: str, spec: dict, vllm_python: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = pathlib.Path(tmp, "spec.json"), pathlib.Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        if system == "raypd":
            cmd = [sys.executable, "-m", "benchmarks.offline_peers", "--run-raypd", str(spec_path), str(out_path)]
            env = dict(os.environ)
        else:
            script = pathlib.Path(__file__).parents[1] / "scripts" / "vllm_offline.py"
            cmd = [vllm_python, str(script), str(spec_path), str(out_path)]
            env = vllm_env(system, vllm_python)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        if proc.returncode != 0 or not out_path.exists():
            causes = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line][:8]
            raise RuntimeError(f"{system} failed (exit {proc.returncode}):\n" + "\n".join(causes) +
                               f"\n...\n{proc.stderr[-2000:]}")
        return json.loads(out_path.read_text())


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(requests whose outputs are identical, fraction of tokens before each request's first difference)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = 0
    for x, y in zip(a, b):
        prefix += next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return same, prefix / max(1, sum(len(x) for x in a))


def tok_s(result: dict) -> float:
    return sum(len(o) for o in result["outputs"]) / result["wall_s"]


def row(w: Workload, results: dict[str, dict], cached: set[str], hf: dict | None) -> str:
    raypd = results["raypd"]
    cells = [w.name, str(w.requests), f"{w.prompt_range[0]}-{w.prompt_range[1]}",
             f"{w.output_range[0]}-{w.output_range[1]}", f"{tok_s(raypd):.0f}"]
    for system in SYSTEMS[1:]:
        r = results.get(system)
        mark = "*" if system in cached else ""
        cells += [f"{tok_s(r):.0f}{mark}", f"**{tok_s(raypd) / tok_s(r):.2f}x**"] if r else ["-", "-"]
    agree = []
    for system in SYSTEMS[1:]:
        if system in results:
            same, frac = agreement(raypd["outputs"], results[system]["outputs"])
            agree.append(f"{same}/{w.requests}, {frac:.0%}")
    cells.append("; ".join(agree))
    if hf is not None:
        rate, worst = hf["raypd"]
        others = ", ".join(f"{s} {hf[s][0]:.1%}" for s in SYSTEMS[1:] if s in hf)
        cells.append(f"raypd {rate:.1%} (max logprob diff {worst:.2g}); {others}")
    else:
        cells.append("-")
    return "| " + " | ".join(cells) + " |"


HEADER = ("| workload | requests | prompt | output | raypd tok/s | vLLM tok/s | raypd / vLLM | vLLM tuned tok/s | "
          "raypd / vLLM tuned | raypd vs vLLM, vLLM tuned: identical requests, tokens before the first difference | "
          "tokens transformers also ranks first (same dtype, teacher-forced) |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")


def bench(w: Workload, systems: list[str], args) -> str | None:
    spec = dict(make_spec(w, args.seed, args.threads), batch_invariant=args.batch_invariant)
    results: dict[str, dict] = {}
    for _ in range(args.repeats):
        for system in systems:
            r = run_system(system, spec, args.vllm_python)
            print(f"  {w.name} {system}: {r['wall_s']:.2f} s, {tok_s(r):.0f} tok/s ({r['note']})", flush=True)
            if system not in results or r["wall_s"] < results[system]["wall_s"]:
                results[system] = r
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for system, r in results.items():
        (RESULTS_DIR / f"{w.name}-{system}.json").write_text(json.dumps(r))
    cached = set()
    for system in SYSTEMS:
        saved = RESULTS_DIR / f"{w.name}-{system}.json"
        if system not in results and saved.exists():
            results[system], cached = json.loads(saved.read_text()), cached | {system}
    if "raypd" not in results or len(results) < 2:
        return None
    return row(w, results, cached, hf_agreement(spec, results) if args.parity else None)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offline_peers", description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"any of {', '.join(WORKLOADS)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"any of {', '.join(SYSTEMS)}; those left out show their last saved run, marked *")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of raypd (vLLM binds one per core)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the systems; the fastest run counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-parity", dest="parity", action="store_false",
                        help="skip the teacher-forced comparison with transformers")
    parser.add_argument("--out", default=None, help="also write the table here as markdown")
    parser.add_argument("--batch-invariant", action="store_true", help="raypd with EngineConfig.batch_invariant")
    parser.add_argument("--run-raypd", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.run_raypd:
        return run_raypd(*args.run_raypd)
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS] + [
        w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown system(s) or workload(s): {', '.join(unknown)}")
    if any(s.startswith("vllm") for s in systems) and not pathlib.Path(args.vllm_python).exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_python}: `make bench-peers` creates it")
    rows = [bench(WORKLOADS[name], systems, args) for name in args.workloads.split(",")]
    text = "\n".join([HEADER, *(r for r in rows if r)])
    head = (f"raypd: {args.threads} torch threads; vLLM: its defaults (1 compute core here), tuned: both cores "
            f"(see vllm_env); best of {args.repeats} run(s) per system, one system at a time; * = an earlier run")
    print("\n" + head + "\n" + text)
    if args.out:
        pathlib.Path(args.out).write_text(head + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
