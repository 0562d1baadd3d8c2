"""lm-evaluation-harness against a running raypd endpoint, its loglikelihoods checked against the engine's own.

    python scripts/lm_eval_check.py --lm-eval /path/to/venv/bin/lm_eval --model-dir models/tiny-llama \
        --base-url http://127.0.0.1:8000/v1 --served-name tiny-llama

Writes a small multiple-choice task (local JSON, no download), runs lm_eval's `local-completions` model on it with
--log_samples (it sends token id prompts with echo, logprobs 1 and max_tokens 1, and scores each choice by the logprobs
of its tokens), then recomputes every logged loglikelihood with raypd's embedded engine (prompt_logprobs) and with
transformers in fp32, and prints the largest differences. Exits 1 if any differs by more than --tolerance.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from raypd import LLM, SamplingParams

QUESTIONS = [
    ("The capital of France is", [" Paris", " Rome", " Berlin", " Madrid"], 0),
    ("Two plus two equals", [" four", " five", " three"], 0),
    ("The sky on a clear day is", [" blue", " green", " red"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit"], 0),
    ("The opposite of hot is", [" cold", " warm", " bright", " loud"], 0),
    ("A week has seven", [" days", " hours", " months"], 0),
]

TASK = """task: raypd_check_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def write_task(root: pathlib.Path) -> None:
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (root / "raypd_check_mc.yaml").write_text(TASK.format(data=data))


def run_lm_eval(lm_eval: str, root: pathlib.Path, args) -> list[dict]:
    model_args = (f"model={args.served_name},base_url={args.base_url}/completions,tokenizer={args.model_dir},"
                  f"tokenized_requests=True,num_concurrent=4,max_retries=1")
    subprocess.run([lm_eval, "--model", "local-completions", "--model_args", model_args, "--tasks",
                    "raypd_check_mc", "--include_path", str(root), "--log_samples", "--output_path",
                    str(root / "out")], check=True, timeout=args.timeout_s)
    samples = next((root / "out").rglob("samples_raypd_check_mc_*.jsonl"))
    return [json.loads(line) for line in samples.read_text().splitlines()]


def reference_logprobs(model_dir: str, pairs: list[tuple[str, str]]) -> tuple[list[float], list[float]]:
    """Sum of the continuation's token logprobs given the context: (raypd's embedded engine, transformers)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine_sums, hf_sums = [], []
    with LLM(model_dir, dtype="float32") as llm:
        for context, continuation in pairs:
            # as lm-eval splits a pair: the whole text's tokens, the context's own tokens first
            ids, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
            out = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
            engine_sums.append(sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(len(ctx), len(ids))))
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)  # (T, vocab)
            hf_sums.append(sum(logits[i - 1, ids[i]].item() for i in range(len(ctx), len(ids))))
    return engine_sums, hf_sums


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lm-eval", required=True, help="the lm_eval executable (in a venv of its own)")
    p.add_argument("--model-dir", required=True, help="the checkpoint the endpoint serves")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--served-name", required=True, help="the model name the endpoint serves")
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--timeout-s", type=float, default=600)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        write_task(root)
        samples = run_lm_eval(args.lm_eval, root, args)
    pairs, served = [], []
    for sample in samples:
        for request, resp in zip(sample["arguments"].values(), sample["resps"]):  # {"gen_args_i": {"arg_0": ...}}
            pairs.append((request["arg_0"], request["arg_1"]))
            served.append(float(resp[0][0]))
    engine, hf = reference_logprobs(args.model_dir, pairs)
    vs_engine = max(abs(a - b) for a, b in zip(served, engine))
    vs_hf = max(abs(a - b) for a, b in zip(served, hf))
    print(f"lm_eval local-completions: {len(samples)} questions, {len(pairs)} loglikelihood requests answered")
    print(f"largest |served - embedded engine| = {vs_engine:.2e}; |served - transformers fp32| = {vs_hf:.2e}")
    return 0 if max(vs_engine, vs_hf) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
