"""Starts prefill and decode actors where their Ray resources are, and introduces them to each other."""

from __future__ import annotations

import dataclasses
import os

import ray

from decode.worker import DecodeWorker
from encoder.worker import EncoderWorker
from engine.multimodal.encoder import EncoderConfig
from engine.core.engine import EngineConfig
from prefill.worker import PrefillWorker

_READY_TIMEOUT_S = 300.0


@dataclasses.dataclass
class Workers:
    prefill: list
    decode: list
    encoder: list = dataclasses.field(default_factory=list)

    def kill(self) -> None:
        for actor in self.prefill + self.decode + self.encoder:
            ray.kill(actor)


def start_workers(model_dir: str, config: EngineConfig, num_prefill: int = 1, num_decode: int = 1,
                  use_role_resources: bool = True, encoder: EncoderConfig | None = None,
                  num_encoder: int = 1) -> Workers:
    """One actor per replica, each needing one unit of its role's resource (`prefill` / `decode`) when
    use_role_resources, so Ray places it on a node of that type. All share a fresh cluster key (signs KV and
    embedding handles). Every decode worker meets every prefill worker before this returns: an incompatible pair
    fails here. encoder: also start num_encoder encoder actors with this config (anywhere: no role resource)."""
    if config.cluster_key is None:
        config = dataclasses.replace(config, cluster_key=os.urandom(32))
    prefill = [_actor(PrefillWorker, "prefill", use_role_resources).remote(model_dir, config) for _ in range(num_prefill)]
    decode = [_actor(DecodeWorker, "decode", use_role_resources).remote(model_dir, config) for _ in range(num_decode)]
    encoders = []
    if encoder is not None:
        encoder = dataclasses.replace(encoder, cluster_key=config.cluster_key)
        encoders = [_actor(EncoderWorker, "encoder", False).remote(model_dir, encoder) for _ in range(num_encoder)]
    cards = ray.get([p.card.remote() for p in prefill], timeout=_READY_TIMEOUT_S)
    ray.get([d.meet.remote(card) for d in decode for card in cards], timeout=_READY_TIMEOUT_S)
    ray.get([e.check_health.remote() for e in encoders], timeout=_READY_TIMEOUT_S)
    return Workers(prefill, decode, encoders)


def _actor(cls, role: str, use_role_resources: bool):
    resources = {role: 1} if use_role_resources else {}
    # The engine thread does the work; the actor itself only relays, so it asks for no CPU slot.
    return ray.remote(cls).options(num_cpus=0, resources=resources, max_restarts=0)
