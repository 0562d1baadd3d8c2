"""The deployment YAML schema, the `raypd` CLI's config commands and the `ray up` files, all checked offline."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.cli import main
from cluster.config import ConfigError, RaypdConfig, load_config

REPO = pathlib.Path(__file__).resolve().parents[3]
SERVE_CONFIGS = ("local", "multinode")
CLUSTER_FILES = ("aws", "gcp", "local")
CLI_TIMEOUT_S = 120


def _yaml(path: pathlib.Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory holding the serve configs' (relative) model dirs, with the API key variable set."""
    for name in SERVE_CONFIGS:
        model = tmp_path / _yaml(REPO / "configs" / f"{name}.yaml")["model"]
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")  # all load_config checks; the engine reads the rest later
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAYPD_API_KEY", "test-key")
    return tmp_path


def test_local_config_is_the_single_node_default(workdir):
    config = load_config(REPO / "configs" / "local.yaml")
    assert config.model == str(workdir / "models" / "tiny-llava")
    assert (config.prefill.replicas, config.decode.replicas, config.ingress.replicas) == (1, 1, 1)
    assert config.encoder.replicas == 1 and not config.multimodal.allow_remote_urls
    assert config.num_postprocess_workers == 1
    assert all(getattr(config, role).resources == {} for role in ("prefill", "decode", "postproc", "ingress"))
    assert (config.http.host, config.http.port, config.http.api_key_value()) == ("127.0.0.1", 8000, None)
    engine = config.engine_config(cluster_key=b"k")
    assert (engine.device, engine.num_threads, engine.cluster_key, engine.dtype) == ("cpu", 1, b"k", "auto")
    assert engine.borrow_idle_cores  # one thread each, and a prompt chunk on both cores while the other role idles
    assert config.decode.deployment_options()["num_replicas"] == 1
    # decode steps yield the host's cores to the ingress and prefill; the replicas learn their nice from their env
    assert config.decode.deployment_options()["ray_actor_options"]["runtime_env"] == {"env_vars": {"RAYPD_NICE": "15"}}
    assert all(getattr(config, role).nice == 0 for role in ("prefill", "ingress", "encoder"))
    router = config.router
    assert (router.max_local_prefill_tokens, router.max_prefill_backlog_tokens, router.local_prefill_when_idle) == (
        0, 4096, True)
    assert config.tool_call_parser == "hermes"
    (workdir / "models" / "text").mkdir()
    (workdir / "models" / "text" / "config.json").write_text("{}")
    other = load_config(REPO / "configs" / "local.yaml", model="models/text")  # `raypd serve --model`
    assert other.model == str(workdir / "models" / "text") and other.encoder == config.encoder


def test_a_role_can_size_its_own_kv_pool(workdir):
    path = workdir / "pools.yaml"
    path.write_text(yaml.safe_dump({**_yaml(REPO / "configs" / "local.yaml"), "engine": {"num_blocks": 64},
                                    "prefill": {"replicas": 1, "kv_cache_bytes": "32MiB"}}))
    config = load_config(path)
    prefill, decode = config.engine_config(role="prefill"), config.engine_config(role="decode")
    assert (prefill.kv_cache_bytes, prefill.num_blocks) == (32 * 2**20, None)
    assert decode.num_blocks == 64 and decode.kv_cache_bytes != 32 * 2**20  # the engine's pool


def test_speculative_config_reaches_the_engines(workdir):
    path = workdir / "spec.yaml"
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "disable_by_batch_size": 8}
    path.write_text(yaml.safe_dump({**_yaml(REPO / "configs" / "local.yaml"), "engine": {"speculative_config": spec}}))
    got = load_config(path).engine_config(role="decode").speculative_config
    assert (got.method, got.num_speculative_tokens, got.prompt_lookup_min, got.prompt_lookup_max,
            got.disable_by_batch_size) == ("ngram", 5, 2, 3, 8)
    assert load_config(REPO / "configs" / "local.yaml").engine_config().speculative_config is None
    # a draft model is loaded on prefill replicas too: their draft's KV of the prompt travels with the hand-off
    local = _yaml(REPO / "configs" / "local.yaml")
    draft = {"method": "draft_model", "model": local["model"]}  # any checkpoint directory will do here
    path.write_text(yaml.safe_dump({**local, "engine": {"speculative_config": draft}}))
    config = load_config(path)
    for role in ("prefill", "decode"):
        assert config.engine_config(role=role).speculative_config.model == str(workdir / local["model"])


def test_multinode_config_places_roles_and_autoscales_decode(workdir):
    config = load_config(REPO / "configs" / "multinode.yaml")
    prefill, decode = config.prefill.deployment_options(), config.decode.deployment_options()
    assert prefill["ray_actor_options"]["resources"] == {"prefill": 1}
    assert decode["ray_actor_options"] == {"num_gpus": 1, "resources": {"decode": 1}}
    assert "num_replicas" not in decode and decode["autoscaling_config"]["max_replicas"] > 1
    assert config.http.api_key_value() == "test-key"
    assert config.engine_config().device == "cuda"


@pytest.mark.parametrize("change, expected", [
    ({"decode": {"replicas": -1}}, "decode.replicas: Input should be greater than or equal to 1"),
    ({"decode": {"replicas": 2, "autoscaling": {"max_replicas": 3}}},
     "decode: give either `replicas` or `autoscaling`, not both"),
    ({"prefill": {"replica": 2}}, "prefill.replica: unknown key"),
    ({"colour": "blue"}, "colour: unknown key"),
    ({"model": "models/missing"}, "model: no model directory at 'models/missing'"),
    ({"decode": {"autoscaling": {"min_replicas": 4, "max_replicas": 2}}},
     "decode.autoscaling.max_replicas: must be >= min_replicas (4), got 2"),
    ({"decode": {"autoscaling": {"min_replicas": 0, "max_replicas": 2}}}, "decode.autoscaling.min_replicas:"),
    ({"postproc": {"autoscaling": {"max_replicas": 3}}}, "postproc: autoscaling is not supported"),
    ({"prefill": {"resources": {"GPU": 1}}}, "prefill.resources: 'GPU' is not a custom resource"),
    ({"engine": {"num_blocks": 64, "kv_cache_bytes": "1GiB"}}, "engine: give either `num_blocks` or"),
    ({"engine": {"kv_cache_bytes": "12 parsecs"}}, "engine.kv_cache_bytes: could not interpret byte unit"),
    ({"engine": {"kv_lease_s": 0}}, "engine.kv_lease_s: Input should be greater than or equal to 1"),
    ({"router": {"policy": "random"}}, "router.policy: Input should be 'least_queued_tokens', 'power_of_two_choices' "
                                       "or 'prefix_aware'"),
    ({"router": {"max_local_prefill_tokens": -1}}, "router.max_local_prefill_tokens: Input should be greater"),
    ({"decode": {"autoscaling": {"max_replicas": 3, "slo": {"ttft_ms": 200}}}},
     "decode: autoscaling.slo: ttft_ms is not what decode is responsible for; its signals are "
     "running_seqs, kv_usage, tpot_ms"),
    ({"prefill": {"autoscaling": {"max_replicas": 3, "slo": {}}}}, "prefill.autoscaling: slo: give at least one"),
    ({"ingress": {"autoscaling": {"max_replicas": 3, "slo": {"tpot_ms": 9}}}}, "it scales on ongoing requests only"),
    ({"decode": {"autoscaling": {"max_replicas": 3, "slo": {"kv_usage": 1.5}}}}, "decode.autoscaling.slo.kv_usage:"),
    ({"http": {"api_key_env": "RAYPD_TEST_UNSET_VARIABLE"}}, "http.api_key_env: environment variable"),
    ({"http": {"api_key": "a", "api_key_env": "RAYPD_API_KEY"}}, "http: give either `api_key` or `api_key_env`"),
    ({"dtype": "int4"}, "dtype: Input should be"),
    ({"postproc": {"replicas": 2, "kv_cache_bytes": "1GiB"}}, "postproc: kv_cache_bytes: postproc has no KV pool"),
    ({"prefill": {"kv_cache_bytes": 0}}, "prefill: kv_cache_bytes: must be >= 1 byte"),
    ({"decode": {"nice": 20}}, "decode.nice: Input should be less than or equal to 19"),
    ({"decode": {"nice": -5}}, "decode.nice: Input should be greater than or equal to 0"),
    ({"postproc": {"nice": 5}}, "postproc: nice: the postproc workers are plain Ray actors"),
    ({"engine": {"speculative_config": {"method": "eagle"}}},
     "engine.speculative_config.method: Input should be 'ngram' or 'draft_model'"),
    ({"engine": {"speculative_config": {"method": "draft_model"}}}, "`model` (the draft checkpoint) is what method"),
    ({"engine": {"speculative_config": {"method": "draft_model", "model": "models/missing"}}},
     "engine.speculative_config.model: no model directory at 'models/missing'"),
    ({"engine": {"speculative_config": {"prompt_lookup_min": 5, "prompt_lookup_max": 3}}},
     "prompt_lookup_min (5) must be <= prompt_lookup_max (3)"),
])
def test_a_bad_config_fails_naming_the_field(workdir, change, expected):
    path = workdir / "bad.yaml"
    path.write_text(yaml.safe_dump({**_yaml(REPO / "configs" / "local.yaml"), **change}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: 1 problem(s):")
    assert expected in str(err.value)


def test_every_problem_is_reported_at_once(workdir):
    path = workdir / "bad.yaml"
    path.write_text("model: nowhere\nprefill: {replicas: 0}\nhttp: {port: 70000}\n")
    message = str(pytest.raises(ConfigError, load_config, path).value)
    assert "3 problem(s)" in message
    assert all(f"\n  {where}:" in message for where in ("model", "prefill.replicas", "http.port"))


@pytest.mark.parametrize("text, expected", [("- a\n- b\n", "top level must be a mapping"),
                                            ("model: [unclosed\n", "not valid YAML"),
                                            ("", "model: Field required")])
def test_a_file_that_is_no_config_fails_naming_the_file(workdir, text, expected):
    path = workdir / "bad.yaml"
    path.write_text(text)
    message = str(pytest.raises(ConfigError, load_config, path).value)
    assert message.startswith(str(path)) and expected in message
    assert "cannot read" in str(pytest.raises(ConfigError, load_config, workdir / "absent.yaml").value)


def test_every_field_has_a_description():
    schema = RaypdConfig.model_json_schema()
    models = [schema, *schema["$defs"].values()]
    undescribed = [f"{m['title']}.{name}" for m in models for name, prop in m.get("properties", {}).items()
                   if not prop.get("description")]
    assert undescribed == []
    assert all(m.get("additionalProperties") is False for m in models if "properties" in m)


def test_config_schema_command_prints_json_schema():
    # The installed console script when this venv has it (after `pip install -e .`), else the same entry point.
    script = shutil.which("raypd", path=os.path.dirname(sys.executable))
    command = [script] if script else [sys.executable, "-m", "cluster.cli"]
    out = subprocess.run([*command, "config-schema"], capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                         check=True, cwd=REPO).stdout
    schema = json.loads(out)
    sections = {"model", "engine", "prefill", "decode", "postproc", "ingress", "router", "http"}
    assert sections <= schema["properties"].keys()
    assert schema["required"] == ["model"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["raypd"] == "cluster.cli:main"


def test_validate_command_exit_codes(workdir, capsys):
    assert main(["validate", str(REPO / "configs" / "local.yaml")]) == 0
    assert "ok" in capsys.readouterr().out
    (workdir / "bad.yaml").write_text("model: models/tiny-llama\ndecode: {replicas: -2}\n")
    assert main(["validate", str(workdir / "bad.yaml")]) == 2
    assert "decode.replicas:" in capsys.readouterr().err


# ---- `ray up` files ----

@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_cluster_file_passes_rays_own_validation(name):
    raw = _yaml(REPO / "configs" / "cluster" / f"{name}.yaml")
    validate_config(prepare_config(raw))
    setup = raw["setup_commands"]
    torch_at = next(i for i, c in enumerate(setup) if "torch==" in c)
    assert torch_at < next(i for i, c in enumerate(setup) if "~/raypd" in c and "pip install" in c)


@pytest.mark.parametrize("name", ["aws", "gcp"])
def test_cloud_node_types_carry_the_role_resources(name):
    raw = _yaml(REPO / "configs" / "cluster" / f"{name}.yaml")
    types = raw["available_node_types"]
    assert not {"prefill", "decode"} & set(types[raw["head_node_type"]]["resources"])
    for role in ("prefill", "decode"):
        carriers = [t for t in types.values() if t["resources"].get(role, 0) >= 1]
        assert sum(t["min_workers"] >= 1 for t in carriers) == 1 and all(t["max_workers"] > 0 for t in carriers)
        for carrier in carriers:
            gpu_type = carrier["node_config"].get("InstanceType") or carrier["node_config"]["machineType"]
            assert re.match(r"(g\d|p\d|a2-|a3-|g2-)", gpu_type), gpu_type
    assert max(t["resources"].get("prefill", 0) for t in types.values()) == 4  # a tensor-parallel prefill node
    # Every role resource the multi-node serve config asks for is advertised by some node type.
    wanted = {res for role in ("prefill", "decode", "postproc", "ingress")
              for res in _yaml(REPO / "configs" / "multinode.yaml")[role].get("resources", {})}
    assert wanted <= {res for t in types.values() for res in t["resources"]}


@pytest.mark.parametrize("ips, gpus, expected", [("10.0.0.11 172.17.0.1", 2, {"prefill": 2}),
                                                 ("10.0.0.21", 0, {"decode": 1})])
def test_onprem_workers_start_with_their_role_resource(ips, gpus, expected):
    raw = _yaml(REPO / "configs" / "cluster" / "local.yaml")
    start = raw["worker_start_ray_commands"][-1]
    assert set(re.findall(r"\d+\.\d+\.\d+\.\d+", start)) <= set(raw["provider"]["worker_ips"])
    # The command as a worker runs it, with hostname, nvidia-smi and ray stubbed to report what it would start.
    stubs = (f'hostname() {{ echo "{ips} "; }}; nvidia-smi() {{ for i in $(seq {gpus}); do echo GPU; done; }}; '
             'ray() { printf "%s\\n" "$@"; }; RAY_HEAD_IP=10.0.0.10; ')
    out = subprocess.run(["bash", "-c", stubs + start], capture_output=True, text=True, timeout=30, check=True).stdout
    args = out.splitlines()
    assert "--address=10.0.0.10:6379" in args
    assert json.loads(next(a for a in args if a.startswith("--resources=")).split("=", 1)[1]) == expected


# ---- tensor-parallel roles ----

def _tp_model(workdir, heads: int = 8, kv_heads: int = 2) -> str:
    model = workdir / "models" / f"heads-{heads}-{kv_heads}"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_attention_heads": heads, "num_key_value_heads": kv_heads}))
    return str(model)


def test_a_tensor_parallel_role_is_a_placement_group_of_its_bundles(workdir):
    config = RaypdConfig(model=_tp_model(workdir), prefill={"tensor_parallel_size": 4, "num_gpus": 1,
                                                              "resources": {"prefill": 1}},
                         decode={"tensor_parallel_size": 2, "num_cpus": 2, "placement_strategy": "STRICT_PACK"})
    prefill = config.prefill.deployment_options()
    assert prefill["placement_group_bundles"] == [{"CPU": 1, "GPU": 1, "prefill": 1}] * 4
    assert prefill["placement_group_strategy"] == "PACK"
    assert config.decode.deployment_options()["placement_group_bundles"] == [{"CPU": 2}] * 2
    assert config.engine_config(role="prefill").tensor_parallel_size == 4
    assert config.engine_config(role="decode").tensor_parallel_size == 2
    assert "placement_group_bundles" not in config.ingress.deployment_options()


@pytest.mark.parametrize("roles, message", [
    ({"prefill": {"tensor_parallel_size": 3, "num_cpus": 1}}, "prefill.tensor_parallel_size 3 does not divide"),
    ({"decode": {"tensor_parallel_size": 4, "num_cpus": 1}}, "decode.tensor_parallel_size 4 does not divide .* 2 KV"),
    ({"postproc": {"tensor_parallel_size": 2}}, "postproc runs no model shards"),
    ({"prefill": {"tensor_parallel_size": 2, "num_cpus": 0}}, "each bundle .* needs something to reserve"),
    ({"engine": {"batch_invariant": True}, "decode": {"tensor_parallel_size": 2, "num_cpus": 1}},
     "batch_invariant is built for one rank; decode.tensor_parallel_size is 2"),
])
def test_what_cannot_split_or_place_is_named_before_anything_starts(workdir, roles, message):
    with pytest.raises(ConfigError, match=message):
        load_config_from(workdir, {"model": _tp_model(workdir, heads=6, kv_heads=2), **roles})


def load_config_from(workdir, data: dict) -> RaypdConfig:
    path = workdir / "tp.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def test_validate_checks_the_bundles_against_the_cluster_files_node_types(workdir, capsys):
    model = _tp_model(workdir)
    aws = str(REPO / "configs" / "cluster" / "aws.yaml")
    gpu_role = {"num_gpus": 1, "resources": {"prefill": 1}}
    fits = load_config_from(workdir, {"model": model, "prefill": {**gpu_role, "tensor_parallel_size": 4}})
    path = workdir / "tp.yaml"
    assert main(["validate", str(path), "--cluster", aws]) == 0
    assert "tensor_parallel_size 4 (PACK bundles of" in capsys.readouterr().out
    load_config_from(workdir, {"model": model, "prefill": {**gpu_role, "tensor_parallel_size": 8,
                                                              "placement_strategy": "STRICT_PACK"}})
    assert main(["validate", str(path), "--cluster", aws]) == 2
    assert "the most bundles one node type offers is 4" in capsys.readouterr().err
    load_config_from(workdir, {"model": model, "prefill": {**gpu_role, "tensor_parallel_size": 8}})
    assert main(["validate", str(path), "--cluster", aws]) == 0
    assert "its ranks will span nodes" in capsys.readouterr().out
    load_config_from(workdir, {"model": model, "decode": {"tensor_parallel_size": 2, "num_gpus": 1,
                                                             "resources": {"nowhere": 1}}})
    assert main(["validate", str(path), "--cluster", aws]) == 2
    assert "no node type offers even one bundle" in capsys.readouterr().err
    assert fits.prefill.tensor_parallel_size == 4


def test_raypd_serve_sets_serves_pace_and_keeps_what_the_environment_says(monkeypatch):
    from cluster.serving.ray_env import pace_settings, use_serve_env

    monkeypatch.setattr(os, "environ", {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.2"})  # the process's own is untouched
    use_serve_env()
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.2"
    assert os.environ["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == pace_settings()["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"]
    assert os.environ["RAY_worker_niceness"] == "0"  # raypd's workers run as the command does (roles' `nice` aside)
