"""A tiny checkpoint taught to answer one chat prompt with one reply: what a random-weight model cannot do, e.g. call
a tool by itself ("auto" tool choice), with the real weights, tokenizer and serving path."""

from __future__ import annotations

import shutil

import torch
import transformers


def teach(model_dir: str, out_dir, prompt: str, reply: str, steps: int = 300, lr: float = 3e-3) -> str:
    """Copies model_dir to out_dir and trains it until greedy decoding of prompt (chat-template text, BOS included)
    gives reply then EOS; returns out_dir. Raises if it has not learnt that within `steps`."""
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    target = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt_ids + target])  # (1, T)
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100  # learn the reply only
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        if step % 20 == 19 and _greedy(model, ids[0, : len(prompt_ids)], len(target)) == target:
            model.save_pretrained(out_dir)
            return str(out_dir)
    raise AssertionError(f"the model did not learn the reply in {steps} steps")


@torch.no_grad()
def _greedy(model, prompt: torch.Tensor, count: int) -> list[int]:
    model.eval()
    out = model.generate(prompt[None], max_new_tokens=count, do_sample=False, pad_token_id=0)
    model.train()
    return out[0, len(prompt):].tolist()
