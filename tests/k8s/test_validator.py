"""The manifests pass KubeRay's CRDs made strict, and the strict check catches what it must."""

from __future__ import annotations

import copy

import pytest
from jsonschema import Draft7Validator

from k8s.crd import schema_errors, strict_schema
from tests.k8s.conftest import MANIFESTS


@pytest.mark.parametrize("manifest", sorted(MANIFESTS))
def test_committed_manifest_is_valid(validator, manifest):
    assert validator.check_file(MANIFESTS[manifest]) == []


def _worker(doc):
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def _container(doc):
    return _worker(doc)["template"]["spec"]["containers"][0]


def _rename(mapping, old, new):
    mapping[new] = mapping.pop(old)


def _serve(doc, old, new):
    doc["spec"]["serveConfigV2"] = doc["spec"]["serveConfigV2"].replace(old, new)


# (case, manifest, plant a mistake, text(s) one reported problem must contain)
PLANTED = [
    ("misspelt container key", "rayservice-gpu", lambda d: _rename(_container(d), "resources", "resouces"),
     "containers[0]: unknown key 'resouces' (did you mean 'resources'?)"),
    ("misspelt spec key", "rayservice-cpu", lambda d: _rename(d["spec"], "serveConfigV2", "serveConfig"),
     "spec: unknown key 'serveConfig'"),
    ("misspelt key in pod template metadata", "rayservice-cpu", lambda d: _rename(_worker(d)["template"]["metadata"], "labels", "lables"),
     "template.metadata: unknown key 'lables'"),
    ("misspelt key in the RayService metadata", "rayservice-cpu", lambda d: _rename(d["metadata"], "labels", "lable"),
     "metadata: unknown key 'lable'"),
    ("GPU quantity that is a word", "rayservice-gpu", lambda d: _container(d)["resources"]["limits"].update({"nvidia.com/gpu": "one"}),
     "limits.nvidia.com/gpu: 'one' is not a Kubernetes quantity"),
    ("GPU quantity with a unit word", "rayservice-gpu", lambda d: _container(d)["resources"]["limits"].update({"nvidia.com/gpu": "1 GPU"}),
     "'1 GPU' is not a Kubernetes quantity"),
    ("GPU quantity as a float list", "rayservice-gpu", lambda d: _container(d)["resources"]["limits"].update({"nvidia.com/gpu": [1]}),
     "limits.nvidia.com/gpu"),
    ("bad emptyDir size", "rayservice-gpu", lambda d: _worker(d)["template"]["spec"]["volumes"][0]["emptyDir"].update({"sizeLimit": "100 GB"}),
     "sizeLimit: '100 GB' is not a Kubernetes quantity"),
    ("rayStartParams value not a string", "rayservice-cpu",
     lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),
     "rayStartParams.num-cpus: 0 is not of type 'string'"),
    ("port number as a string", "rayservice-cpu", lambda d: _container(d)["ports"][0].update({"containerPort": "8000"}),
     "ports[0].containerPort: '8000' is not of type 'integer'"),
    ("port out of int32", "rayservice-cpu", lambda d: _container(d)["ports"][0].update({"containerPort": 2**31}),
     "is not a 'int32'"),
    ("duplicate port", "rayservice-cpu", lambda d: _container(d)["ports"].append({"name": "again", "containerPort": 8000}),
     "duplicate entry {'containerPort': 8000, 'protocol': 'TCP'}"),
    ("bad enum", "rayservice-cpu", lambda d: d["spec"]["rayClusterConfig"]["autoscalerOptions"].update({"upscalingMode": "Fast"}),
     "upscalingMode: 'Fast' is not one of"),
    ("name over 47 characters", "rayservice-cpu", lambda d: d["metadata"].update({"name": "s" * 48}),
     "has 48 characters, more than 47"),
    ("name not a DNS-1035 label", "rayservice-cpu", lambda d: d["metadata"].update({"name": "Specserve_cpu"}),
     "metadata.name: 'Specserve_cpu' does not match"),
    ("name starting with a digit", "rayservice-cpu", lambda d: d["metadata"].update({"name": "1specserve"}),
     "metadata.name: '1specserve' does not match"),
    ("wrong API version", "rayservice-cpu", lambda d: d.update({"apiVersion": "ray.io/v1alpha1"}),
     "no CRD loaded for apiVersion 'ray.io/v1alpha1'"),
    ("field guarded by a CEL rule", "rayservice-cpu", lambda d: d["spec"].update({"managedBy": "ray.io/kuberay-operator"}),
     "spec.managedBy: carries a CEL rule"),
    ("misspelt key in serveConfigV2", "rayservice-cpu", lambda d: _serve(d, "batch_gate:", "batch_gates:"),
     ("spec.serveConfigV2: applications[0].deployments[0].user_config", "batch_gates")),
    ("serveConfigV2 not YAML", "rayservice-cpu", lambda d: _serve(d, "proxy_location:", "proxy_location: ["),
     "spec.serveConfigV2: not valid YAML"),
    ("bad value in serveConfigV2", "rayservice-gpu", lambda d: _serve(d, "mode: hybrid", "mode: turbo"),
     "spec.serveConfigV2: applications[0].deployments[0].user_config.mode"),
    ("misspelt Serve option in serveConfigV2", "rayservice-gpu", lambda d: _serve(d, "max_replicas:", "max_replica:"),
     "unknown key: applications[0].deployments[0].autoscaling_config.max_replica"),
    ("Serve fleet larger than the worker groups", "rayservice-gpu", lambda d: _worker(d).update({"maxReplicas": 2}),
     "Serve may run 4 Replicas (4 CPU, 1 GPU each) but the worker groups hold at most 2"),
    ("the Replica's own ray_actor_options", "rayservice-cpu",
     lambda d: _serve(d, "- name: Replica\n", "- name: Replica\n    ray_actor_options: {num_cpus: 16}\n"),
     "Serve may run 4 Replicas (16 CPU, 0 GPU each) but the worker groups hold at most 0"),
    ("num_replicas auto leaving max_replicas to Serve", "rayservice-cpu",
     lambda d: [_serve(d, "      max_replicas: 4\n", ""),
                _serve(d, "- name: Replica\n", "- name: Replica\n    num_replicas: auto\n")],
     "Serve may run 100 Replicas"),
    ("worker pod too small for one Replica", "rayservice-gpu",
     lambda d: [_container(d)["resources"][k].update({"cpu": "2"}) for k in ("requests", "limits")],
     "the worker groups hold at most 0"),
    ("minReplicas above maxReplicas", "rayservice-cpu", lambda d: _worker(d).update({"minReplicas": 3}),
     "needs minReplicas <= replicas <= maxReplicas, got 3, 1, 2"),
    ("two images in one cluster", "rayservice-cpu", lambda d: _container(d).update({"image": "specserve:0.0.9-cpu"}),
     "image: 'specserve:0.0.9-cpu' differs from the head's"),
    ("token auth on an old Ray", "rayservice-cpu", lambda d: d["spec"]["rayClusterConfig"].update({"rayVersion": "2.40.0"}),
     "authOptions.mode token needs rayVersion >= 2.52.0"),
    ("labels in rayStartParams", "rayservice-cpu",
     lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update({"labels": "a=b"}),
     "rayStartParams.labels: not supported"),
    ("duplicate worker group", "rayservice-cpu",
     lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"].append(copy.deepcopy(_worker(d))),
     "groupName 'cpu' is used twice"),
]


@pytest.mark.parametrize("case,manifest,plant,expected", PLANTED, ids=[row[0] for row in PLANTED])
def test_planted_mistake_is_caught(validator, manifests, case, manifest, plant, expected):
    document = copy.deepcopy(manifests[manifest])
    plant(document)
    problems = validator.check_document(document)
    expected = (expected,) if isinstance(expected, str) else expected
    assert any(all(part in p for part in expected) for p in problems), problems


@pytest.mark.parametrize("gpus", [1, "1", "2", "1000m"])
def test_valid_gpu_quantities_pass(validator, manifests, gpus):
    document = copy.deepcopy(manifests["rayservice-gpu"])
    for kind in ("requests", "limits"):
        _container(document)["resources"][kind]["nvidia.com/gpu"] = gpus
    assert validator.check_document(document) == []


def test_name_of_47_characters_passes(validator, manifests):
    document = copy.deepcopy(manifests["rayservice-cpu"])
    document["metadata"]["name"] = "s" * 47
    assert validator.check_document(document) == []


def test_the_crd_as_published_would_let_the_misspelling_through(validator, manifests):
    """Why the schema is made strict: the CRD alone accepts an unknown key (the API server prunes it)."""
    document = copy.deepcopy(manifests["rayservice-gpu"])
    _rename(_container(document), "resources", "resouces")
    assert list(Draft7Validator(validator.rayservice.raw_schema).iter_errors(document)) == []
    assert validator.check_document(document)


# -- the strictness rules on small schemas -----------------------------------------------------
OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("schema,document,ok", [
    (OBJECT, {"a": 1}, True),
    (OBJECT, {"a": 1, "b": 2}, False),
    ({**OBJECT, "x-kubernetes-preserve-unknown-fields": True}, {"a": 1, "b": {"anything": [1]}}, True),
    ({**OBJECT, "x-kubernetes-preserve-unknown-fields": True}, {"a": "one"}, False),  # listed keys stay typed
    ({"type": "object", "x-kubernetes-preserve-unknown-fields": True}, {"free": 1}, True),
    ({"type": "object"}, {"pruned": 1}, False),  # nothing listed, nothing preserved: every key is unknown
    ({"type": "object", "additionalProperties": {"type": "string"}}, {"any-key": "v"}, True),
    ({"type": "object", "additionalProperties": {"type": "string"}}, {"any-key": 1}, False),
    ({"x-kubernetes-int-or-string": True}, 8000, True),
    ({"x-kubernetes-int-or-string": True}, "http", True),
    ({"x-kubernetes-int-or-string": True}, 1.5, False),
    ({"type": "string", "nullable": True}, None, True),
    ({"type": "string"}, None, False),
    ({"type": "integer", "format": "int32"}, 2**31 - 1, True),
    ({"type": "integer", "format": "int32"}, 2**31, False),
    ({"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}}, ["a", "a"], False),
    ({"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
      "items": {"type": "object", "properties": {"name": {"type": "string"}, "v": {"type": "integer"}}}},
     [{"name": "a", "v": 1}, {"name": "b", "v": 1}], True),
    ({"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
      "items": {"type": "object", "properties": {"name": {"type": "string"}, "v": {"type": "integer"}}}},
     [{"name": "a", "v": 1}, {"name": "a", "v": 2}], False),
])
def test_strict_schema_rules(schema, document, ok):
    assert (schema_errors(strict_schema(schema), document) == []) is ok


def test_strict_schema_leaves_data_keywords_alone():
    schema = {"type": "object", "properties": {"a": {"type": "object", "default": {"x": 1}}}}
    strict = strict_schema(schema)
    assert strict["properties"]["a"]["default"] == {"x": 1}
    assert strict["additionalProperties"] is False and strict["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is not modified


def test_cli_reports_and_fails(crd_dir, tmp_path, capsys):
    from k8s.validate import main

    assert main(["--crd-dir", str(crd_dir), *map(str, MANIFESTS.values())]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(MANIFESTS["rayservice-cpu"].read_text().replace("resources:", "resouces:", 1))
    assert main(["--crd-dir", str(crd_dir), str(bad)]) == 1
    assert "unknown key 'resouces'" in capsys.readouterr().out


def test_missing_crds_fail_with_a_clear_message(tmp_path):
    from k8s.validate import ManifestValidator

    with pytest.raises(FileNotFoundError, match="KubeRay CRDs"):
        ManifestValidator(tmp_path)
