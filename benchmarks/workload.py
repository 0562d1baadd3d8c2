"""The workloads `raypd bench` sends and `raypd plan` simulates: seeded prompts, lengths and arrival times.

A function of the config alone: the same seed gives the same prompts, lengths and arrival times, so one process can
measure several endpoints on one workload, and the planner can simulate the very requests a benchmark would send.
Plain Python: the planner (cluster/planning) imports it, so it imports nothing of the project.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Common short English words: most are one token in any BPE vocabulary, so a prompt of N words is roughly N tokens.
_WORDS = tuple("""the of and to in is it you that he was for on are with as his they be at one have this from or had by
word but what some we can out other were all there when up use your how said an each she which do their time if will way
about many then them write would like so these her long make thing see him two has look more day could go come did
number sound no most people my over know water than call first who may down side been now find any new work part take
get place made live where after back little only round man year came show every good me give our under name very through
just form great think say help low line differ turn cause much mean before move right boy old too same tell does set
three want air well also play small end put home read hand port large spell add even land here must big""".split())


@dataclass(frozen=True)
class BenchConfig:
    base_url: str  # the API root, e.g. http://127.0.0.1:8000/v1 (as the openai client takes it)
    model: str
    num_requests: int = 100
    request_rate: float = math.inf  # requests per second, Poisson arrivals; inf: all at t=0
    concurrency: int | None = None  # most requests in flight; None: no cap
    input_len: int = 128  # prompt words
    output_len: int = 128  # max_tokens (ignore_eos asks the server to generate all of them)
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    request_timeout_s: float = 120.0  # each request's total budget, from being sent to its last chunk
    num_warmups: int = 0  # requests sent one at a time before the measured run, not recorded
    api_key: str | None = None
    workload: str = "random"  # random: independent prompts; chat: multi-turn conversations (module docstring)
    num_turns: int = 4  # chat: requests per conversation; num_requests / num_turns conversations
    system_len: int = 256  # chat: words of the system prompt every conversation starts with

    def __post_init__(self) -> None:
        for name in ("num_requests", "input_len", "output_len", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bench {name}: must be > 0, got {getattr(self, name)}")
        if not self.request_rate > 0:
            raise ValueError(f"bench request_rate: must be > 0 (inf: all at once), got {self.request_rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"bench concurrency: must be >= 1, got {self.concurrency}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"bench range_ratio: must be in [0, 1), got {self.range_ratio}")
        if self.num_warmups < 0:
            raise ValueError(f"bench num_warmups: must be >= 0, got {self.num_warmups}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"bench workload: must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.workload == "chat" and (self.num_turns < 1 or self.num_requests % self.num_turns):
            raise ValueError(f"bench num_turns: must be >= 1 and divide num_requests ({self.num_requests}), "
                              f"got {self.num_turns}")
        if self.system_len < 0:
            raise ValueError(f"bench system_len: must be >= 0, got {self.system_len}")


WORKLOADS = ("random", "chat")


@dataclass(frozen=True)
class RequestSpec:
    prompt: str  # chat: the new user message only (the conversation so far goes before it)
    prompt_words: int
    max_tokens: int
    arrival_s: float  # offset from the start of the run; chat: of the conversation's first turn
    conversation: int = 0  # chat: which conversation, and the turn within it
    turn: int = 0


@dataclass(frozen=True)
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float

    @staticmethod
    def of(values: list[float]) -> Percentiles | None:
        if not values:
            return None
        ordered = sorted(values)
        return Percentiles(sum(ordered) / len(ordered), *(_quantile(ordered, q) for q in (0.5, 0.9, 0.99)))


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on an already sorted list."""
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def make_workload(config: BenchConfig) -> list[RequestSpec]:
    """The prompts, lengths and arrival times of a run: a function of the config alone (seeded). chat: the user
    messages, turn by turn, each conversation's turns together and in order."""
    # One generator per aspect, so a different request rate does not change the prompts, nor the lengths the arrivals.
    lengths, words, arrivals = (random.Random(f"{config.seed}-{what}") for what in ("lengths", "words", "arrivals"))
    turns = config.num_turns if config.workload == "chat" else 1
    specs, now = [], 0.0
    for i in range(config.num_requests):
        n_in = _length(lengths, config.input_len, config.range_ratio)
        n_out = _length(lengths, config.output_len, config.range_ratio)
        specs.append(RequestSpec(" ".join(words.choices(_WORDS, k=n_in)), n_in, n_out, now, i // turns, i % turns))
        if math.isfinite(config.request_rate) and i % turns == turns - 1:
            now += arrivals.expovariate(config.request_rate)
    return specs


def system_prompt(config: BenchConfig) -> str:
    """The chat workload's shared system prompt (seeded, like the rest of the workload)."""
    return " ".join(random.Random(f"{config.seed}-system").choices(_WORDS, k=config.system_len))


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    low = max(1, round(mean * (1 - ratio)))
    return rng.randint(low, max(low, round(mean * (1 + ratio))))
