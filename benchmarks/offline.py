"""Offline throughput: raypd's LLMEngine against transformers' `generate` and its continuous batching, in one run.

    python -m benchmarks.offline [--requests 64] [--model DIR] [--threads 2] [--out FILE.md] [--quick] [--profile]

Every system gets the same seeded workload (random prompt ids, per-request output lengths), generates each
request's exact output length greedily with EOS ignored, and runs in this process with the same torch thread
count, after one untimed warm-up on a small batch. Static batching generates up to the longest output of its
batch; only each request's own tokens count as useful. A benchmark, not a test: mismatches are printed, not raised.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pathlib
import pstats
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

# Set before torch loads OpenMP. Its default spin-waiting collapses when cores are shared: on a busy 2-core box a
# 2-thread raypd run took 26 s spinning versus 2 s with passive waits. Every system here runs under the same policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from engine.config import load_spec  # noqa: E402
from engine.core.engine import EngineConfig, LLMEngine  # noqa: E402
from raypd.tools.tiny import build_tiny_model, num_parameters  # noqa: E402
from llmapi.sampling_params import SamplingParams  # noqa: E402

DEFAULT_MODEL_DIR = pathlib.Path("models/tiny-llama-bench")
FIRST_ORDINARY_ID = 10  # the tiny tokenizers' special tokens sit below this id
BLOCK_SIZE = 16
TARGETS = {"hf generate": 2.0, "hf continuous batching": 1.2}  # raypd throughput / system throughput


# ---- workload ----
@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, prompt_range, output_range, vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(rng.randint(*prompt_range))]
               for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


@dataclass(frozen=True)
class RunResult:
    system: str
    wall_s: float
    outputs: list[list[int]]  # per request, its own output tokens only
    note: str = ""
    setting: int = 0  # the knob swept for this system (raypd: max_num_batched_tokens; generate: batch size)


def useful_tokens(result: RunResult) -> int:
    return sum(len(o) for o in result.outputs)


def timed(fn: Callable, *args):
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


# ---- raypd ----
def engine_config(wl: Workload, max_num_batched_tokens: int) -> EngineConfig:
    # Enough blocks for every request at once, so no preemption muddies the comparison.
    need = sum(-(-(len(p) + n) // BLOCK_SIZE) for p, n in zip(wl.prompts, wl.output_lens))
    return EngineConfig(block_size=BLOCK_SIZE, num_blocks=need + 64, max_num_seqs=max(64, len(wl.prompts)),
                        max_num_batched_tokens=max_num_batched_tokens)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def raypd_generate(engine: LLMEngine, wl: Workload) -> list[list[int]]:
    """All requests arrive at t=0; steps until every one is done."""
    for i, (prompt, n) in enumerate(zip(wl.prompts, wl.output_lens)):
        engine.add_request(i, prompt, greedy(n))
    outputs: list[list[int]] = [[] for _ in wl.prompts]
    while engine.has_unfinished_requests():
        for rsp in engine.step():
            for delta in rsp.deltas:
                outputs[rsp.request_id].extend(delta.token_ids)
    return outputs


def run_raypd(model_dir, wl: Workload, warmup: Workload, max_num_batched_tokens: int) -> RunResult:
    engine = LLMEngine(str(model_dir), engine_config(wl, max_num_batched_tokens))
    raypd_generate(engine, warmup)
    outputs, wall = timed(raypd_generate, engine, wl)
    note = f"max_num_batched_tokens={max_num_batched_tokens}, preemptions={engine.scheduler.num_preemptions}"
    return RunResult(f"raypd (mbt {max_num_batched_tokens})", wall, outputs, note, max_num_batched_tokens)


# ---- transformers: static batching ----
def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    # None in a GenerationConfig falls back to the model's; clearing it here is what disables EOS stopping.
    model.generation_config.eos_token_id = None
    return model


def hf_static_batch(model, prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
    from transformers import GenerationConfig

    pad = model.config.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # (B, width), left padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (B, width)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(lens), eos_token_id=None, pad_token_id=pad)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)  # (B, width + max)
    return [out[i, width : width + n].tolist() for i, n in enumerate(lens)]


def hf_static(model, wl: Workload, batch_size: int) -> list[list[int]]:
    outputs = []
    for start in range(0, len(wl.prompts), batch_size):
        end = start + batch_size
        outputs += hf_static_batch(model, wl.prompts[start:end], wl.output_lens[start:end])
    return outputs


def run_hf_generate(model, wl: Workload, warmup: Workload, batch_size: int) -> RunResult:
    hf_static(model, warmup, batch_size)
    outputs, wall = timed(hf_static, model, wl, batch_size)
    return RunResult(f"hf generate (batch {batch_size})", wall, outputs, f"static batches of {batch_size}", batch_size)


# ---- transformers: continuous batching ----
def cb_configs(model, wl: Workload, max_batch_tokens: int):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    need = sum(-(-(len(p) + n) // BLOCK_SIZE) for p, n in zip(wl.prompts, wl.output_lens))
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=model.config.pad_token_id)
    # Explicit sizes: the defaults are inferred from GPU memory. No CUDA graphs, no async double-buffering on CPU.
    cb = ContinuousBatchingConfig(
        page_size=BLOCK_SIZE, num_blocks=need + 64, max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max(64, len(wl.prompts)), scheduler_type="fifo", allow_block_sharing=False,
        use_cuda_graph=False, use_async_batching=False,
    )
    return generation, cb


def hf_continuous(model, wl: Workload, max_batch_tokens: int) -> tuple[list[list[int]], float]:
    """Returns outputs and the wall time from the first add_request to the last result (manager start excluded)."""
    manager = model.init_continuous_batching(*cb_configs(model, wl, max_batch_tokens))
    manager.start()
    try:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(wl.prompts, wl.output_lens)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
        results = collect_cb_results(manager, len(wl.prompts))
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return [results[f"r{i}"] for i in range(len(wl.prompts))], wall


def collect_cb_results(manager, count: int) -> dict[str, list[int]]:
    results: dict[str, list[int]] = {}
    while len(results) < count:
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError(f"continuous batching stopped after {len(results)}/{count} results")
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        if result.is_finished():
            results[result.request_id] = list(result.generated_tokens)
    return results


def hf_generate_batch_by_length(model, wl: Workload, max_batch_tokens: int) -> list[list[int]]:
    """Fallback: generate_batch takes one max_new_tokens, so requests are grouped by output length."""
    generation, cb = cb_configs(model, wl, max_batch_tokens)
    outputs: list[list[int]] = [[] for _ in wl.prompts]
    for n in sorted(set(wl.output_lens)):
        idx = [i for i, m in enumerate(wl.output_lens) if m == n]
        got = model.generate_batch([wl.prompts[i] for i in idx], generation, cb, max_new_tokens=n, warmup=False)
        for i, result in zip(idx, got.values()):
            outputs[i] = list(result.generated_tokens)
    return outputs


def run_hf_continuous(model, wl: Workload, warmup: Workload, max_batch_tokens: int) -> RunResult:
    name, note = "hf continuous batching", f"page 16, max_batch_tokens={max_batch_tokens}, fifo"
    try:
        hf_continuous(model, warmup, max_batch_tokens)
        outputs, wall = hf_continuous(model, wl, max_batch_tokens)
        return RunResult(name, wall, outputs, "init_continuous_batching, " + note)
    except Exception as exc:  # the API is young; the bench reports the fallback instead of stopping
        print(f"  continuous batching API failed ({exc!r}); falling back to generate_batch by output length")
        hf_generate_batch_by_length(model, warmup, max_batch_tokens)
        outputs, wall = timed(hf_generate_batch_by_length, model, wl, max_batch_tokens)
        return RunResult(name, wall, outputs, "FALLBACK generate_batch grouped by length, " + note)


# ---- decode efficiency ----
@dataclass(frozen=True)
class DecodeStats:
    batch: int
    steps: int
    step_s: float  # mean wall time of one decode step
    achieved_flops: float  # model FLOP/s over the timed steps
    matmul_flops: float  # FLOP/s of the same step's linears, timed alone
    matmul_s: float  # wall time of those linears for one step

    @property
    def efficiency(self) -> float:
        return self.achieved_flops / self.matmul_flops


def linears(engine: LLMEngine) -> list[torch.nn.Linear]:
    """Every matmul a decode token goes through (q/k/v, o, gate/up, down per layer; lm_head), as the model runs
    them (packed for oneDNN where it is, so the plain weight may be gone: shapes come from in/out_features)."""
    return [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]


def token_flops(engine: LLMEngine, context: int) -> float:
    """FLOPs of one token attending to `context` positions: 2 per weight of every linear, plus QK^T and AV."""
    spec = engine.spec
    dense = 2 * sum(m.in_features * m.out_features for m in linears(engine))
    return dense + 4 * spec.num_layers * context * spec.num_heads * spec.head_dim


def prefill_all(engine: LLMEngine) -> None:
    """Steps until every request is prefilled and has its first token: from then on each step is decode-only."""
    def decoding(s):
        return s.num_computed_tokens == s.num_tokens - 1

    while engine.scheduler.waiting or not all(decoding(s) for s in engine.scheduler.running):
        engine.step()


def measure_decode(model_dir, wl: Workload, max_num_batched_tokens: int, steps: int) -> DecodeStats:
    # Early requests decode while later ones prefill (sharing the token budget with them): the margin keeps every
    # request running through the timed steps, and the pool is sized for it so nothing is preempted.
    prefill_steps = -(-wl.prompt_tokens // max(max_num_batched_tokens - len(wl.prompts), 16))
    decode_wl = Workload(wl.prompts, [steps + 2 + prefill_steps] * len(wl.prompts))
    engine = LLMEngine(str(model_dir), engine_config(decode_wl, max_num_batched_tokens))
    for i, (prompt, n) in enumerate(zip(decode_wl.prompts, decode_wl.output_lens)):
        engine.add_request(i, prompt, greedy(n))
    prefill_all(engine)
    seqs = list(engine.scheduler.running)
    flops, start = 0.0, time.perf_counter()
    for _ in range(steps):
        flops += sum(token_flops(engine, s.num_tokens) for s in seqs)
        engine.step()
    step_s = (time.perf_counter() - start) / steps
    assert engine.scheduler.running == seqs, "a sequence finished or was preempted inside the timed decode steps"
    matmul_s, matmul_flops = time_linears(linears(engine), len(seqs), engine.model.dtype)
    return DecodeStats(len(seqs), steps, step_s, flops / steps / step_s, matmul_flops, matmul_s)


def time_linears(layers: list[torch.nn.Linear], batch: int, dtype: torch.dtype, reps: int = 20) -> tuple[float, float]:
    """Seconds per pass and FLOP/s of the model's own linears on (batch, in) inputs: one decode step's matmuls."""
    x = {m.in_features: torch.randn(batch, m.in_features, dtype=dtype) for m in layers}
    with torch.inference_mode():
        for m in layers:
            m(x[m.in_features])
        start = time.perf_counter()
        for _ in range(reps):
            for m in layers:
                m(x[m.in_features])
    seconds = (time.perf_counter() - start) / reps
    return seconds, 2 * batch * sum(m.in_features * m.out_features for m in layers) / seconds


# ---- report ----
def table(results: list[RunResult], wl: Workload, baseline: RunResult) -> str:
    rows = ["| system | wall s | output tok/s (useful) | total tok/s | throughput vs raypd | notes |",
            "|---|---:|---:|---:|---:|---|"]
    for r in results:
        out, total = useful_tokens(r) / r.wall_s, (useful_tokens(r) + wl.prompt_tokens) / r.wall_s
        ratio = baseline.wall_s / r.wall_s * useful_tokens(r) / useful_tokens(baseline)
        rows.append(f"| {r.system} | {r.wall_s:.1f} | {out:.0f} | {total:.0f} | {ratio:.2f}x | {r.note} |")
    return "\n".join(rows)


def targets(baseline: RunResult, best: dict[str, RunResult]) -> list[str]:
    lines = []
    for kind, target in TARGETS.items():
        other = best[kind]
        ratio = (useful_tokens(baseline) / baseline.wall_s) / (useful_tokens(other) / other.wall_s)
        verdict = "met" if ratio >= target else f"MISSED by {target / ratio:.2f}x"
        lines.append(f"- raypd / {other.system}: {ratio:.2f}x (target >= {target}x): {verdict}")
    return lines


def decode_lines(d: DecodeStats) -> list[str]:
    return [
        f"- raypd decode-only: batch {d.batch}, {d.steps} steps, {d.step_s * 1e3:.1f} ms/step, "
        f"{d.batch / d.step_s:.0f} tok/s",
        f"- achieved {d.achieved_flops / 1e9:.1f} GFLOP/s vs {d.matmul_flops / 1e9:.1f} GFLOP/s for the step's "
        f"linears alone ({d.matmul_s * 1e3:.1f} ms): efficiency {d.efficiency:.0%}",
    ]


def agreement(reference: RunResult, other: RunResult) -> str:
    same = sum(a == b for a, b in zip(reference.outputs, other.outputs))
    diverge = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
               for a, b in zip(reference.outputs, other.outputs) if a != b]
    where = f"; first differing position per mismatch: {sorted(diverge)}" if diverge else ""
    return f"- greedy tokens, {other.system} vs {reference.system}: {same}/{len(reference.outputs)} identical{where}"


# ---- main ----
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offline", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=None, help="default 64 (16 with --quick)")
    parser.add_argument("--model", default=None, help=f"checkpoint dir; default: build {DEFAULT_MODEL_DIR}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the report here as markdown")
    parser.add_argument("--quick", action="store_true", help="16 short requests, one config per system")
    parser.add_argument("--max-batched-tokens", default=None, help="raypd token budgets to try, e.g. 512,1024,2048")
    parser.add_argument("--batch-sizes", default=None, help="static batch sizes for hf generate, e.g. 16,64")
    parser.add_argument("--decode-steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all systems; the fastest run counts")
    parser.add_argument("--profile", action="store_true", help="cProfile one more raypd run; print the top 15")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def settings(args: argparse.Namespace) -> dict:
    quick = args.quick
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    return dict(
        requests=args.requests or (16 if quick else 64),
        prompt_range=(16, 128) if quick else (32, 512),
        output_range=(8, 64) if quick else (16, 256),
        budgets=ints(args.max_batched_tokens or ("1024" if quick else "512,1024,2048")),
        batch_sizes=ints(args.batch_sizes or ("16" if quick else "16,64")),
        decode_steps=args.decode_steps or (8 if quick else 32),
        repeats=args.repeats,
    )


def model_dir(args: argparse.Namespace) -> pathlib.Path:
    if args.model:
        return pathlib.Path(args.model)
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        build_tiny_model(DEFAULT_MODEL_DIR, size="bench")
    return DEFAULT_MODEL_DIR


def jobs(path, wl: Workload, warmup: Workload, s: dict) -> list[tuple[str, Callable[[], RunResult]]]:
    """(system, run) for every configuration tried; each run warms its system up, then times it."""
    hf = load_hf(path)
    found = [("raypd", partial(run_raypd, path, wl, warmup, b)) for b in s["budgets"]]
    found += [("hf generate", partial(run_hf_generate, hf, wl, warmup, n)) for n in s["batch_sizes"]]
    found.append(("hf continuous batching", partial(run_hf_continuous, hf, wl, warmup, 1024)))
    return found


def run_all(path, wl: Workload, warmup: Workload, s: dict) -> dict[str, list[RunResult]]:
    """Runs every configuration `repeats` times, interleaved so that a burst of outside load hits all systems alike,
    and keeps each configuration's fastest run."""
    todo = jobs(path, wl, warmup, s)
    best: list[RunResult | None] = [None] * len(todo)
    for round_ in range(s["repeats"]):
        print(f"round {round_ + 1}/{s['repeats']}", flush=True)
        for i, (_, run) in enumerate(todo):
            result = log(run())
            if best[i] is None or result.wall_s < best[i].wall_s:
                best[i] = result
    runs: dict[str, list[RunResult]] = {}
    for (kind, _), result in zip(todo, best):
        runs.setdefault(kind, []).append(result)
    return runs


def log(result: RunResult) -> RunResult:
    print(f"  {result.system}: {result.wall_s:.1f} s", flush=True)
    return result


def fastest(results: list[RunResult]) -> RunResult:
    return max(results, key=lambda r: useful_tokens(r) / r.wall_s)


def report(path, wl: Workload, runs: dict[str, list[RunResult]], args) -> str:
    best = {kind: fastest(rs) for kind, rs in runs.items()}
    raypd = best["raypd"]
    head = (f"model {path} ({num_parameters(path) / 1e6:.1f}M params), {len(wl.prompts)} requests, "
            f"{wl.prompt_tokens} prompt + {wl.output_tokens} output tokens, torch threads {args.threads} "
            f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}), best of {args.repeats} interleaved run(s); "
            f"chosen raypd config: {raypd.note}")
    all_runs = [r for rs in runs.values() for r in rs]
    checks = [agreement(raypd, r) for r in all_runs if not r.system.startswith("raypd")]
    return "\n".join([head, "", table(all_runs, wl, raypd), "", *targets(raypd, best), *checks])


def profile_raypd(path, wl: Workload, warmup: Workload, budget: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    run_raypd(path, wl, warmup, budget)
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(15)
    print(stream.getvalue())


def main(argv=None) -> None:
    args = parse_args(argv)
    s = settings(args)
    torch.set_num_threads(args.threads)
    path = model_dir(args)
    vocab = load_spec(path).vocab_size
    wl = make_workload(s["requests"], s["prompt_range"], s["output_range"], vocab, args.seed)
    warmup = make_workload(4, (8, 32), (4, 8), vocab, args.seed + 1)
    runs = run_all(path, wl, warmup, s)
    text = report(path, wl, runs, args)
    print("\n" + text, flush=True)  # before the decode phase, so a failure there loses no result
    budget = fastest(runs["raypd"]).setting
    decode = decode_lines(measure_decode(path, wl, budget, s["decode_steps"]))
    print("\n".join(decode))
    text = "\n".join([text, *decode])
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    if args.profile:
        profile_raypd(path, wl, warmup, budget)


if __name__ == "__main__":
    main()
