"""configs/kuberay/rayservice.yaml, checked offline: against KubeRay's own RayService schema, Ray Serve's config schema,
raypd's deployment schema, and Ray's translation of a RayCluster into autoscaler node types.

The schema is KubeRay v1.7.0's CRD (ray-operator/config/crd/bases/ray.io_rayservices.yaml, version v1,
`schema.openAPIV3Schema`, converted to JSON as it is, in tests/cluster/serving/data/). No pip package carries it, and
the CRD is what the API server validates against, so it is the exact check short of a cluster. The API server also
refuses fields the schema does not name (kubectl's strict field validation) where a plain JSON-schema check would let a
misspelt key pass, so the check closes every object the schema lists properties for.
"""

from __future__ import annotations

import copy
import json
import pathlib

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
from ray.serve.schema import ServeDeploySchema

from cluster.config import parse_config

REPO = pathlib.Path(__file__).resolve().parents[3]
MANIFEST = REPO / "configs" / "kuberay" / "rayservice.yaml"
SCHEMA = pathlib.Path(__file__).parent / "data" / "kuberay-v1.7.0-rayservice-v1.schema.json"


def _strict(schema):
    """The CRD schema with unknown fields refused, as the API server's strict field validation does."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator():
    schema = _strict(json.loads(SCHEMA.read_text()))
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _errors(validator, doc) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_manifest_matches_kuberays_rayservice_schema(validator, manifest):
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert _errors(validator, manifest) == []


@pytest.mark.parametrize("path, value, expected", [
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "replica"), 2, "'replica' was unexpected"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "rayStartParams", "num-cpus"), 1, "is not of type 'string'"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 1, "resources", "decode"), 1, "is not of type 'string'"),
    (("spec", "serveConfigV2"), {"applications": []}, "is not of type 'string'"),
])
def test_the_schema_check_catches_the_usual_mistakes(validator, manifest, path, value, expected):
    bad = copy.deepcopy(manifest)
    node = bad
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert any(expected in e for e in _errors(validator, bad)), _errors(validator, bad)


def test_serve_config_and_raypd_args_are_valid(manifest, tmp_path, monkeypatch):
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    app, health = serve_config.applications
    assert (app.import_path, app.route_prefix, serve_config.http_options.port) == ("cluster.serving.app:build_app", "/", 8000)
    assert (health.import_path, health.route_prefix, health.args) == ("cluster.serving.health:build_health_app", "/health",
                                                                     {"app": app.name})
    # Every raypd key as build_app will read it; only the model path is local here (it exists in the pods).
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("RAYPD_API_KEY", "test-key")
    config = parse_config({**app.args, "model": str(tmp_path)}, "serveConfigV2 args")
    assert config.prefill.resources == {"prefill": 1} and config.decode.resources == {"decode": 1}
    assert config.decode.autoscaling is not None and config.http.api_key_value() == "test-key"
    # The same keys as the multi-node serve config users deploy with `ray up`, apart from where the model lives
    # and the endpoint's bind address (Serve's http_options here).
    multinode = yaml.safe_load((REPO / "configs" / "multinode.yaml").read_text())
    for key in ("engine", "prefill", "decode", "postproc", "ingress", "router", "dtype", "request_timeout_s"):
        assert app.args[key] == multinode[key], key


def test_ray_places_each_role_on_its_own_worker_group(manifest):
    cluster = manifest["spec"]["rayClusterConfig"]
    ray_cr = {"metadata": {"name": "raypd", "namespace": "default"}, "spec": cluster}
    node_types = _derive_autoscaling_config_from_ray_cr(ray_cr)["available_node_types"]
    roles = {name: {r for r in ("prefill", "decode") if node_types[name]["resources"].get(r, 0) >= 1}
             for name in node_types}
    assert roles == {"headgroup": set(), "prefill-gpu": {"prefill"}, "decode-gpu": {"decode"}}
    assert all(node_types[g]["resources"]["GPU"] == 1 for g in ("prefill-gpu", "decode-gpu"))
    args = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]
    decode_group = next(g for g in cluster["workerGroupSpecs"] if g["groupName"] == "decode-gpu")
    assert decode_group["maxReplicas"] >= args["decode"]["autoscaling"]["max_replicas"]
    assert cluster["enableInTreeAutoscaling"] is True  # else decode replicas past min would wait for pods forever


def test_every_pod_has_the_key_and_the_model(manifest):
    cluster = manifest["spec"]["rayClusterConfig"]
    model = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]["model"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        (container,) = group["template"]["spec"]["containers"]
        assert {e["name"] for e in container["env"]} >= {"RAYPD_API_KEY"}
        assert any(model.startswith(m["mountPath"] + "/") for m in container["volumeMounts"])
