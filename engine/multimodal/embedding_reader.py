"""EmbeddingReader: reads a request's image embeddings from encoders' arenas over NIXL, before the request enters
the engine (so the scheduler needs no queue for them). It has its own NIXL agent and a small registered scratch of
slots the size of the encoders' (one image each); a read lands there, is validated, and is copied out.

Checks, each refused with an error naming the handle: the signature (cluster key), the description against the signed
handle, the model fingerprint, token count, hidden size and dtype against this engine's, the content hash against
multimodal_hashes, the lease deadline (an expired handle is never read), and after the read the slot's generation
(a refilled slot's bytes are never used). Then the leases are released (signed), so the encoder may evict early.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.multimodal.embedding_handle import EmbeddingHandle, EmbeddingsGone
from engine.kv.kv_handle import release_message
from engine.kv.kv_transfer import GENERATIONS, NixlTransport, TransferError
from llmapi.disaggregated_params import MultimodalEmbeddingHandle

log = logging.getLogger(__name__)

LEASE_MARGIN_S = 0.5  # a handle with less than this left is not read: the read could outlive the lease


@dataclass(frozen=True)
class EmbeddingSpec:
    """What this engine splices: every image's embeddings are (num_tokens, hidden_size) of dtype, from this model."""

    num_tokens: int
    hidden_size: int
    dtype: str
    fingerprint: str


class EmbeddingReader:
    def __init__(self, expected: EmbeddingSpec, key: bytes | None, timeout_s: float, num_slots: int = 8):
        self.expected = expected
        self.timeout_s = timeout_s
        self._key = key
        dtype = getattr(torch, expected.dtype)
        # (slots, tokens, hidden): the same entry size as the encoders' arenas, so a slot reads into a slot
        self.scratch = torch.zeros((num_slots, expected.num_tokens, expected.hidden_size), dtype=dtype)
        self.transport = NixlTransport(f"raypd-mmr-{uuid.uuid4().hex[:12]}", self.scratch,
                                       torch.zeros(num_slots, dtype=torch.int64))
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.last_read_s = 0.0

    def open(self, handles: Sequence, hashes: Sequence | None = None) -> list[EmbeddingHandle]:
        """Verifies and checks every handle (ValueError naming the first bad one); reads nothing."""
        if hashes is not None and len(hashes) != len(handles):
            raise ValueError(f"{len(hashes)} multimodal_hashes for {len(handles)} multimodal_embedding_handles")
        opened = []
        for i, public in enumerate(handles):
            where = f"multimodal_embedding_handles[{i}]"
            if not isinstance(public, MultimodalEmbeddingHandle):
                raise ValueError(f"{where}: expected a MultimodalEmbeddingHandle, got {type(public).__name__}")
            handle = EmbeddingHandle.open(public.signed, self._key, where)
            if (public.num_tokens, public.hidden_size, public.dtype) != (handle.num_tokens, handle.hidden_size,
                                                                         handle.dtype):
                raise ValueError(f"{where}: num_tokens/hidden_size/dtype differ from what its signed handle says")
            self._check(where, handle)
            if hashes is not None and tuple(hashes[i]) != handle.content_hash:
                raise ValueError(f"multimodal_hashes[{i}] is not the content hash its embedding handle names")
            opened.append(handle)
        return opened

    def _check(self, where: str, handle: EmbeddingHandle) -> None:
        e = self.expected
        problems = [f"{name} {theirs} (encoder) vs {ours} (here)" for name, theirs, ours in (
            ("num_tokens", handle.num_tokens, e.num_tokens), ("hidden_size", handle.hidden_size, e.hidden_size),
            ("dtype", handle.dtype, e.dtype)) if theirs != ours]
        if handle.fingerprint != e.fingerprint:
            problems.insert(0, f"model fingerprint {handle.fingerprint[:12]} (encoder) vs {e.fingerprint[:12]} (here)")
        if problems:
            raise ValueError(f"{where}: embeddings this engine cannot splice: " + "; ".join(problems))
        left = handle.lease_deadline - time.time()
        if left < LEASE_MARGIN_S:
            state = f"expired {-left:.1f} s ago" if left < 0 else f"has {left:.2f} s left, too little to read it"
            raise EmbeddingsGone(f"{where}: the embedding handle's lease {state}; encode the image again")

    def read(self, handles: Sequence[EmbeddingHandle]) -> list[torch.Tensor]:
        """Each opened handle's (num_tokens, hidden_size) embeddings, read within timeout_s. Raises EmbeddingsGone (a
        ValueError) if a slot was refilled meanwhile or the encoder cannot be read."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        with self._lock:
            got: dict[tuple[str, int], tuple[torch.Tensor, int]] = {}
            try:
                for agent, group in _by_agent(handles).items():
                    got.update(self._read_agent(agent, group, deadline))
            finally:
                self._release(handles)
            self.last_read_s = time.monotonic() - start
        out = []
        for i, handle in enumerate(handles):
            data, generation = got[(handle.agent, handle.slot)]
            if generation != handle.generation:
                raise EmbeddingsGone(f"multimodal_embedding_handles[{i}]: the encoder evicted these embeddings "
                                     "and refilled their slot before they were read (the lease had ended); encode "
                                     "the image again")
            out.append(data)
        return out

    def _read_agent(self, agent: str, group: list[EmbeddingHandle], deadline: float) -> dict:
        try:
            self.transport.connect(agent, group[0].transport_info)
        except (TransferError, ValueError) as e:
            raise EmbeddingsGone(f"cannot reach the encoder that holds the embeddings ({agent!r}): {e}") from e
        slots = list(dict.fromkeys(h.slot for h in group))  # the same image twice is read once
        got = {}
        size = self.scratch.shape[0]
        for i in range(0, len(slots), size):
            got.update(self._read_slots(agent, slots[i:i + size], deadline))
        return got

    def _read_slots(self, agent: str, slots: list[int], deadline: float) -> dict:
        """The data of the encoder's slots, then their generations (after the data, so a refill that raced shows)."""
        local = list(range(len(slots)))
        try:
            self.transport.wait(self.transport.start_read(agent, slots, local, b""), deadline)
            self.transport.wait(self.transport.start_read(agent, slots, local, b"", region=GENERATIONS), deadline)
        except TransferError as e:
            raise EmbeddingsGone(f"reading image embeddings from encoder {agent!r} failed: {e}") from e
        generations = self.transport.generation_scratch[local].tolist()
        self.bytes_read += len(slots) * self.scratch[0].nbytes
        data = self.scratch[:len(slots)].clone()  # (n, tokens, hidden): one copy out; the scratch is reused next
        return {(agent, slot): (data[j], generations[j]) for j, slot in enumerate(slots)}

    def _release(self, handles: Sequence[EmbeddingHandle]) -> None:
        """Tells each encoder its leases may end (best effort: they end at their deadline anyway)."""
        for agent, lease_id in dict.fromkeys((h.agent, h.lease_id) for h in handles):
            try:
                self.transport.send_notification(agent, release_message(lease_id, self._key))
            except TransferError as e:
                log.info("could not release embedding lease on %r: %s", agent, e)

    def close(self) -> None:
        self.transport.close()


def _by_agent(handles: Sequence[EmbeddingHandle]) -> dict[str, list[EmbeddingHandle]]:
    groups: dict[str, list[EmbeddingHandle]] = {}
    for handle in handles:
        groups.setdefault(handle.agent, []).append(handle)
    return groups
