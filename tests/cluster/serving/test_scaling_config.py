"""Router and autoscaling settings in the YAML: what Serve is given, and what `raypd validate` shows."""

from __future__ import annotations

import pathlib

import yaml
from ray.serve.config import AutoscalingConfig

from cluster.cli import main
from cluster.config import load_config
from cluster.routing.request_router import router_config

def _write(tmp_path: pathlib.Path, tiny_llama: str, **sections) -> pathlib.Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"model": tiny_llama, **sections}))
    return path


SLO = {"prefill": {"autoscaling": {"min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 5,
                                   "slo": {"queued_prompt_tokens": 2048, "ttft_ms": 250}}},
       "decode": {"autoscaling": {"max_replicas": 4, "slo": {"running_seqs": 32, "kv_usage": 0.8, "tpot_ms": 40}}},
       "router": {"policy": "prefix_aware", "max_local_prefill_tokens": 64}}


def test_slo_targets_become_serves_custom_policy(tmp_path, tiny_llama):
    config = load_config(_write(tmp_path, tiny_llama, **SLO))
    options = config.prefill.deployment_options()["autoscaling_config"]
    assert options["policy"] == {"policy_function": "cluster.planning.autoscaling:RolePolicy",
                                 "policy_kwargs": {"targets": {"queued_prompt_tokens": 2048, "ttft_ms": 250}}}
    serve_config = AutoscalingConfig(**options)  # Serve accepts it and can load the policy
    assert serve_config.upscale_delay_s == 5 and not serve_config.policy.is_default_policy_function()
    policy = serve_config.policy.get_policy()(**serve_config.policy.policy_kwargs)
    assert policy.targets == {"queued_prompt_tokens": 2048.0, "ttft_ms": 250.0}
    plain = load_config(_write(tmp_path, tiny_llama, decode={"autoscaling": {"max_replicas": 2}}))
    assert "policy" not in plain.decode.deployment_options()["autoscaling_config"]  # Serve's ongoing requests
    assert router_config("prefix_aware").request_router_class == "cluster.routing.request_router.PrefixAwareRouter"


def test_validate_shows_the_targets_and_the_router(tmp_path, tiny_llama, capsys):
    assert main(["validate", str(_write(tmp_path, tiny_llama, **SLO))]) == 0
    out = capsys.readouterr().out
    assert "prefill: 1..3 replicas (autoscaling) on queued_prompt_tokens 2048, ttft_ms 250 per replica" in out
    assert "decode: 1..4 replicas (autoscaling) on running_seqs 32, kv_usage 0.8, tpot_ms 40 per replica" in out
    assert "router prefix_aware, prompts under 64 uncached tokens prefill on their decode replica" in out
