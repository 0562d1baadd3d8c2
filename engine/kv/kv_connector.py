"""What an engine needs from disaggregation, as an interface it is given (DESIGN.md, "Engine").

The scheduler owns every sequence and every block; a connector only moves KV and keeps time. Prefill side: a
finished context-only request's prompt blocks are *held* by the scheduler under a lease the connector tracks; the
connector reports when the lease ends (signed release from the reader, or expiry), and only then does the scheduler
free them. Decode side: the scheduler admits a generation-only request, gives it blocks, and asks the connector to
read the prompt's KV into them; the connector reports when the read is done (or why it failed).

A colocated engine gets NullConnector, which does nothing and never imports nixl; engines that exchange KV get
engine.kv.nixl_connector.NixlConnector.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from engine.kv.kv_cache import KVCache, KVLayout
from engine.kv.kv_handle import KVHandle
from engine.core.request import Sequence
from engine.parallel.ranks import RankGroup


@dataclass(frozen=True)
class EngineCard:
    """What one engine tells another when they first meet: how to reach its KV and what its KV is."""

    name: str
    transport_info: bytes  # rank 0's
    layout: KVLayout
    fingerprint: str
    rank_transport_infos: tuple[bytes, ...] = ()  # ranks 1..N-1's, under tensor parallelism
    speculation: str | None = None  # the method its drafts are made by (engine/spec/), if it speculates


@dataclass(frozen=True)
class ImportPlan:
    """Read these remote blocks of handle's engine into these local blocks of seq (pairwise, in order), and these
    blocks of its draft pool (handle.draft) into these of ours (none: the draft computes the prompt itself)."""

    seq: Sequence
    handle: KVHandle
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    draft_local: tuple[int, ...] = ()
    draft_remote: tuple[int, ...] = ()


@dataclass(frozen=True)
class ConnectorEvents:
    """What happened on the KV plane since the last poll."""

    imports_done: tuple[tuple[Sequence, str | None], ...] = ()  # (seq, None: KV in place | why it must re-prefill)
    leases_ended: tuple[int, ...] = ()  # request ids whose held blocks may now be freed


@dataclass
class ConnectorStats:
    kv_bytes_read: int = 0  # validated imports only
    last_import_s: float = 0.0  # first read posted to validated, of the latest import
    leases: int = 0  # held right now
    releases_rejected: int = 0  # release messages whose signature failed (forged, foreign key)
    releases_unknown: int = 0  # validly signed releases naming no current lease (replayed, or after expiry)
    extra: dict[str, float] = field(default_factory=dict)


class KVConnector(ABC):
    """The engine calls these from its one thread. Each method says what it changes."""

    per_rank_kv = False  # whether each tensor-parallel rank must expose its KV pool (started before the connector)

    def register_kv_cache(self, kv_cache: KVCache, generations: torch.Tensor, fingerprint: str,
                          ranks: RankGroup | None = None) -> None:
        """Called once by the engine that owns the arena (rank 0's), before anything else; ranks: the engine's
        other tensor-parallel ranks (their pools exposed, when per_rank_kv). Mutates the connector only."""

    def register_draft_cache(self, kv_cache: KVCache, generations: torch.Tensor, fingerprint: str) -> None:
        """Called once, after register_kv_cache, by an engine whose speculation has a draft model with a pool of its
        own (rank 0's): held leases then name the draft's blocks too, and imports may read a peer's. Mutates the
        connector only."""

    @abstractmethod
    def card(self) -> EngineCard:
        """How peers reach this engine's KV. Mutates nothing (may start the transport on first use)."""

    @abstractmethod
    def meet(self, card: EngineCard) -> None:
        """First contact with a peer: refuses an incompatible one (ValueError naming every mismatch), then
        connects. Idempotent per peer. Mutates the peer table."""

    @abstractmethod
    def open_handle(self, opaque_state: bytes) -> KVHandle:
        """Verifies a KV handle's signature (ValueError if it fails) and meets its engine; a peer that cannot be
        reached is not an error here (the import then fails and the request re-prefills). Mutates the peer table."""

    @abstractmethod
    def hold(self, request_id: int, block_ids: list[int], num_tokens: int, first_logprobs: tuple,
             first_top_logprobs: tuple, mm_items: tuple = (), group_starts: list[int] | None = None,
             draft: tuple[list[int], list[int]] | None = None) -> bytes:
        """Starts a lease on a finished context-only request's prompt blocks (the scheduler keeps them allocated)
        and returns the signed handle naming them (opaque_state), which carries the prompt's images (mm_items:
        engine.core.request.MultimodalItem). block_ids: each layer group's after the other, group g's from logical
        block group_starts[g] (None: one group, from 0). draft: (block ids, group starts) of the prompt's KV in the
        draft pool, held under the same lease. Mutates the lease table."""

    @abstractmethod
    def end_lease(self, request_id: int) -> bool:
        """Ends a lease early (the request was aborted); True if one was held. The scheduler frees the blocks.
        Idempotent. Mutates the lease table."""

    @abstractmethod
    def start_import(self, plan: ImportPlan) -> None:
        """Starts reading plan's blocks; never raises for transfer problems (poll reports them). Mutates the
        local blocks named, asynchronously."""

    @abstractmethod
    def cancel_import(self, seq: Sequence) -> None:
        """Stops seq's read, if any; its blocks may then be freed. Idempotent. Mutates the import table."""

    @abstractmethod
    def release_unread(self, handle: KVHandle) -> None:
        """Tells the handle's engine its blocks will not be read, so it frees them now, not at lease end.
        Best effort (the lease ends anyway). Mutates nothing here."""

    @abstractmethod
    def poll(self) -> ConnectorEvents:
        """Advances reads and leases: finished or failed imports, ended leases. Mutates both tables."""

    def stats(self) -> ConnectorStats:
        return ConnectorStats()

    def close(self) -> None:
        """Cancels reads, forgets peers, releases the transport. Idempotent."""


_NO_KV_TRANSFER = ("this engine has no KV transfer (it was built colocated); build it with kv_transfer='nixl' to "
                   "serve context_only or generation_only requests")


class NullConnector(KVConnector):
    """The colocated engine's connector: nothing to move, nothing to hold. Disaggregated requests are refused."""

    def card(self) -> EngineCard:
        raise ValueError(_NO_KV_TRANSFER)

    def meet(self, card: EngineCard) -> None:
        raise ValueError(_NO_KV_TRANSFER)

    def open_handle(self, opaque_state: bytes) -> KVHandle:
        raise ValueError(_NO_KV_TRANSFER)

    def hold(self, request_id, block_ids, num_tokens, first_logprobs, first_top_logprobs, mm_items=(),
             group_starts=None, draft=None) -> bytes:
        raise ValueError(_NO_KV_TRANSFER)

    def end_lease(self, request_id: int) -> bool:
        return False

    def start_import(self, plan: ImportPlan) -> None:
        raise ValueError(_NO_KV_TRANSFER)

    def cancel_import(self, seq: Sequence) -> None:
        pass

    def release_unread(self, handle: KVHandle) -> None:
        pass

    def poll(self) -> ConnectorEvents:
        return _NOTHING


_NOTHING = ConnectorEvents()
