"""Chaos soak: steady load on a deployment while its replicas are killed at random. Every stream its client did not
leave must end with exactly the tokens of a fault-free run, and once the load stops nothing may be left held.

    python -m benchmarks.soak [--minutes 15] [--model models/tiny-llava] [--concurrency 6] [--max-tokens 96]
                              [--faults decode,prefill,encoder,postproc] [--seed 0] [--json FILE]

deploys configs/local.yaml with the model on a local Ray, in float32 with batch-invariant engines (a seeded request's
tokens then depend on nothing but its seed: not on batching, chunking, or where it resumed after a fault; the
README's "Same tokens" says what holds without it), and runs `run_soak` against it:
- load: `concurrency` clients, each sending one request after another: greedy streams, seeded non-streamed requests
  with n=2 at temperature 0.8, chat streams with an image (where the model has a vision tower), and clients that
  leave a stream after a few chunks;
- faults: every few seconds (`interval_s`) one of `faults` in turn, each round of them shuffled: SIGKILL of a Serve
  replica of that role (Serve starts another) or of a postproc worker (Ray restarts it); a killed prefill replica
  takes the KV its leases hold, some of it mid-read. The next fault waits until /health answers 200 again. With
  `min_faults_each` the load goes on past its duration (at most to twice it) until every kind was injected so often.
- after the load: the fault-free tokens of every request from the embedded engine (`EmbeddedReference`), then every
  role's KV blocks in use, leases and embedding leases must return to 0 (`leaks`), and no actor process the load
  killed may be left running (`processes`: every process titled as a Ray actor runs a live actor, as before).
It prints the figures: duration, requests by kind, faults by kind, streams identical, altered, lost (an error or a
wrong finish), left by their clients, and what was still held. tests/cluster/serving/test_faults.py runs it on its
deployment for about two minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import io
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

KINDS = ("greedy", "seeded", "image", "leaves")
FAULTS = ("decode", "prefill", "encoder", "postproc")
_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches near old "
          "rivers and tall mountains under bright stars").split()
_HEALTHY_WITHIN_S = 120.0  # a restarted replica loads its model and meets its peers well within this
_DRAINED_WITHIN_S = 45.0  # leases end when read or released; a lost one when its lease (30 s) expires


@dataclass(frozen=True)
class SoakRequest:
    index: int
    kind: str  # one of KINDS
    prompt: str
    max_tokens: int
    seed: int | None = None  # "seeded" only
    image_seed: int | None = None  # "image" only: random_image(image_seed) is its picture
    leave_after: int = 0  # "leaves" only: chunks read before the client goes away


@dataclass
class Outcome:
    request: SoakRequest
    texts: list[str] = field(default_factory=list)  # by choice index
    reasons: list[str | None] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


@dataclass
class SoakReport:
    duration_s: float
    requests: dict[str, int]  # by kind
    faults: dict[str, int]  # injected, by kind
    identical: int
    altered: list[int]  # request indices whose text differs from the fault-free run
    lost: list[str]  # an error or a finish other than "length", per request
    left: int  # streams their clients left
    leaks: dict[str, dict[str, float]]  # role -> what was still held after the load (empty: nothing)
    processes: list[str]  # actor processes left behind, each "title (pid, state, parent, age)" (empty: none)
    reprefills: float  # hand-offs whose KV read failed and were prefilled again on the decode side
    resumed: float  # candidates resumed elsewhere after a fault (the ingress's count)
    slowest_s: float  # the longest request

    @property
    def ok(self) -> bool:
        return not (self.altered or self.lost or self.leaks or self.processes)

    def table(self) -> str:
        rows = [("duration", f"{self.duration_s:.0f} s"),
                ("requests", ", ".join(f"{n} {k}" for k, n in self.requests.items())),
                ("faults injected", ", ".join(f"{n} {k}" for k, n in self.faults.items()) or "none"),
                ("completed identical", str(self.identical)), ("altered", str(len(self.altered))),
                ("lost", str(len(self.lost))), ("left by their clients", str(self.left)),
                ("KV reads failed over to re-prefill", f"{self.reprefills:.0f}"),
                ("resumed elsewhere", f"{self.resumed:.0f}"), ("slowest request", f"{self.slowest_s:.1f} s"),
                ("left held after the load", json.dumps(self.leaks) if self.leaks else "nothing"),
                ("actor processes left behind", json.dumps(self.processes) if self.processes else "none")]
        return "\n".join(f"{name:<36} {value}" for name, value in rows)


# ---- the workload ----

def make_requests(seed: int, max_tokens: int, images: bool) -> Iterator[SoakRequest]:
    """Requests without end, kinds in a seeded order (images only where the model takes them); prompts of 4-60
    words, no two alike, so no request is served from another's cache unless they share words by chance."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS if images or k != "image"]
    for i in itertools.count():
        kind = kinds[rng.randrange(len(kinds))]
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 60)))
        yield SoakRequest(i, kind, f"soak {seed}-{i}: {words}", max_tokens,
                          seed=rng.randrange(1 << 30) if kind == "seeded" else None,
                          image_seed=rng.randrange(1 << 30) if kind == "image" else None,
                          leave_after=rng.randint(1, 8) if kind == "leaves" else 0)


def random_image(seed: int):
    """A small noise picture (PIL), its size from the seed."""
    import numpy as np
    from PIL import Image

    rs = np.random.RandomState(seed)
    return Image.fromarray(rs.randint(0, 256, (rs.randint(20, 64), rs.randint(20, 64), 3), dtype=np.uint8))


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _body(r: SoakRequest, model: str) -> tuple[str, dict]:
    """(path, JSON body) of the request."""
    common = {"model": model, "max_tokens": r.max_tokens, "ignore_eos": True}
    if r.kind == "seeded":
        return "/v1/completions", {**common, "prompt": r.prompt, "n": 2, "seed": r.seed, "temperature": 0.8}
    if r.kind == "image":
        content = [{"type": "text", "text": r.prompt},
                   {"type": "image_url", "image_url": {"url": _data_url(random_image(r.image_seed))}}]
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": content}],
                                        "temperature": 0, "stream": True}
    return "/v1/completions", {**common, "prompt": r.prompt, "temperature": 0, "stream": True}


# ---- the clients ----

async def _send(http: httpx.AsyncClient, r: SoakRequest, model: str) -> Outcome:
    out, start = Outcome(r), time.monotonic()
    path, body = _body(r, model)
    try:
        if body.get("stream"):
            await _stream(http, path, body, out)
        else:
            rsp = await http.post(path, json=body)
            await _refused(rsp)
            choices = sorted(rsp.json()["choices"], key=lambda c: c["index"])
            out.texts, out.reasons = [c["text"] for c in choices], [c["finish_reason"] for c in choices]
    except Exception as exc:  # counted as lost (the soak asserts there are none)
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    out.seconds = time.monotonic() - start
    return out


async def _refused(rsp: httpx.Response) -> None:
    """Raises, naming the status and the server's message, if the request was refused."""
    if rsp.status_code >= 400:
        await rsp.aread()
        raise RuntimeError(f"HTTP {rsp.status_code}: {rsp.text[:240]}")


async def _stream(http: httpx.AsyncClient, path: str, body: dict, out: Outcome) -> None:
    out.texts, out.reasons = [""], [None]
    chunks = 0
    async with http.stream("POST", path, json=body) as rsp:
        await _refused(rsp)
        async for line in rsp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:  # how a failed stream ends (after a finish_reason "error" chunk)
                out.error = str(data["error"].get("message"))[:300]
            for choice in data.get("choices", []):
                out.texts[0] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                out.reasons[0] = choice.get("finish_reason") or out.reasons[0]
            chunks += 1
            if out.request.leave_after and chunks >= out.request.leave_after:
                return  # the client leaves: closing the response cancels the request


async def _client(http, requests: Iterator[SoakRequest], outcomes: list[Outcome], load: asyncio.Event,
                  model: str) -> None:
    while load.is_set():
        outcomes.append(await _send(http, next(requests), model))


# ---- the faults ----

class Chaos:
    """Kills one replica at a time: rounds of `faults` in a shuffled order, `interval_s` apart (uniform), each once
    the deployment is back at full strength (`recovered`), so that faults never overlap."""

    def __init__(self, app: str, base_url: str, faults: tuple[str, ...], interval_s: tuple[float, float], seed: int):
        from cluster.serving.directory import Directory

        self.app, self.base_url, self.faults, self.interval_s = app, base_url, faults, interval_s
        self.rng = random.Random(seed)
        self.injected: Counter = Counter()
        self.directory = Directory(app)  # one reader throughout: it tells a killed replica's entry by its age
        self.strength = {kind: len(self._actors(kind)) for kind in faults}
        for kind in faults:
            self.directory.entries(kind)

    def done(self, min_each: int) -> bool:
        return all(self.injected[kind] >= min_each for kind in self.faults)

    async def run(self, until: float, min_each: int = 0, cap: float = float("inf")) -> None:
        """Until `until`, and past it (never past `cap`) until each fault was injected min_each times."""
        order: list[str] = []
        while True:
            await asyncio.sleep(self.rng.uniform(*self.interval_s))
            now = time.monotonic()
            if now >= cap or (now >= until and self.done(min_each)):
                return
            if not order:
                order = self.rng.sample(self.faults, len(self.faults))
            kind = order.pop()
            killed = await asyncio.to_thread(self.kill, kind)
            self.injected[kind] += 1
            await self.recovered(kind, killed, _HEALTHY_WITHIN_S)

    def _actors(self, kind: str) -> list[str]:
        if kind == "postproc":
            from cluster.serving.app import POSTPROC_NAMESPACE, POSTPROC_PREFIX

            return _named_actors(POSTPROC_PREFIX, POSTPROC_NAMESPACE)
        return _named_actors(f"SERVE_REPLICA::{self.app}#{kind}#", "serve")

    def kill(self, kind: str) -> str:
        """SIGKILLs one actor of the kind; its name."""
        import ray

        name = self.rng.choice(self._actors(kind))
        if kind == "postproc":
            from cluster.serving.app import POSTPROC_NAMESPACE

            ray.kill(ray.get_actor(name, namespace=POSTPROC_NAMESPACE), no_restart=False)  # Ray restarts it
        else:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)  # Serve starts another
        return name

    async def recovered(self, kind: str, killed: str, within_s: float) -> None:
        """Waits until the kind is back at full strength (a killed replica gone from the directory and as many live
        there as before; a postproc worker answering again), then for /health's 200."""
        deadline = time.monotonic() + within_s
        while not await asyncio.to_thread(self._whole, kind, killed):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind} not back at {self.strength[kind]} within {within_s:.0f} s of a kill")
            await asyncio.sleep(0.3)
        while kind == "postproc" and not await asyncio.to_thread(_answers, killed, 2.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"postproc worker {killed} not back within {within_s:.0f} s of a kill")
            await asyncio.sleep(0.3)
        await healthy(self.base_url, max(1.0, deadline - time.monotonic()))

    def _whole(self, kind: str, killed: str) -> bool:
        try:
            actors = self._actors(kind)
        except RuntimeError:  # none live this moment
            return False
        if kind == "postproc":
            return len(actors) >= self.strength[kind]
        live = {e.replica_id for e in self.directory.entries(kind)}
        return (len(actors) >= self.strength[kind] and killed.rsplit("#", 1)[1] not in live
                and len(live) >= self.strength[kind])


def _answers(postproc: str, timeout_s: float) -> bool:
    """Whether the (restarted) postproc worker answers a call."""
    import ray

    from cluster.serving.app import POSTPROC_NAMESPACE

    try:
        ray.get(ray.get_actor(postproc, namespace=POSTPROC_NAMESPACE).__ray_ready__.remote(), timeout=timeout_s)
        return True
    except Exception:  # restarting: ActorUnavailableError, GetTimeoutError
        return False


def _named_actors(prefix: str, namespace: str) -> list[str]:
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == namespace and a["name"].startswith(prefix))
    if not names:
        raise RuntimeError(f"no live actor named {prefix}* to kill")
    return names


async def healthy(base_url: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient(base_url=base_url, timeout=5) as http:
        while True:
            try:
                if (await http.get("/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the deployment did not answer /health with 200 within {within_s:.0f} s")
            await asyncio.sleep(0.3)


# ---- what must hold afterwards ----

class EmbeddedReference:
    """The fault-free tokens: the embedded engine (raypd.LLM) with the deployment's numerics (float32,
    batch-invariant), on the prompt the ingress renders."""

    def __init__(self, llm):
        self.llm = llm

    def texts(self, requests: list[SoakRequest]) -> list[list[str]]:
        from raypd import SamplingParams

        prompts, params = [], []
        for r in requests:
            prompts.append(self._prompt(r))
            params.append(SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, n=2 if r.kind == "seeded" else 1,
                                         temperature=0.8 if r.kind == "seeded" else 0.0, seed=r.seed))
        outputs = self.llm.generate(prompts, params, use_tqdm=False) if prompts else []
        return [[o.text for o in sorted(out.outputs, key=lambda o: o.index)] for out in outputs]

    def _prompt(self, r: SoakRequest):
        if r.kind != "image":
            return r.prompt
        tok = self.llm.tokenizer
        message = {"role": "user", "content": [{"type": "text", "text": r.prompt}, {"type": "image"}]}
        text = tok.apply_chat_template([message], add_generation_prompt=True, tokenize=False)
        return {"prompt_token_ids": tok.encode(text, add_special_tokens=False),
                "multi_modal_data": {"image": [random_image(r.image_seed)]}}


def held(directory) -> dict[str, dict[str, float]]:
    """What each role's live replicas still hold (KV blocks in use, leases, embedding leases), read from the replica
    directory (a `Directory`: the same reader each time, since it tells a killed replica's entry by its counter
    standing still for STALE_S); only the non-zero counts."""
    out = {}
    for role, names in (("prefill", ("kv_blocks_in_use", "kv_leases")), ("decode", ("kv_blocks_in_use", "kv_leases")),
                        ("encoder", ("encoder_leases",))):
        totals = directory.totals(role)
        found = {n: totals[n] for n in names if totals.get(n)}
        if found:
            out[role] = found
    return out


async def _drained(app: str, strays: set[int], within_s: float) -> tuple[dict, list[str]]:
    """What is still held, and the actor processes left behind (`stray_processes` not there before the load), once
    both are back to nothing or after within_s (the first reads still count replicas killed in the last seconds:
    their entries go stale within STALE_S, and a killed process may not have exited yet)."""
    from cluster.serving.directory import Directory

    directory, deadline = Directory(app), time.monotonic() + within_s
    while True:
        left = held(directory)
        behind = {pid: title for pid, title in stray_processes().items() if pid not in strays}
        if not (left or behind) or time.monotonic() > deadline:
            return left, [f"{title} {_described(pid)}" for pid, title in behind.items()]
        await asyncio.sleep(0.5)


def stray_processes() -> dict[int, str]:
    """pid -> title of this host's processes titled as a Ray actor class (ray::<class>) that no live actor runs in:
    what a killed actor leaves behind if its process outlives it. The soak runs on this host's Ray (all its nodes
    here). Compared with Ray's actor table, not with a count taken before: a worker Ray is still restarting then
    would show as one more later."""
    from ray._private import state  # the actor table with pids; the public state API needs the dashboard

    actors = state.actors().values()
    classes = {a["ActorClassName"] for a in actors}
    live = {a["Pid"] for a in actors if a["State"] == "ALIVE"}
    return {pid: title for pid, title in actor_processes().items()
            if title.removeprefix("ray::") in classes and pid not in live}


def _described(pid: int) -> str:
    """A process's pid, state, parent and age, for a report."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return f"(pid {pid}, state {fields[0]}, parent {fields[1]}, {age:.0f} s old)"
    except (OSError, IndexError, ValueError):
        return f"(pid {pid}, gone)"


def actor_processes() -> dict[int, str]:
    """This host's Ray worker processes that run an actor, pid -> title (ray::<class>; a busy actor's title also
    names its method, left out here), idle workers aside."""
    import os

    titles: dict[int, str] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if title.startswith("ray::") and not title.startswith("ray::IDLE"):
            titles[int(pid)] = title.split()[0].split(".")[0]
    return titles


async def _counter(base_url: str, needle: str) -> float:
    """The sum of /metrics lines that contain needle."""
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        text = (await http.get("/metrics")).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if needle in line and not line.startswith("#"))


# ---- the run ----

@dataclass(frozen=True)
class SoakConfig:
    base_url: str
    app: str
    model: str  # the served model name
    duration_s: float
    faults: tuple[str, ...] = FAULTS
    concurrency: int = 6
    max_tokens: int = 96
    interval_s: tuple[float, float] = (3.0, 8.0)
    images: bool = False
    seed: int = 0
    api_key: str | None = None
    min_faults_each: int = 0  # past duration_s (at most to twice it) until each fault kind was injected this often


async def arun_soak(config: SoakConfig, reference: EmbeddedReference) -> SoakReport:
    start = time.monotonic()
    until = start + config.duration_s
    requests = make_requests(config.seed, config.max_tokens, config.images)
    outcomes: list[Outcome] = []
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    before = [await _counter(config.base_url, n) for n in ('what="num_reprefills"', 'what="resumed"')]
    strays = set(stray_processes())
    chaos = Chaos(config.app, config.base_url, config.faults, config.interval_s, config.seed)
    load = asyncio.Event()
    load.set()

    async def faults() -> None:
        try:
            await chaos.run(until, config.min_faults_each, start + 2 * config.duration_s)
        finally:
            load.clear()  # the clients finish the requests they are in, then stop

    async with httpx.AsyncClient(base_url=config.base_url, headers=headers, timeout=httpx.Timeout(300.0),
                                 limits=httpx.Limits(max_connections=config.concurrency + 4)) as http:
        await asyncio.gather(faults(), *(_client(http, requests, outcomes, load, config.model)
                                         for _ in range(config.concurrency)))
    duration = time.monotonic() - start
    leaks, extra = await _drained(config.app, strays, _DRAINED_WITHIN_S)
    after = [await _counter(config.base_url, n) for n in ('what="num_reprefills"', 'what="resumed"')]
    return _report(outcomes, reference, dict(chaos.injected), duration, (leaks, extra), after[0] - before[0],
                   after[1] - before[1])


def _report(outcomes: list[Outcome], reference: EmbeddedReference, faults: dict, duration: float,
            left_over: tuple[dict, list[str]], reprefills: float, resumed: float) -> SoakReport:
    left = [o for o in outcomes if o.request.leave_after and o.error is None]
    kept = [o for o in outcomes if not o.request.leave_after or o.error is not None]
    lost = [f"request {o.request.index} ({o.request.kind}): {o.error or o.reasons}" for o in kept
            if o.error is not None or any(r != "length" for r in o.reasons)]
    finished = [o for o in kept if o.error is None and all(r == "length" for r in o.reasons)]
    want = reference.texts([o.request for o in finished])
    altered = [o.request.index for o, w in zip(finished, want) if o.texts != w]
    return SoakReport(duration, dict(Counter(o.request.kind for o in outcomes)), faults,
                      len(finished) - len(altered), altered, lost, len(left), *left_over, reprefills, resumed,
                      max((o.seconds for o in outcomes), default=0.0))


def run_soak(config: SoakConfig, reference: EmbeddedReference) -> SoakReport:
    return asyncio.run(arun_soak(config, reference))


# ---- the command ----

def _deployment(args: argparse.Namespace):
    """configs/local.yaml with the model, float32 and batch-invariant engines, on a free port."""
    import socket

    import yaml

    from cluster.config import parse_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(args.config) as f:
        raw = yaml.safe_load(f)
    raw.update(model=args.model, dtype="float32", http={"host": "127.0.0.1", "port": port})
    raw["engine"].update(batch_invariant=True)
    return parse_config(raw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--model", default="models/tiny-llava")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"any of {', '.join(FAULTS)}")
    p.add_argument("--interval", default="3,8", help="seconds between faults: MIN,MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    import ray
    from ray import serve

    from cluster.serving.app import deploy
    from raypd import LLM

    config = _deployment(args)
    faults = tuple(f for f in args.faults.split(",") if config.has_vision_tower or f != "encoder")
    ray.init(include_dashboard=False, namespace="raypd", logging_level="WARNING")
    serve.start(http_options={"host": "127.0.0.1", "port": config.http.port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    deploy(config, "raypd-soak", logging_config={"log_level": "WARNING", "enable_access_log": False})
    base = f"http://127.0.0.1:{config.http.port}"
    asyncio.run(healthy(base, _HEALTHY_WITHIN_S))
    low, high = (float(x) for x in args.interval.split(","))
    soak = SoakConfig(base, "raypd-soak", config.model_name, args.minutes * 60, faults, args.concurrency,
                      args.max_tokens, (low, high), config.has_vision_tower, args.seed, min_faults_each=2)
    with LLM(args.model, dtype="float32", batch_invariant=True, num_threads=1,
             block_size=config.engine.block_size) as llm:
        report = run_soak(soak, EmbeddedReference(llm))
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dataclasses.asdict(report), f, indent=1)
    serve.shutdown()
    ray.shutdown()
    return 0 if report.ok else 1


if __name__ == "__main__":  # also: python -m benchmarks.soak
    raise SystemExit(main())
