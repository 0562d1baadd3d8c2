"""The deployment YAML: one file says which model runs, how each role scales and where its replicas go.

Pydantic validates the whole file before anything starts, so a typo fails at `raypd validate` (or at start-up) with the
path of the bad field, not minutes later inside a replica. Unknown keys are errors: a misspelt `replica:` silently
falling back to a default is the failure this schema exists to prevent. `raypd config-schema` prints it as JSON schema.
"""

from __future__ import annotations

import enum
import json
import os
import pathlib
from typing import Any, Literal

import yaml
from pydantic import (BaseModel, ByteSize, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from cluster.edge.tools import TOOL_CALL_PARSERS
from cluster.planning.autoscaling import DECODE_SIGNALS, PREFILL_SIGNALS
from cluster.serving.nice import nice_env

_SLO_SIGNALS = {"prefill": PREFILL_SIGNALS, "decode": DECODE_SIGNALS}
# Serve learns that a replica died only from a failed health check: at its default period (10 s) a killed replica's
# replacement started 0-10 s after the death. The check (is the engine loop alive) costs next to nothing.
_HEALTH_CHECK_PERIOD_S = 2.0


class ConfigError(ValueError):
    """A config that cannot start; the message names each bad field by its dotted path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SloTargets(_Strict):
    """Per-replica targets a role's SLO autoscaling policy (cluster/planning/autoscaling.py) scales toward: Serve keeps
    replicas * max(metric mean / target) running. Only the role's own signals: prefill queued_prompt_tokens and
    ttft_ms, decode running_seqs, kv_usage and tpot_ms. Each unset one is not weighed."""

    queued_prompt_tokens: float | None = Field(None, gt=0, description="prefill: prompt tokens accepted and not yet "
                                                                       "computed, per replica.")
    ttft_ms: float | None = Field(None, gt=0, description="prefill: mean time from accepting a prompt to its first "
                                                          "token on the replica, ms.")
    running_seqs: float | None = Field(None, gt=0, description="decode: sequences in the running batch, per replica.")
    kv_usage: float | None = Field(None, gt=0, le=1, description="decode: fraction of the replica's KV blocks in use.")
    tpot_ms: float | None = Field(None, gt=0, description="decode: mean time per output token, ms.")

    def targets(self) -> dict[str, float]:
        return {name: value for name, value in self.model_dump().items() if value is not None}


class Autoscaling(_Strict):
    # Serve can scale to zero, but a role with no replica makes every request wait on a cold start, so min >= 1.
    min_replicas: int = Field(1, ge=1, description="Fewest replicas kept running.")
    max_replicas: int = Field(ge=1, description="Most replicas Serve may start; must be >= min_replicas.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Ongoing requests per replica that Serve's autoscaler aims for (when no `slo`).")
    slo: SloTargets | None = Field(None, description="Scale on the role's own signals toward these targets "
                                                     "instead of on ongoing requests (prefill and decode only).")
    upscale_delay_s: float = Field(30.0, ge=0, description="How long Serve must want more replicas before adding.")
    downscale_delay_s: float = Field(600.0, ge=0, description="How long Serve must want fewer before removing.")
    look_back_period_s: float = Field(30.0, gt=0, description="Window the metrics are averaged over.")

    @field_validator("max_replicas")
    @classmethod
    def _max_at_least_min(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("min_replicas")  # absent when min_replicas itself was invalid
        if low is not None and value < low:
            raise ValueError(f"must be >= min_replicas ({low}), got {value}")
        return value

    @model_validator(mode="after")
    def _some_target(self) -> Autoscaling:
        if self.slo is not None and not self.slo.targets():
            raise ValueError("slo: give at least one target")
        return self

    def serve_config(self) -> dict[str, Any]:
        """Serve's autoscaling_config: ongoing requests, or the SLO policy with the targets as its kwargs."""
        options = self.model_dump(exclude={"slo"})
        if self.slo is not None:
            options["policy"] = {"policy_function": "cluster.planning.autoscaling:RolePolicy",
                                 "policy_kwargs": {"targets": self.slo.targets()}}
        return options


class Role(_Strict):
    """One role's Serve deployment: how many replicas and what each one asks Ray for."""

    replicas: int | None = Field(None, ge=1, description="Fixed replica count; 1 when neither this nor autoscaling "
                                                          "is given. Editing it and redeploying rescales live.")
    autoscaling: Autoscaling | None = Field(None, description="Let Serve scale the role; excludes `replicas`.")
    num_cpus: float | None = Field(None, ge=0, description="CPU slots per replica (Ray's num_cpus); unset: Serve's "
                                                           "default (1). 0 on one host, where slots are bookkeeping.")
    num_gpus: float = Field(0, ge=0, description="GPUs per replica (Ray's num_gpus).")
    nice: int = Field(0, ge=0, le=19, description="Nice levels this role's replica processes run below the others "
                                                  "(as `nice -n`; Linux caps the sum at 19). On a host the roles "
                                                  "share, decode.nice lets the ingress and prefill, which a first "
                                                  "token waits on, run ahead of decode steps (configs/local.yaml). "
                                                  "0: as Ray starts them.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per replica, e.g. {prefill: 1} to land on nodes "
                                          "started with `--resources='{\"prefill\": N}'`. Empty: anywhere.")
    max_ongoing_requests: int = Field(
        256, ge=1, description="Requests one replica accepts at once; more wait in Serve's queue. Serve's own default "
                               "(5) would starve continuous batching.")
    kv_cache_bytes: ByteSize | None = Field(
        None, description="prefill and decode only: this role's KV pool per replica, e.g. a prefill pool sized for "
                          "its prefix cache and a decode pool for its running sequences; unset: engine's.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="prefill and decode only: ranks the model is split over in each replica. A replica is "
                             "then a placement group of this many bundles, each with the resources above (e.g. "
                             "num_gpus 1 and {prefill: 1}); rank 0 is the Serve replica, the others actors in its "
                             "bundles. Prefill and decode may differ: decode reads each of its heads where prefill "
                             "holds it.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How a tensor-parallel replica's bundles are placed (Ray's placement group strategies): "
                            "PACK keeps them on as few nodes as fit (shared memory or NVLink between ranks).")

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU"):  # Ray refuses these in `resources` at deploy time; say so now
                raise ValueError(f"{name!r} is not a custom resource: use num_{name.lower()}s")
            if amount <= 0:
                raise ValueError(f"{name}: must be > 0, got {amount}")
        return value

    @model_validator(mode="after")
    def _one_way_to_scale(self) -> Role:
        if self.replicas is not None and self.autoscaling is not None:
            raise ValueError("give either `replicas` or `autoscaling`, not both")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes: must be >= 1 byte")
        if self.tensor_parallel_size > 1 and not self.bundle():
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size}: each bundle of a replica needs "
                             "something to reserve: set num_cpus, num_gpus or resources")
        return self

    def bundle(self) -> dict[str, float]:
        """What one tensor-parallel rank reserves: the replica's resources."""
        wanted = {"CPU": 1 if self.num_cpus is None else self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {name: amount for name, amount in wanted.items() if amount}

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for a Serve deployment's `.options()`: replica count or autoscaling, and placement."""
        actor: dict[str, Any] = {"num_gpus": self.num_gpus, "resources": dict(self.resources)}
        if self.num_cpus is not None:
            actor["num_cpus"] = self.num_cpus
        if self.nice:
            actor["runtime_env"] = {"env_vars": nice_env(self.nice)}
        options: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": self.max_ongoing_requests,
                                   "health_check_period_s": _HEALTH_CHECK_PERIOD_S}
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling.serve_config()
        else:
            options["num_replicas"] = self.replicas or 1
        if self.tensor_parallel_size > 1:
            options["placement_group_bundles"] = [self.bundle()] * self.tensor_parallel_size
            options["placement_group_strategy"] = self.placement_strategy
        return options


def _checkpoint_dir(value: str) -> str:
    path = pathlib.Path(value).expanduser()
    if not path.is_dir():
        raise ValueError(f"no model directory at {value!r} (looked in {path.absolute()}); "
                         f"`python -m raypd.tools.tiny {value}` builds the default tiny model")
    if not (path / "config.json").is_file():
        raise ValueError(f"{value!r} has no config.json: not a Hugging Face checkpoint directory")
    return str(path.resolve())


class SpeculativeSettings(_Strict):
    """Speculative decoding (engine.spec.config.SpeculativeConfig), as vLLM's speculative_config."""

    method: Literal["ngram", "draft_model"] = Field(
        "ngram", description="ngram: drafts are what followed the sequence's last tokens earlier in its prompt or "
                             "output (prompt lookup). draft_model: a smaller checkpoint (`model`) drafts them.")
    model: str | None = Field(None, description="draft_model: the draft checkpoint's directory (same tokenizer).")
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="Most draft tokens verified per sequence and step.")
    prompt_lookup_min: int = Field(2, ge=1, description="Shortest n-gram looked up.")
    prompt_lookup_max: int = Field(4, ge=1, description="Longest n-gram looked up (the longest that matches wins).")
    disable_by_batch_size: int | None = Field(None, ge=1, description="No drafts while more sequences than this "
                                                                      "run: a large batch no longer waits on "
                                                                      "reading the weights.")

    @field_validator("model")
    @classmethod
    def _draft_dir(cls, value: str | None) -> str | None:
        return None if value is None else _checkpoint_dir(value)

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeSettings:
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("`model` (the draft checkpoint) is what method draft_model needs, and only it")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


class EngineSettings(_Strict):
    """What every prefill and decode engine is built with (engine.core.engine.EngineConfig)."""

    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the model and its KV blocks live.")
    block_size: int = Field(16, ge=1, description="Tokens per KV block; prefill and decode must agree.")
    num_blocks: int | None = Field(None, ge=1, description="KV blocks per engine; excludes kv_cache_bytes.")
    kv_cache_bytes: ByteSize | None = Field(
        None, description="KV pool size per engine, e.g. 512MiB or 40GiB (512MiB when neither this nor num_blocks "
                          "is given); excludes num_blocks.")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Per-step token budget; longer prompts are "
                                                                "prefilled in chunks.")
    max_num_seqs: int = Field(64, ge=1, description="Most requests one engine runs at once.")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads per engine; unset: torch's "
                                                            "default (all cores, which co-located engines fight over).")
    seed: int = Field(0, description="Sampling seed for requests that bring none.")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV of full blocks an earlier prompt computed "
                                                          "(same tokens from the start): prefill computes only the "
                                                          "uncached suffix, decode reads only blocks it lacks.")
    kv_lease_s: float = Field(30.0, ge=1, description="How long a prefill engine holds a request's KV blocks for the "
                                                      "decode side before freeing them.")
    kv_transfer_timeout_s: float = Field(10.0, ge=1, description="A decode engine's budget to read one request's "
                                                                 "prompt KV; past it the decode engine prefills the "
                                                                 "prompt itself (one with images fails, named).")
    batch_invariant: bool = Field(False, description="Every query attends through one per-query kernel, prefill "
                                                     "tokens too, so a sequence's logits are the same bits however "
                                                     "it is batched, chunked, handed off or resumed: seeded "
                                                     "sampling then survives faults token for token. Costs prefill "
                                                     "speed; one rank per role; not for latent attention or sinks.")
    borrow_idle_cores: bool = Field(
        False, description="Engines on one host lend each other idle cores: a forward of 128+ tokens (a prompt "
                           "chunk) runs on every core no other engine of the host is computing on, never on fewer "
                           "than num_threads. For engines that share a host with num_threads set (configs/local.yaml)"
                           ". Off under batch_invariant.")
    speculative_config: SpeculativeSettings | None = Field(
        None, description="Speculative decoding on decoding engines: the same tokens, several per step where the "
                          "drafts are right. Unset: off.")

    @model_validator(mode="after")
    def _one_pool_size(self) -> EngineSettings:
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give either `num_blocks` or `kv_cache_bytes`, not both")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes: must be >= 1 byte")
        return self


class MultimodalSettings(_Strict):
    """Images at the edge (limits, which URLs are fetched) and the encoder role's cache. Used only when the model has
    a vision tower."""

    max_image_bytes: ByteSize = Field(20 * 2**20, description="Largest encoded image accepted, e.g. 20MiB.")
    max_image_pixels: int = Field(4096 * 4096, ge=1, le=89_000_000, description="Largest width * height accepted "
                                  "(checked from the header, before decoding; PIL's bomb limit is ~89M).")
    max_images_per_request: int = Field(16, ge=1, description="Most image parts in one request.")
    allow_remote_urls: bool = Field(False, description="Fetch http:// and https:// image URLs (the ingress makes the "
                                                       "request: off by default). Off: only data: URLs.")
    allowed_local_media_path: str | None = Field(
        None, description="Serve file:// image URLs from under this directory only; unset: file:// is refused.")
    fetch_timeout_s: float = Field(10.0, gt=0, description="Budget to fetch one remote image.")
    encoder_cache_bytes: ByteSize = Field(256 * 2**20, description="Each encoder replica's embedding arena (also "
                                                                   "its cache): as many images as this holds.")
    embedding_lease_s: float = Field(30.0, ge=1, description="How long an encoder holds an image's embeddings for "
                                                             "the prefill side before they may be evicted.")

    @field_validator("max_image_bytes", "encoder_cache_bytes")
    @classmethod
    def _positive(cls, value: ByteSize) -> ByteSize:
        if value < 1:
            raise ValueError("must be >= 1 byte")
        return value

    @field_validator("allowed_local_media_path")
    @classmethod
    def _local_dir(cls, value: str | None) -> str | None:
        if value is not None and not pathlib.Path(value).expanduser().is_dir():
            raise ValueError(f"no directory at {value!r}")
        return None if value is None else str(pathlib.Path(value).expanduser().resolve())


class RouterPolicy(str, enum.Enum):
    LEAST_QUEUED_TOKENS = "least_queued_tokens"
    POWER_OF_TWO_CHOICES = "power_of_two_choices"  # Serve's default: the shorter queue of two random replicas
    PREFIX_AWARE = "prefix_aware"  # the replica whose prefix cache leaves the least to compute, load included


class RouterSettings(_Strict):
    policy: RouterPolicy = Field(
        RouterPolicy.LEAST_QUEUED_TOKENS,
        description="How a prefill and a decode replica are picked for each request: least_queued_tokens (each "
                    "replica reports its engine's queued tokens every 0.5 s), Serve's power_of_two_choices "
                    "(ongoing requests), or prefix_aware (each replica also reports a Bloom filter of its cached "
                    "block keys; a prompt goes where its uncached tokens plus the replica's load are fewest).")
    max_local_prefill_tokens: int = Field(
        0, ge=0, description="Conditional disaggregation: a prompt with fewer tokens than this left to compute "
                             "after the best prefix-cache hit on a decode replica is prefilled on the decode replica "
                             "(no prefill hop, no KV transfer); longer ones on a prefill replica. 0: always remote.")
    max_prefill_backlog_tokens: int = Field(
        0, ge=0, description="Conditional disaggregation by load: while this ingress replica's prompts waiting for "
                             "their first token at prefill replicas hold at least this many tokens, a new prompt is "
                             "prefilled on its decode replica instead (a burst's prompts share both roles' cores). "
                             "Counted per ingress replica. 0: never for this reason.")
    local_prefill_when_idle: bool = Field(
        False, description="Conditional disaggregation when idle: a prompt that arrives while its ingress replica "
                           "serves no other request is prefilled on its decode replica (no decode step of its "
                           "to hold up; it skips the prefill hop, the KV transfer and a prefill engine gone cold). "
                           "Other ingress replicas' requests are not seen.")
    direct_when_idle: bool = Field(
        True, description="An ingress replica serving no other request sends a new request straight to a decode "
                          "replica's control pipe (one that has served it before) instead of calling it through "
                          "Serve: the engine takes it ~2.5 ms sooner at concurrency 1 on a 2-core host (3.5-4.1 "
                          "-> 1.2-1.5 ms). Under load every request is "
                          "a Serve call (Serve's router, queue limits and autoscaling see it).")
    transport: Literal["grpc", "ray"] = Field(
        "grpc", description="How the ingress calls the encoder, prefill and decode replicas: grpc (Serve's "
                            "inter-deployment gRPC server that every replica runs, on a port the OS picks; about half "
                            "the CPU and latency of a call), or ray (Ray actor calls: where the nodes' firewalls "
                            "pass Ray's own ports only).")


class HttpSettings(_Strict):
    host: str = Field("127.0.0.1", description="Address the OpenAI endpoint binds; 0.0.0.0 serves other hosts.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI endpoint.")
    api_key: SecretStr | None = Field(None, description="Bearer key every request must carry; excludes api_key_env.")
    api_key_env: str | None = Field(None, description="Name of an environment variable holding the key (keeps it "
                                                      "out of the file); must be set when the config is loaded.")

    @field_validator("api_key_env")
    @classmethod
    def _env_is_set(cls, value: str | None) -> str | None:
        # Checked at load, not at the first request: an endpoint meant to be closed must not start open.
        if value is not None and not os.environ.get(value):
            raise ValueError(f"environment variable {value!r} is not set or empty")
        return value

    @model_validator(mode="after")
    def _one_key_source(self) -> HttpSettings:
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("give either `api_key` or `api_key_env`, not both")
        return self

    def api_key_value(self) -> str | None:
        """The key requests must present, or None when the endpoint is open."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ[self.api_key_env] if self.api_key_env else None


class LimitsSettings(_Strict):
    """What one ingress replica takes on before it sheds load, and what one request may ask for."""

    max_requests_in_flight: int = Field(128, ge=1, description="Requests one ingress replica serves at once; beyond "
                                        "it a new request is answered 429 (503 while a role is down) at once.")
    max_tokens_in_flight: int = Field(131072, ge=1, description="Prompt tokens + max_tokens x n of the requests in "
                                      "flight on one ingress replica; beyond it: 429.")
    max_body_bytes: ByteSize = Field(ByteSize(32 << 20), description="Largest request body, checked before it is "
                                     "parsed (413 beyond it).")
    max_prompts_per_request: int = Field(64, ge=1, description="Prompts in one completions request.")
    max_messages_per_request: int = Field(1024, ge=1, description="Messages in one chat request.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a shed request, in seconds.")

    @field_validator("max_body_bytes")
    @classmethod
    def _positive(cls, value: ByteSize) -> ByteSize:
        if value < 1024:
            raise ValueError(f"must be at least 1KiB, got {value}")
        return value


class RaypdConfig(_Strict):
    """One raypd deployment: the model, its engines, each role's scaling and placement, routing and the endpoint."""

    model: str = Field(description="Local Hugging Face checkpoint directory (config.json, safetensors, tokenizer). "
                                   "A relative path is taken from the working directory and stored absolute; on a "
                                   "multi-node cluster it must exist at that path on every node.")
    served_model_name: str | None = Field(None, description="Name clients pass as `model`; default: the directory's "
                                                            "name.")
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="disaggregated: prefill replicas compute prompts, decode replicas read their KV "
                                     "over NIXL and generate. colocated: decode replicas serve whole requests and "
                                     "the prefill role is not started (the baseline to compare against).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV dtype. auto: the checkpoint's own, except that a float32 checkpoint runs "
                            "bfloat16 where the device computes bf16 natively (a CPU with AMX-BF16 or AVX512-BF16, "
                            "a CUDA GPU), as vLLM serves it; each replica decides on its node, so on a cluster whose "
                            "nodes differ set it explicitly. float32: exact parity with transformers.")
    engine: EngineSettings = Field(default_factory=EngineSettings,
                                   description="How every prefill and decode engine is built: KV pool, batching.")
    prefill: Role = Field(default_factory=Role, description="Prefill workers (context-only requests).")
    decode: Role = Field(default_factory=Role, description="Decode workers (generation-only requests).")
    postproc: Role = Field(default_factory=Role, description="Post-processing workers "
                           "(detokenize, stop strings). A fixed count: requests go to worker `id % replicas`.")
    ingress: Role = Field(default_factory=Role, description="OpenAI endpoint replicas; each owns its requests.")
    encoder: Role = Field(default_factory=Role, description="Multimodal encoder replicas (vision tower + projector, "
                          "embeddings read by prefill over NIXL); started only when the model has a vision tower.")
    multimodal: MultimodalSettings = Field(default_factory=MultimodalSettings,
                                           description="Image limits, URL policy and the encoder cache.")
    router: RouterSettings = Field(default_factory=RouterSettings, description="Replica choice per request.")
    http: HttpSettings = Field(default_factory=HttpSettings, description="The OpenAI-compatible HTTP endpoint.")
    tool_call_parser: Literal[TOOL_CALL_PARSERS] | None = Field(
        "hermes", description="How chat replies with tool_choice \"auto\" are read for tool calls: hermes (Hermes "
                              "and Qwen's `<tool_call>{json}</tool_call>`), or null to refuse \"auto\" (required and "
                              "named tool choices need no parser).")
    post_processor_hook: str | None = Field(None, description="Import path `module.Class` of a postproc.hooks."
                                            "PostProcessorHook that every postproc worker builds once and runs on "
                                            "every chunk (emit, suppress or terminate); it must import on every node.")
    limits: LimitsSettings = Field(default_factory=LimitsSettings, description="Admission control and request "
                                   "size limits of each ingress replica.")
    shutdown_grace_s: float = Field(30.0, ge=0, description="On SIGTERM or Ctrl-C, `raypd serve` stops accepting "
                                    "and lets requests in flight finish for this long before it stops Serve and Ray.")
    request_timeout_s: float = Field(300.0, gt=0, description="Total budget of one request, from arrival to its "
                                                              "last token; past it the client gets an error.")

    @field_validator("model")
    @classmethod
    def _model_dir(cls, value: str) -> str:
        return _checkpoint_dir(value)

    @field_validator("prefill", "decode", "ingress", "encoder")
    @classmethod
    def _slo_of_the_role(cls, value: Role, info: ValidationInfo) -> Role:
        slo = value.autoscaling.slo if value.autoscaling is not None else None
        if slo is None:
            return value
        allowed = _SLO_SIGNALS.get(info.field_name, ())
        wrong = [name for name in slo.targets() if name not in allowed]
        if wrong:
            own = f"its signals are {', '.join(allowed)}" if allowed else "it scales on ongoing requests only"
            raise ValueError(f"autoscaling.slo: {', '.join(wrong)} is not what {info.field_name} is responsible "
                             f"for; {own}")
        return value

    @field_validator("postproc", "ingress", "encoder")
    @classmethod
    def _no_kv_pool(cls, value: Role, info: ValidationInfo) -> Role:
        if value.kv_cache_bytes is not None:
            raise ValueError(f"kv_cache_bytes: {info.field_name} has no KV pool (prefill and decode have)")
        if value.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size: {info.field_name} runs no model shards (prefill and decode do)")
        return value

    @model_validator(mode="after")
    def _heads_split(self) -> RaypdConfig:
        """A tensor-parallel size that does not divide the model's heads, named now rather than by every replica."""
        text = json.loads((pathlib.Path(self.model) / "config.json").read_text())
        text = text.get("text_config", text)
        heads = text.get("num_attention_heads", 0)
        kv = text.get("num_key_value_heads") or heads
        for role in ("prefill", "decode"):
            size = getattr(self, role).tensor_parallel_size
            if heads and (heads % size or (kv % size if size <= kv else size % kv)):
                raise ValueError(f"{role}.tensor_parallel_size {size} does not divide the model's "
                                 f"{heads} attention heads and {kv} KV heads")
            if size > 1 and self.engine.batch_invariant:
                raise ValueError(f"engine.batch_invariant is built for one rank; {role}.tensor_parallel_size is {size}")
        return self

    @field_validator("postproc")
    @classmethod
    def _postproc_fixed(cls, value: Role) -> Role:
        if value.autoscaling is not None:
            raise ValueError("autoscaling is not supported: decode routes each request to postproc worker "
                             "`id % count`, so the count is fixed; use `replicas`")
        if value.nice:
            raise ValueError("nice: the postproc workers are plain Ray actors, not a Serve role; they run as Ray "
                             "starts them")
        return value

    @property
    def model_name(self) -> str:
        return self.served_model_name or pathlib.Path(self.model).name

    @property
    def num_postprocess_workers(self) -> int:
        return self.postproc.replicas or 1

    @property
    def has_vision_tower(self) -> bool:
        """Whether the checkpoint has an image side (a vision_config): then the encoder role starts. Read from
        config.json alone, so `raypd validate` answers without loading the model."""
        return "vision_config" in json.loads((pathlib.Path(self.model) / "config.json").read_text())

    def encoder_config(self, cluster_key: bytes | None = None) -> Any:
        """The engine.multimodal.encoder.EncoderConfig every encoder replica is built with: the engines' dtype, device
        and threads (prefill splices the embeddings in the dtype they were made in)."""
        from engine.multimodal.encoder import EncoderConfig

        e, m = self.engine, self.multimodal
        return EncoderConfig(dtype=self.dtype, device=e.device,
                             num_threads=e.num_threads, cache_bytes=int(m.encoder_cache_bytes),
                             lease_s=m.embedding_lease_s, cluster_key=cluster_key)

    def engine_config(self, cluster_key: bytes | None = None, role: str | None = None) -> Any:
        """The engine.core.engine.EngineConfig the engines of this deployment are built with; role ("prefill" or
        "decode"): with that role's own KV pool when it sets one."""
        from engine.core.engine import EngineConfig  # imports torch: only where an engine is built, not for the CLI

        e = self.engine
        pool = {"num_blocks": e.num_blocks} if e.num_blocks else {}
        if e.kv_cache_bytes is not None:
            pool["kv_cache_bytes"] = int(e.kv_cache_bytes)
        own = getattr(self, role).kv_cache_bytes if role else None
        if own is not None:
            pool = {"kv_cache_bytes": int(own)}
        return EngineConfig(block_size=e.block_size, max_num_batched_tokens=e.max_num_batched_tokens,
                            max_num_seqs=e.max_num_seqs, dtype=self.dtype,
                            device=e.device, num_threads=e.num_threads, seed=e.seed,
                            enable_prefix_caching=e.enable_prefix_caching, kv_lease_s=e.kv_lease_s,
                            kv_transfer_timeout_s=e.kv_transfer_timeout_s, cluster_key=cluster_key,
                            batch_invariant=e.batch_invariant, borrow_idle_cores=e.borrow_idle_cores,
                            speculative_config=_engine_speculation(e.speculative_config),
                            tensor_parallel_size=getattr(self, role).tensor_parallel_size if role else 1, **pool)


def _engine_speculation(spec: SpeculativeSettings | None) -> Any:
    """The engine's SpeculativeConfig, the same for every role: a prefill engine drafts after the first token (its
    drafts travel with the hand-off) and, with a draft model, computes the draft's KV of the prompt, which the
    decode side reads instead of computing it (engine/spec/draft_model.py)."""
    from engine.spec.config import SpeculativeConfig

    return None if spec is None else SpeculativeConfig(**spec.model_dump())


def parse_config(data: Any, source: str = "config") -> RaypdConfig:
    """Validates an already-parsed mapping (e.g. Serve application args); raises ConfigError naming every bad field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(data).__name__}")
    try:
        return RaypdConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None


def load_config(path: str | os.PathLike, **overrides) -> RaypdConfig:
    """Reads and validates one deployment YAML, top-level keys in `overrides` replacing the file's (None: kept);
    raises ConfigError (a ValueError) naming every bad field."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    data = {} if data is None else data
    if isinstance(data, dict):  # anything else is refused by parse_config, naming what it got
        data = data | {k: v for k, v in overrides.items() if v is not None}
    return parse_config(data, str(path))


def _describe(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: {exc.error_count()} problem(s):"]
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        what = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        lines.append(f"  {where}: {what}")
    return "\n".join(lines)


def placement_problems(config: RaypdConfig, node_types: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(errors, warnings) of fitting each tensor-parallel role's bundles on the node types of a `ray up` file
    (`available_node_types`): a role whose one bundle no node type offers, or whose STRICT_PACK group no single
    node holds, cannot start; a PACK group no single node holds spreads over nodes (the all-reduce then goes over
    the network). A node type's CPUs and GPUs, when the file leaves them to detection, are not counted."""
    errors, warnings = [], []
    for name in ("prefill", "decode"):
        role = getattr(config, name)
        if role.tensor_parallel_size == 1:
            continue
        bundle = role.bundle()
        offers = {t: _bundles_on(bundle, spec.get("resources", {})) for t, spec in node_types.items()}
        best = max(offers.values(), default=0)
        size, what = role.tensor_parallel_size, f"{name} (tensor_parallel_size {role.tensor_parallel_size}, " \
                                                f"bundles of {bundle})"
        if best == 0:
            errors.append(f"{what}: no node type offers even one bundle")
        elif best < size and role.placement_strategy in ("STRICT_PACK", "PACK"):
            fits = ", ".join(f"{t} {n}" for t, n in offers.items() if n)
            message = f"{what}: the most bundles one node type offers is {best} ({fits})"
            if role.placement_strategy == "STRICT_PACK":
                errors.append(message + "; STRICT_PACK needs all on one node")
            else:
                warnings.append(message + "; its ranks will span nodes")
    return errors, warnings


def _bundles_on(bundle: dict[str, float], resources: dict[str, float]) -> int:
    counted = {k: v for k, v in bundle.items() if k in resources or k not in ("CPU", "GPU")}  # detected: unknown
    return min((int(resources.get(k, 0) // v) for k, v in counted.items()), default=0)
