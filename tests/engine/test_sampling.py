"""Penalties, min_p, logit_bias and grammars in the engine's sampler, against transformers' logits processors and a
direct reference of OpenAI's presence/frequency penalties, token for token in fp32 (greedy and seeded)."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, MinPLogitsWarper,
                          RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from engine.core.engine import EngineConfig, LLMEngine
from engine.sampling.sampler import SampleRow, _row_generator
from llmapi import GuidedDecodingParams, SamplingParams
from llmapi.outputs import Resume, ResumedCandidate
from tests.engine.parity import Reference, assert_same_tokens
from tests.engine.test_engine import prompts, run

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b", "c"]}},
    "required": ["name", "age", "ok", "tag"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(tiny_llama, EngineConfig(block_size=4))


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def generated(engine, batch, params) -> list[list[int]]:
    got = run(engine, {0: [(i, p, params) for i, p in enumerate(batch)]})
    return [got[i][k][0] for i in range(len(batch)) for k in range(params.num_candidates)]


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_greedy_repetition_penalty_matches_transformers_generate(tiny_llama, engine, penalty):
    ref = Reference(tiny_llama)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=penalty)
    batch = prompts(3, 4, 20, vocab=300, seed=7)  # a small id range: prompt tokens recur in the output
    ours = generated(engine, batch, params)
    plain = generated(engine, batch, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert ours != plain, "the penalty changed nothing: the test would not see it applied wrongly"
    for i, p in enumerate(batch):
        out = ref.model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, repetition_penalty=penalty,
                                 output_scores=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        gaps = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
        assert_same_tokens(ours[i], out.sequences[0, len(p):].tolist(), gaps, f"prompt {i}")


def openai_penalties(frequency: float, presence: float):
    """The direct reference of OpenAI's penalties (vLLM's formula) over the generated tokens, as a processor."""
    def apply(ids: torch.Tensor, scores: torch.Tensor, num_prompt: int) -> torch.Tensor:
        counts = torch.zeros(scores.shape[-1])
        for t in ids[num_prompt:].tolist():
            counts[t] += 1
        return scores - frequency * counts - presence * (counts > 0).float()
    return apply


def reference_run(hf, prompt, params: SamplingParams, index: int = 0) -> list[int]:
    """transformers' forward and logits processors (repetition, temperature, top-k, top-p, min-p), the OpenAI
    penalties' reference, and a seeded inverse-CDF draw (one uniform from the row's generator), step by step over the whole sequence."""
    warpers = LogitsProcessorList()
    if params.repetition_penalty != 1:
        warpers.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
    penalties = openai_penalties(params.frequency_penalty, params.presence_penalty)
    sampling = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        sampling.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        sampling.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        sampling.append(MinPLogitsWarper(params.min_p))
    ids = torch.tensor([prompt])
    for _ in range(params.max_tokens):
        with torch.inference_mode():
            logits = hf(ids).logits[:, -1].float()  # (1, vocab)
        scores = penalties(ids[0], warpers(ids, logits)[0], len(prompt))[None]
        probs = torch.softmax(sampling(ids, scores)[0], dim=-1)
        gen = _row_generator(SampleRow(params, index, ids.shape[1]))
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        target = torch.rand(1, generator=gen, dtype=torch.float64) * cdf[-1]
        token = int((cdf <= target).sum())  # the first token whose cumulative probability exceeds the target
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("extra", [
    dict(repetition_penalty=3.0),
    dict(min_p=0.3),
    dict(frequency_penalty=2.0, presence_penalty=2.0),
    dict(repetition_penalty=0.5, frequency_penalty=-1.0, presence_penalty=1.0, min_p=0.2, top_k=50, top_p=0.9),
], ids=["repetition", "min_p", "frequency_presence", "all"])
def test_seeded_penalties_and_min_p_match_transformers_processors(engine, hf, extra):
    params = SamplingParams(max_tokens=16, temperature=0.5, seed=3, n=2, ignore_eos=True, **extra)
    batch = prompts(2, 4, 12, vocab=300, seed=9)
    ours = generated(engine, batch, params)
    plain = generated(engine, batch, SamplingParams(max_tokens=16, temperature=0.5, seed=3, n=2, ignore_eos=True))
    assert ours != plain, "the feature changed nothing: the test would not see it applied wrongly"
    for i, p in enumerate(batch):
        for k in range(2):
            assert ours[2 * i + k] == reference_run(hf, p, params, k), f"prompt {i} candidate {k}"


def test_logit_bias_forces_and_bans_tokens(engine):
    batch = prompts(2, 5, 10, seed=4)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = generated(engine, batch, greedy)
    forced = generated(engine, batch, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                      logit_bias={1234: 100}))
    assert forced == [[1234] * 8] * 2
    banned_ids = {t: -100 for out in plain for t in out}
    banned = generated(engine, batch, SamplingParams(max_tokens=8, temperature=0.7, seed=1, ignore_eos=True,
                                                      logit_bias=banned_ids))
    assert all(t not in banned_ids for out in banned for t in out)


def test_json_schema_outputs_parse_and_validate(engine, tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    batch = [tok.encode(t) for t in ("Give me a person:", "café 你好", "1 2 3")]
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=2, n=3, repetition_penalty=1.1,
                            guided_decoding=GuidedDecodingParams(json=SCHEMA))
    got = run(engine, {0: [(i, p, params) for i, p in enumerate(batch)]})
    for i in range(len(batch)):
        for k in range(3):
            text = tok.decode(got[i][k][0], skip_special_tokens=True)
            jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_regex(engine, tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok.encode("JSON:")
    for seed in range(3):
        params = SamplingParams(max_tokens=200, temperature=0.7, seed=seed,
                                guided_decoding=GuidedDecodingParams(json_object=True))
        text = tok.decode(run(engine, {0: [(0, prompt, params)]})[0][0][0], skip_special_tokens=True)
        assert isinstance(json.loads(text), dict), text
    regex = GuidedDecodingParams(regex=r"[ab]{3}-\d")
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=0, guided_decoding=regex)
    tokens = run(engine, {0: [(0, prompt, params)]})[0][0][0]
    assert re.fullmatch(r"[ab]{3}-\d", tok.decode(tokens, skip_special_tokens=True))


def test_a_resumed_candidate_replays_its_grammar(engine, tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = tok.encode("person:")
    params = SamplingParams(max_tokens=80, temperature=0, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    whole = run(engine, {0: [(0, prompt, params)]})[0][0][0]
    engine.add_request(1, prompt, params, resume=Resume((ResumedCandidate(0, tuple(whole[:5]), 0.0),)))
    rest = []
    while engine.has_unfinished_requests():
        for rsp in engine.step():
            rest.extend(t for d in rsp.deltas for t in d.token_ids)
    assert whole[:5] + rest == whole


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={"5": 1}), "logit_bias"), (dict(logit_bias={5: 101}), "logit_bias[5]"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field.replace('[', '.').replace(']', '.')}"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, problem", [
    (dict(json={"type": "foo"}), "json is not a valid grammar"), (dict(json="{nope"), "json is not JSON"),
    (dict(regex="[a-"), "regex is not a valid grammar"), (dict(), "exactly one"),
    (dict(json={"type": "object"}, regex="a"), "exactly one"),
])
def test_malformed_grammars_are_refused(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        GuidedDecodingParams(**kwargs)


def test_logit_bias_out_of_vocab_is_refused(engine):
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request(99, [5, 6], SamplingParams(logit_bias={engine.spec.vocab_size: 1.0}))
    assert not engine.has_unfinished_requests()


def test_a_grammar_without_a_tokenizer_is_refused_by_name(tmp_path, tiny_llama):
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(f"{tiny_llama}/{name}", tmp_path / name)
    engine = LLMEngine(str(tmp_path), EngineConfig(block_size=4))
    with pytest.raises(ValueError, match="guided_decoding needs the tokenizer"):
        engine.add_request(0, [5, 6], SamplingParams(guided_decoding=GuidedDecodingParams(json_object=True)))
    engine.add_request(1, [5, 6], SamplingParams(max_tokens=2))  # the engine still serves
    assert run(engine, {0: []})[1][0][0]


@pytest.mark.parametrize("fused", [False, True])
def test_unseeded_rows_drawn_together_follow_each_rows_distribution(fused):
    """Unseeded rows without top-k/top-p/min-p are drawn together (inverse CDF), by torch ops or the fused C++
    kernel; each row keeps its own temperature, and a token without probability (masked by a logit bias or a
    grammar) is never drawn."""
    from engine.model.kernels import cpu_kernels
    from engine.sampling.sampler import Sampler

    kernels = cpu_kernels() if fused else None
    if fused and kernels is None:
        pytest.skip("no C++ kernels on this machine")
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]] * 3)  # (3, vocab 5): the last token is masked
    params = [SamplingParams(temperature=1.0, max_tokens=1), SamplingParams(temperature=0.5, max_tokens=1),
              SamplingParams(temperature=0.0, max_tokens=1)]
    rows = [SampleRow(p, 0, 0) for p in params]
    sampler, draws = Sampler(seed=0, kernels=kernels), 4000
    counts = torch.zeros(3, 5)
    for _ in range(draws):
        for r, sample in enumerate(sampler(logits, rows)):
            counts[r, sample.token_id] += 1
    for r, temp in enumerate((1.0, 0.5)):
        expected = torch.softmax(logits[r] / temp, dim=-1)
        assert torch.allclose(counts[r] / draws, expected, atol=0.03), (r, counts[r] / draws, expected)
    assert counts[:, 4].sum() == 0  # the masked token, never
    assert counts[2, 0] == draws  # the greedy row is not drawn


def test_a_rows_draw_does_not_depend_on_its_neighbours():
    """A seeded row is sampled the same way (the fused pass, here) whether the step's other rows need the torch path
    (top logprobs, a penalty) or not: token and logprob bit for bit, over many draws. Both paths weigh tokens a little
    differently, so a draw near a boundary would otherwise flip with the batch it lands in."""
    from engine.model.kernels import cpu_kernels
    from engine.sampling.sampler import Sampler

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ kernels on this machine")
    sampler = Sampler(seed=0, kernels=kernels)
    gen = torch.Generator().manual_seed(3)
    neighbours = [SamplingParams(temperature=0.8, max_tokens=1, logprobs=2),
                  SamplingParams(temperature=0.8, max_tokens=1, frequency_penalty=0.5)]
    for position in range(200):
        logits = torch.randn(2, 4096, generator=gen) * 3  # (2, vocab)
        row = SampleRow(SamplingParams(temperature=0.8, seed=9, n=2, max_tokens=1), 1, position)
        alone = sampler(logits[:1], [row])[0]
        for other in neighbours:
            beside = sampler(logits, [row, SampleRow(other, 0, position, token_ids=[5, 6])])[0]
            assert (beside.token_id, beside.logprob) == (alone.token_id, alone.logprob), (position, other)
