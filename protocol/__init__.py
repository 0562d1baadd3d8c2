"""The owner <-> replica protocol: every typed message between a request's owner and the replicas that serve it.

One call shape for every role: the owner sends a `Submit` (over a Serve call, a plain actor call, or a replica's
control pipe as a `Start`) and hears back one stream: `Accepted` first, naming the replica's control pipe, then either
the request's `RequestDelta`s (no route: the responses come on the stream itself) or, when its tokens go through the
postproc workers (a route), `Done` once the engine is done with it. `Abort` and `StopCandidates` reach the replica that
holds a request over the control pipe `Accepted` named, whatever happens to the call.

Plain types only: this imports nothing of the project but llmapi's types, so every side may import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmapi.disaggregated_params import DisaggregatedParams, RequestType, request_type
from llmapi.outputs import Resume
from llmapi.sampling_params import SamplingParams

PipeAddr = tuple[str, bytes | None]  # (ZeroMQ address, HMAC key): a signed pipe, as the reference API gives pipes


def postproc_worker(request_id: int, num_workers: int) -> int:
    """The postproc worker that post-processes a request: the one rule, used by engines, pools and owners."""
    return request_id % num_workers


@dataclass(frozen=True)
class PostprocRoute:
    """Where a request's tokens go: the owner's lane index on each postproc worker (see postproc_worker)."""

    lanes: tuple[int, ...]
    streaming: bool = True

    def lane_of(self, request_id: int) -> int:
        return self.lanes[postproc_worker(request_id, len(self.lanes))]


@dataclass(frozen=True)
class Submit:
    """One request to one replica. disaggregated_params: its kind (context_only on prefill, generation_only with the
    KV handle on decode, none or context_and_generation whole) and image handles; resume: the candidates' tokens so
    far after a lost replica; route: where its tokens go, or None for responses on the call's own stream."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    disaggregated_params: DisaggregatedParams | None = None
    resume: Resume | None = None
    route: PostprocRoute | None = None

    @property
    def kind(self) -> RequestType:
        return request_type(self.disaggregated_params)


@dataclass(frozen=True)
class Accepted:
    """A replica took a request: its control pipe, for the owner's Abort, StopCandidates and Start; replica: its
    Serve replica id where it has one (cluster/owner/direct.py matches pipes to the replica directory by it)."""

    control: PipeAddr
    replica: str | None = None


@dataclass(frozen=True)
class Done:
    """The engine is done with a request whose tokens went through the postproc workers."""


@dataclass(frozen=True)
class Abort:
    request_id: int


@dataclass(frozen=True)
class StopCandidates:
    request_id: int
    indices: tuple[int, ...]


@dataclass(frozen=True)
class Start:
    """A routed Submit sent over a replica's control pipe instead of a call: text or generation-only (no images to
    read). The replica reports what the call would have streamed to `reply`."""

    submit: Submit
    reply: PipeAddr  # the owner's reply pipe

    def __post_init__(self):
        if self.submit.route is None:
            raise ValueError("a Start's tokens go through the postproc workers: it needs a route")


@dataclass(frozen=True)
class Reply:
    """What the call would have streamed for a Start: Accepted, Done, or the exception it would have raised."""

    request_id: int
    item: Accepted | Done | Exception


class PostprocUnreachable(RuntimeError):
    """The postproc worker of a request takes no messages; its owner resumes the request elsewhere."""
