"""`make demo`: runs the embedded engine on a model and prints a completion (streamed)."""

from __future__ import annotations

import argparse

from raypd import LLM, SamplingParams


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m raypd.demo")
    parser.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    parser.add_argument("--prompt", default="The quick brown fox")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    with LLM(args.model) as llm:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        print(args.prompt, end="", flush=True)
        result = llm.generate_async(args.prompt, params, streaming=True)
        for step in result:
            print(step.outputs[0].text_diff, end="", flush=True)
        out = result.outputs[0]
        print(f"\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, ttft={result.metrics_dict['ttft'] * 1e3:.1f} ms]")


if __name__ == "__main__":
    main()
