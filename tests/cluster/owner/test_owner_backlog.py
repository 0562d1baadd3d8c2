"""The request owner's load, which conditional disaggregation weighs: its prefill backlog (router.max_prefill_backlog_
tokens), counted while a prompt waits at a prefill replica and released however its prefill call ends, and whether it
serves anything else (router.local_prefill_when_idle). The roles here
are plain async generators standing in for the deployments; the owner, its records and LocalPrefill are the real
ones."""

import asyncio

import pytest
from transformers import AutoTokenizer

from cluster.routing.local_prefill import LocalPrefill
from cluster.owner.owner import NotAccepted, RequestOwner
from llmapi.outputs import RequestDelta, TokenDelta
from llmapi.sampling_params import SamplingParams
from protocol import Accepted

CONTROL = ("tcp://127.0.0.1:9", None)  # never written to: nothing here is aborted


def _last_token(request_id: int) -> RequestDelta:
    return RequestDelta(request_id, (TokenDelta(0, (5,), -0.5, finish_reason="length"),), finished=True)


class Roles:
    colocated = False

    def __init__(self):
        self.release_prefill = asyncio.Event()
        self.calls: list[tuple[str, int]] = []
        self.prefill_down = False
        self.generate_gate: asyncio.Event | None = None  # set: generate holds each call until it is set

    async def encode(self, result, images):
        raise AssertionError("no images here")

    def call(self, role, submit):
        if submit.kind == "context_only":
            return self._prefill(submit.request_id)
        assert submit.disaggregated_params is None  # a whole request: prefilled where it decodes
        return self._generate(role, submit.request_id)

    async def _prefill(self, request_id):
        self.calls.append(("prefill", request_id))
        if self.prefill_down:
            raise NotAccepted("no replica took the call")
        yield Accepted(CONTROL)
        await self.release_prefill.wait()
        yield _last_token(request_id)  # its only candidate ended with the first token: nothing to decode

    async def _generate(self, role, request_id):
        self.calls.append((role, request_id))
        yield Accepted(CONTROL)
        if self.generate_gate is not None:
            await self.generate_gate.wait()
        yield _last_token(request_id)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def _submit(owner: RequestOwner, n_tokens: int):
    result, record = owner.create(list(range(10, 10 + n_tokens)), SamplingParams(max_tokens=1))
    return result, asyncio.ensure_future(owner.run(result, record))


def test_prompts_arriving_while_the_prefill_role_is_backed_up_prefill_on_decode(tokenizer):
    async def main():
        roles = Roles()
        seen = []
        policy = LocalPrefill(0, max_prefill_backlog_tokens=100)

        def local(result, load):
            seen.append(load.prefill_backlog_tokens)
            return policy(result, load)

        owner = RequestOwner(roles, tokenizer, request_timeout_s=30, local_prefill=local)
        a, run_a = _submit(owner, 120)  # nothing waiting: sent to prefill, where it waits
        await asyncio.sleep(0.01)
        b, run_b = _submit(owner, 30)  # 120 tokens wait at prefill: prefilled on decode
        await asyncio.wait_for(run_b, 5)
        roles.release_prefill.set()
        await asyncio.wait_for(run_a, 5)
        c, run_c = _submit(owner, 30)  # a's prefill ended: nothing waits any more
        await asyncio.wait_for(run_c, 5)
        for r in (a, b, c):
            await r.aresult(timeout=5)
        return roles.calls, seen, owner, (a, b, c)

    calls, seen, owner, results = asyncio.run(main())
    a, b, c = (r.request_id for r in results)
    assert seen == [0, 120, 0]
    assert calls == [("prefill", a), ("decode", b), ("prefill", c)]
    assert owner.counters["local_prefill"] == 1 and owner._prefill_backlog == 0
    assert all(r.finished and r.outputs[0].token_ids == [5] for r in results)


def test_a_prefill_call_that_fails_releases_its_backlog(tokenizer):
    async def main():
        roles = Roles()
        roles.prefill_down = True
        owner = RequestOwner(roles, tokenizer, request_timeout_s=30,
                             local_prefill=LocalPrefill(0, max_prefill_backlog_tokens=1000))
        result, run = _submit(owner, 50)
        await asyncio.wait_for(run, 5)
        await result.aresult(timeout=5)
        return roles.calls, owner, result

    calls, owner, result = asyncio.run(main())
    assert calls == [("prefill", result.request_id), ("decode", result.request_id)]  # served whole after the loss
    assert owner.counters["prefill_lost"] == 1 and owner._prefill_backlog == 0
    assert result.finished and result.outputs[0].token_ids == [5]


def test_a_prompt_arriving_while_the_owner_serves_nothing_else_prefills_on_decode(tokenizer):
    async def main():
        roles = Roles()
        owner = RequestOwner(roles, tokenizer, request_timeout_s=30, local_prefill=LocalPrefill(0, when_idle=True))
        a, run_a = _submit(owner, 40)  # nothing else in flight: served whole on decode
        await asyncio.wait_for(run_a, 5)
        b, run_b = _submit(owner, 40)  # a is done: idle again, so decode again
        await asyncio.wait_for(run_b, 5)
        roles.generate_gate = asyncio.Event()
        c, run_c = _submit(owner, 40)  # idle: decode, where it is held
        await asyncio.sleep(0.01)
        d, run_d = _submit(owner, 40)  # c is in flight: prefill, where it is held too
        await asyncio.sleep(0.01)
        roles.release_prefill.set()
        roles.generate_gate.set()
        await asyncio.wait_for(asyncio.gather(run_c, run_d), 5)
        for r in (a, b, c, d):
            await r.aresult(timeout=5)
        return roles.calls, owner, (a, b, c, d)

    calls, owner, results = asyncio.run(main())
    a, b, c, d = (r.request_id for r in results)
    assert calls == [("decode", a), ("decode", b), ("decode", c), ("prefill", d)]
    assert owner.counters["local_prefill"] == 3 and not owner._serving
    assert all(r.finished and r.outputs[0].token_ids == [5] for r in results)
