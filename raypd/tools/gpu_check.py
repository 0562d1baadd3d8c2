"""GPU check: what only a CUDA machine can show, in one command of a few minutes.

    python -m raypd.tools.gpu_check [--model DIR] [--work DIR] [--budget-s 450]

1. builds a ~1.2B random checkpoint with Llama-3.2-1B's layer shapes (raypd/tools/tiny.py --size 1b), unless --model;
2. greedy parity with transformers on CUDA in fp32: the same tokens, except where transformers' own top-2 logits
   are within a near tie;
3. decode steps (bf16) at a few batch sizes against the weights-read floor: bytes of weights one step reads,
   over the GPU's measured copy bandwidth;
4. a NIXL VRAM-to-VRAM read of a prompt's KV blocks between two engines (context_only, then generation_only), its
   time and bandwidth, and the same tokens as colocated;
5. tensor parallelism over two GPUs (NCCL) where there are two: the same greedy tokens as one rank.

Without a CUDA GPU it says so and exits 0. Exit 1 if a check fails, 2 if the budget ran out before all had run.
Each stage prints as it ends, so a run cut short still shows what it measured. `--device cpu --model DIR` runs the
same stages on the CPU (DRAM instead of VRAM), which is how the script itself is tested without a GPU.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

# A divergence where transformers' top-2 logits are this close counts as a tie: on CUDA, cuBLAS sums in other
# orders than ours (fp32 logits of a 1B model move by ~1e-4), so PARITY.md's CPU bound of 1e-4 is too tight here.
NEAR_TIE = 1e-3
FIRST_ORDINARY_ID = 10


@dataclass
class Outcome:
    name: str
    ok: bool
    detail: str


def log(msg: str) -> None:
    print(msg, flush=True)


def build_model(work: pathlib.Path) -> pathlib.Path:
    from raypd.tools.tiny import build_tiny_model, num_parameters

    out = work / "llama-1b-shapes"
    if not (out / "config.json").exists():
        start = time.perf_counter()
        build_tiny_model(out, arch="llama", size="1b", dtype="bfloat16")
        log(f"built {out} ({num_parameters(out) / 1e9:.2f}B params, bf16) in {time.perf_counter() - start:.0f} s")
    return out


def prompts(vocab: int, count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def greedy_engine(engine, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    from llmapi.sampling_params import SamplingParams

    for i, p in enumerate(batch):
        engine.add_request(i, p, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    out: list[list[int]] = [[] for _ in batch]
    while engine.has_unfinished_requests():
        for rsp in engine.step():
            for delta in rsp.deltas:
                out[rsp.request_id].extend(delta.token_ids)
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def check_parity(model_dir: pathlib.Path, device: str, new_tokens: int = 24) -> Outcome:
    """fp32: our greedy tokens against transformers' generate on the same device, prompt by prompt."""
    from transformers import AutoModelForCausalLM

    from engine.core.engine import EngineConfig, LLMEngine

    engine = LLMEngine(str(model_dir), EngineConfig(device=device, dtype="float32", num_blocks=512))
    batch = prompts(engine.spec.vocab_size // 4, 4, 8, 200, seed=1)
    ours = greedy_engine(engine, batch, new_tokens)
    del engine
    free(device)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    lines, ok = [], True
    for i, p in enumerate(batch):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p], device=device), max_new_tokens=new_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        tokens = ref.sequences[0, len(p):].tolist()
        first = next((j for j, (a, b) in enumerate(zip(ours[i], tokens)) if a != b), None)
        if first is None:
            lines.append(f"prompt {i} ({len(p)} tokens): {new_tokens}/{new_tokens} identical")
            continue
        top2 = ref.logits[first][0].float().topk(2).values
        gap = float(top2[0] - top2[1])
        tie = gap < NEAR_TIE
        ok &= tie
        lines.append(f"prompt {i}: first difference at token {first}, transformers' top-2 gap {gap:.1e} "
                     f"({'a near tie' if tie else 'NOT a tie'})")
    del hf
    free(device)
    return Outcome(f"greedy parity with transformers (fp32, {device})", ok, "; ".join(lines))


def copy_bandwidth(device: str, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy: bytes through memory (read + write) per second, the rate a pure read also gets."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - start)


def weight_bytes(model) -> int:
    """What one decode step reads: every parameter once (a tied lm_head is the embedding table, counted once;
    the embedding lookup itself reads only a few rows, which this slightly overcounts for untied models)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def time_decode(model_dir: pathlib.Path, device: str, batches=(1, 16, 64), steps: int = 20) -> Outcome:
    from engine.core.engine import EngineConfig, LLMEngine
    from llmapi.sampling_params import SamplingParams

    bandwidth = copy_bandwidth(device)
    lines = []
    for batch in batches:
        engine = LLMEngine(str(model_dir), EngineConfig(device=device, dtype="bfloat16", num_blocks=batch * 16 + 64,
                                                         max_num_seqs=batch, max_num_batched_tokens=8192))
        # A copy of N bytes moves 2N through memory; a step that reads W bytes of weights needs W / that rate.
        floor = weight_bytes(engine.model) / bandwidth
        for i, p in enumerate(prompts(engine.spec.vocab_size // 4, batch, 64, 64, seed=2)):
            engine.add_request(i, p, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
        for _ in range(4):  # prefill, then warm decode steps
            engine.step()
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()  # ends by copying the logits to the host: a sync
        step_s = (time.perf_counter() - start) / steps
        lines.append(f"batch {batch}: {step_s * 1e3:.2f} ms/step, floor {floor * 1e3:.2f} ms "
                     f"({floor / step_s:.0%} of it), {batch / step_s:.0f} tok/s")
        del engine
        free(device)
    detail = f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write); " + "; ".join(lines)
    return Outcome("decode step vs weights-read floor (bf16)", True, detail)


def check_nixl(model_dir: pathlib.Path, device: str, prompt_tokens: int = 2048) -> Outcome:
    """Two engines (on two GPUs when there are two): the decode side READs the prompt's KV from the prefill side's
    VRAM over NIXL, and must then produce the colocated tokens."""
    from engine.config import load_spec
    from engine.core.engine import EngineConfig
    from raypd import LLM, DisaggregatedParams, SamplingParams

    prompt_tokens = min(prompt_tokens, load_spec(model_dir).max_position_embeddings - 64)
    first = "cuda:0" if device.startswith("cuda") else device
    second = "cuda:1" if first == "cuda:0" and torch.cuda.device_count() > 1 else first
    config = dict(dtype="bfloat16", num_blocks=prompt_tokens // 16 + 64)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(str(model_dir), EngineConfig(device=first, **config), kv_transfer="nixl") as ctx, \
            LLM(str(model_dir), EngineConfig(device=second, **config), kv_transfer="nixl") as gen:
        prompt = prompts(ctx.engine.spec.vocab_size // 4, 1, prompt_tokens, prompt_tokens, seed=3)[0]
        colocated = ctx.generate(prompt, params, use_tqdm=False)
        warm = ctx.generate(prompt[:64], params, disaggregated_params=DisaggregatedParams(request_type="context_only"))
        gen.generate(prompt[:64], params, disaggregated_params=_generation_only(warm))  # connects the agents
        c = ctx.generate(prompt, params, disaggregated_params=DisaggregatedParams(request_type="context_only"))
        before = gen.engine.connector.stats().kv_bytes_read
        g = gen.generate(prompt, params, disaggregated_params=_generation_only(c))
        after = gen.engine.connector.stats()
        moved, seconds = after.kv_bytes_read - before, after.last_import_s
    same = g.outputs[0].token_ids == colocated.outputs[0].token_ids
    detail = (f"{first} -> {second}: {moved / 1e6:.1f} MB of KV ({prompt_tokens} tokens) in {seconds * 1e3:.2f} ms "
              f"({moved / max(seconds, 1e-9) / 1e9:.1f} GB/s, including the generation-number check); tokens "
              f"{'identical to' if same else 'DIFFERENT from'} colocated")
    return Outcome("NIXL VRAM-to-VRAM KV read between two engines", same and moved > 0, detail)


def _generation_only(context_result):
    dp = context_result.disaggregated_params
    dp.request_type = "generation_only"
    return dp


def check_tensor_parallel(model_dir: pathlib.Path, device: str, new_tokens: int = 24) -> Outcome:
    """fp32 greedy tokens of two ranks (NCCL on two GPUs; shared memory on a CPU) against one rank's."""
    from engine.core.engine import EngineConfig, LLMEngine

    name = f"tensor parallel 2 ranks vs 1 (fp32, {device})"
    if device.startswith("cuda") and torch.cuda.device_count() < 2:
        return Outcome(name, True, f"not run: {torch.cuda.device_count()} GPU visible, two needed")
    tokens, seconds = [], []
    for size in (1, 2):
        # every rank with this process's thread count (which the engine would otherwise set to cores / ranks)
        engine = LLMEngine(str(model_dir), EngineConfig(device=device, dtype="float32", num_blocks=512,
                                                        tensor_parallel_size=size, num_threads=torch.get_num_threads()))
        batch = prompts(engine.spec.vocab_size // 4, 4, 8, 200, seed=2)
        start = time.perf_counter()
        tokens.append(greedy_engine(engine, batch, new_tokens))
        seconds.append(time.perf_counter() - start)
        engine.close()
        del engine
        free(device)
    same = sum(a == b for a, b in zip(*tokens))
    return Outcome(name, same == len(tokens[0]), f"{same}/{len(tokens[0])} prompts token-identical; "
                                                 f"{seconds[0]:.2f} s at 1 rank, {seconds[1]:.2f} s at 2")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raypd.tools.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir; default: build the 1B-shaped model")
    parser.add_argument("--work", default=None, help="where to build it (default: a temporary directory)")
    parser.add_argument("--budget-s", type=float, default=450, help="skip the stages that would start after this")
    parser.add_argument("--device", default="cuda", help="cpu: the same stages on this CPU, to test the script")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log("gpu_check: no CUDA GPU visible here (torch.cuda.is_available() is False): nothing to check.")
        return 0
    start = time.perf_counter()
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
    log(f"gpu_check on {where} ({torch.cuda.device_count()} GPU(s)), torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = pathlib.Path(args.model) if args.model else build_model(pathlib.Path(args.work or tmp))
        outcomes, skipped = [], []
        for stage in (check_parity, time_decode, check_nixl, check_tensor_parallel):
            if time.perf_counter() - start > args.budget_s:
                skipped.append(stage.__name__)
                continue
            try:
                outcome = stage(model_dir, args.device)
            except Exception as exc:  # a check that cannot run is a failed check, reported with its reason
                outcome = Outcome(stage.__name__, False, f"{type(exc).__name__}: {exc}")
            outcomes.append(outcome)
            log(f"[{'ok' if outcome.ok else 'FAIL'}] {outcome.name} ({time.perf_counter() - start:.0f} s): "
                f"{outcome.detail}")
    if skipped:
        log(f"budget of {args.budget_s:.0f} s spent; not run: {', '.join(skipped)}")
    return 1 if not all(o.ok for o in outcomes) else 2 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
