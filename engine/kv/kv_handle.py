"""The KV handle (`opaque_state`): what a decode engine needs to read a prompt's blocks from a prefill engine.

It is signed by the engine that made it (HMAC-SHA256 with the cluster key) and serialized as JSON, never pickle, so a
forged or altered handle is refused before anything in it is used.

The release message a reader sends when it has the blocks (or will never read them) names the lease by its random
id and is signed under the same key: a forged or foreign one fails the check, and a replayed one names a lease that
no longer exists. Either way it frees nothing.

With a draft model (speculative decoding, engine/spec/draft_model.py), the handle also names the draft's KV of the
same prompt (`DraftKV`): blocks of the prefill engine's draft pool, held under the same lease and freed with the
target's, signed with the rest. The draft pool stays a pool of its own, exposed as a second NIXL region (an agent of
its own, engine/kv/nixl_connector.py), rather than extra layers in the target's blocks: a draft has its own layers,
KV heads and head size, so one block cannot hold both without a byte arena of two shapes, and a shared block id would
make every prefix-cache hit and every target-only computation promise draft KV it does not hold. A reader whose draft
differs (or that has none) ignores the part; its draft then computes the prompt itself.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import os
from dataclasses import dataclass

from engine.kv.kv_cache import KVLayout

# Engines in one process that were given no cluster key share this one; across processes a key must be configured.
PROCESS_KEY = os.urandom(32)
_CONTEXT = b"raypd.kv_handle.v1"
_RELEASE_CONTEXT = b"raypd.kv_release.v1"
RELEASE_PREFIX = b"raypd.release.v2:"


class InvalidHandle(ValueError):
    """The handle was not made by an engine of this cluster, or was altered."""


@dataclass(frozen=True)
class DraftKV:
    """The draft model's KV of the handle's prompt: its blocks in the prefill engine's draft pool, which its own
    transport (agent) exposes. Read whole (the draft runs on one rank), validated by generation numbers like the
    target's blocks."""

    agent: str
    transport_info: bytes
    layout: KVLayout
    fingerprint: str  # the draft checkpoint's
    block_ids: tuple[int, ...]
    generations: tuple[int, ...]
    group_starts: tuple[int, ...] = ()  # as KVHandle.group_starts, for the draft's layer groups


@dataclass(frozen=True)
class KVHandle:
    ctx_request_id: int
    agent: str  # the prefill engine's transport name (its rank 0's)
    transport_info: bytes  # what a peer needs to connect to that transport
    block_ids: tuple[int, ...]
    generations: tuple[int, ...]  # each block's allocation count when the lease began; a changed one was reused
    num_tokens: int  # prompt tokens whose KV the blocks hold
    layout: KVLayout
    fingerprint: str  # model fingerprint of the prefill engine
    lease_deadline: float  # wall clock (time.time()) of the prefill side; checked, but never trusted alone
    lease_id: str = ""  # random, per lease: what a release message names
    first_logprobs: tuple[float, ...] = ()  # per candidate: the first token's logprob
    first_top_logprobs: tuple[tuple[tuple[int, float, int], ...], ...] = ()  # per candidate: (token, logprob, rank)
    # The prompt's images as (content hash, offset, length): the decode side keys its prefix cache with them, so
    # text-identical prompts with other images never share blocks there either. Never their embeddings.
    mm_items: tuple[tuple[tuple[int, ...], int, int], ...] = ()
    rank_transport_infos: tuple[bytes, ...] = ()  # ranks 1..N-1's transports, under tensor parallelism
    # Per layer group: the logical block its part of block_ids starts at (a window group's blocks behind the window
    # were released); block_ids lists the groups' blocks one group after another. () for one group from block 0.
    group_starts: tuple[int, ...] = ()
    draft: DraftKV | None = None  # the draft model's KV of the prompt, if the prefill engine drafted with one

    def group_tables(self) -> list[tuple[int, tuple[int, ...]]]:
        """Per layer group: (first logical block, its blocks up to the prompt's last). Raises InvalidHandle when the
        lists do not add up to the layout's groups."""
        return _group_tables(self.layout, self.num_tokens, self.group_starts, self.block_ids)

    def draft_tables(self) -> list[tuple[int, tuple[int, ...]]]:
        """group_tables() of the draft's blocks ([] without a draft part)."""
        d = self.draft
        return [] if d is None else _group_tables(d.layout, self.num_tokens, d.group_starts, d.block_ids)

    @property
    def transports(self) -> tuple[bytes, ...]:
        """Every rank's transport info, rank 0 first."""
        return (self.transport_info, *self.rank_transport_infos)

    def sign(self, key: bytes | None) -> bytes:
        body = dataclasses.asdict(self)
        body["transport_info"] = base64.b64encode(self.transport_info).decode()
        body["rank_transport_infos"] = [base64.b64encode(i).decode() for i in self.rank_transport_infos]
        if self.draft is not None:
            body["draft"]["transport_info"] = base64.b64encode(self.draft.transport_info).decode()
        return sign_json(body, key, _CONTEXT)

    @classmethod
    def open(cls, blob: bytes, key: bytes | None) -> "KVHandle":
        """Verifies the signature, then parses. Raises InvalidHandle."""
        body = open_json(blob, key, _CONTEXT, "opaque_state", "KV handle")
        body["transport_info"] = base64.b64decode(body["transport_info"])
        body["layout"] = KVLayout(**body["layout"])
        body["block_ids"], body["generations"] = tuple(body["block_ids"]), tuple(body["generations"])
        body["first_logprobs"] = tuple(body["first_logprobs"])
        body["first_top_logprobs"] = tuple(tuple(tuple(t) for t in top) for top in body["first_top_logprobs"])
        body["mm_items"] = tuple((tuple(h), offset, length) for h, offset, length in body.get("mm_items", ()))
        body["rank_transport_infos"] = tuple(base64.b64decode(i) for i in body.get("rank_transport_infos", ()))
        body["group_starts"] = tuple(body.get("group_starts", ()))
        body["draft"] = _open_draft(body.get("draft"))
        handle = cls(**body)
        handle.group_tables()  # refuses lists that do not fit the layout's groups
        handle.draft_tables()
        return handle


def _open_draft(body: dict | None) -> DraftKV | None:
    if body is None:
        return None
    try:
        return DraftKV(body["agent"], base64.b64decode(body["transport_info"]), KVLayout(**body["layout"]),
                       body["fingerprint"], tuple(body["block_ids"]), tuple(body["generations"]),
                       tuple(body.get("group_starts", ())))
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidHandle(f"opaque_state's draft part is malformed: {e}") from None


def _group_tables(layout: KVLayout, num_tokens: int, group_starts: tuple[int, ...], block_ids: tuple[int, ...]
                  ) -> list[tuple[int, tuple[int, ...]]]:
    groups = len(layout.groups)
    starts = group_starts or (0,) * groups
    end = -(-num_tokens // layout.block_size)
    if len(starts) != groups or any(not 0 <= s <= end for s in starts) or \
            sum(end - s for s in starts) != len(block_ids):
        raise InvalidHandle(f"opaque_state lists {len(block_ids)} blocks from {list(starts)} for "
                            f"{groups} layer group(s) of {end} blocks")
    tables, first = [], 0
    for start in starts:
        tables.append((start, block_ids[first:first + end - start]))
        first += end - start
    return tables


def sign_json(body: dict, key: bytes | None, context: bytes) -> bytes:
    """MAC (32 bytes, under key and a per-kind context) + the body as canonical JSON."""
    payload = json.dumps(body, sort_keys=True).encode()
    return _mac(key, payload, context) + payload


def open_json(blob: bytes, key: bytes | None, context: bytes, field: str, kind: str) -> dict:
    """The body of what sign_json made with the same key and context; InvalidHandle naming `field` otherwise."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < 32:
        raise InvalidHandle(f"{field} is not a {kind}")
    mac, payload = bytes(blob[:32]), bytes(blob[32:])
    if not hmac.compare_digest(mac, _mac(key, payload, context)):
        raise InvalidHandle(f"{field} signature check failed: the handle was altered or made by an engine "
                            "with another cluster key")
    try:
        body = json.loads(payload)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise InvalidHandle(f"{field} is not a {kind}")
    return body


def _mac(key: bytes | None, payload: bytes, context: bytes = _CONTEXT) -> bytes:
    derived = hmac.new(key or PROCESS_KEY, context, hashlib.sha256).digest()
    return hmac.new(derived, payload, hashlib.sha256).digest()


def release_message(lease_id: str, key: bytes | None) -> bytes:
    """What the reader of a lease's blocks sends its owner to free them."""
    body = lease_id.encode()
    return RELEASE_PREFIX + body + b":" + _mac(key, body, _RELEASE_CONTEXT).hex().encode()


def open_release(message: bytes, key: bytes | None) -> str | None:
    """The lease a release message names, or None if it is not a release or its signature fails."""
    if not message.startswith(RELEASE_PREFIX):
        return None
    body, _, mac = message[len(RELEASE_PREFIX):].rpartition(b":")
    try:
        ok = hmac.compare_digest(bytes.fromhex(mac.decode()), _mac(key, body, _RELEASE_CONTEXT))
    except ValueError:
        return None
    return body.decode() if ok else None


# What a reader bridges: each side's tensor-parallel split of the same heads (engine/kv/head_reads.py).
_SPLIT_FIELDS = ("num_kv_heads", "tp_size")


def compatibility_problems(mine: KVLayout, my_fingerprint: str, theirs: KVLayout, their_fingerprint: str) -> list[str]:
    """Every difference that makes two engines' KV blocks incompatible, named. Different tensor-parallel sizes are
    compatible: the reader takes each of its heads from a rank of the other side that holds it."""
    problems = [
        f"{f.name}: {getattr(theirs, f.name)} (peer) vs {getattr(mine, f.name)} (here)"
        for f in dataclasses.fields(KVLayout)
        if f.name not in _SPLIT_FIELDS and getattr(theirs, f.name) != getattr(mine, f.name)
    ]
    if their_fingerprint != my_fingerprint:
        problems.insert(0, f"model fingerprint: {their_fingerprint[:12]} (peer) vs {my_fingerprint[:12]} (here)")
    if problems:
        problems.append(f"(peer layout {_describe(theirs)}; here {_describe(mine)})")
    return problems


def _describe(layout: KVLayout) -> str:
    per_token = f"{layout.model_kv_heads} KV heads x {layout.head_dim}" if layout.planes == 2 else \
        f"a latent of {layout.head_dim}"
    windows = f" (sliding windows per layer: {list(layout.layer_windows)})" if layout.layer_windows else ""
    return (f"{layout.num_layers} layers x {per_token}{windows}, blocks of "
            f"{layout.block_size} tokens, {layout.dtype}, over {layout.tp_size} rank(s)")
