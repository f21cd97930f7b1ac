"""The manifests' serve configs cannot drift from deploy.yaml / deploy-gpu.yaml."""

from __future__ import annotations

import shutil

import pytest
import yaml

from k8s import generate
from tests.k8s.conftest import REPO, serve_config


@pytest.mark.parametrize("manifest", sorted(generate.OVERRIDES))
def test_committed_manifest_is_the_generators_output(manifest):
    text = (REPO / manifest).read_text()
    assert generate.render(manifest, text) == text, "stale: run `python -m k8s.generate` (make k8s-manifests)"


def _leaves(node, path=()):
    """{path: value} for every scalar and empty container in a document."""
    if isinstance(node, dict) and node:
        return {p: v for key, value in node.items() for p, v in _leaves(value, path + (key,)).items()}
    if isinstance(node, list) and node:
        return {p: v for i, value in enumerate(node) for p, v in _leaves(value, path + (i,)).items()}
    return {path: node}


@pytest.mark.parametrize("manifest", sorted(generate.OVERRIDES))
def test_embedded_config_is_the_source_plus_the_declared_overrides(manifests, manifest):
    """Independent of the generator's code: diff the committed manifest against its source file."""
    source, overrides = generate.OVERRIDES[manifest]
    embedded = serve_config(manifests[manifest.removeprefix("k8s/").removesuffix(".yaml")])
    local = _leaves(yaml.safe_load((REPO / source).read_text()))
    cluster = _leaves(embedded)
    differing = {p for p in local.keys() | cluster.keys() if local.get(p, "<absent>") != cluster.get(p, "<absent>")}
    declared = [o.path for o in overrides]
    undeclared = {p for p in differing if not any(p[: len(d)] == d for d in declared)}
    assert undeclared == set(), "the manifest differs from its source outside OVERRIDES"
    for override in overrides:  # and every override holds in the manifest
        node = embedded
        for step in override.path:
            node = node[step]
        assert node == override.value, override.path


def test_router_and_policy_are_configured_in_every_manifest(manifests):
    for name, manifest in manifests.items():
        app = serve_config(manifest)["applications"][0]
        assert app["args"]["replica"]["gate_router"] is True, name
        replica = next(d for d in app["deployments"] if d["name"] == "Replica")
        policy = replica["autoscaling_config"]["policy"]["policy_function"]
        assert policy == "autoscaling.policy:AcceptanceAwarePolicy", name


def test_gpu_policy_starts_from_the_configured_gate(manifests):
    app = serve_config(manifests["rayservice-gpu"])["applications"][0]
    replica = next(d for d in app["deployments"] if d["name"] == "Replica")
    kwargs = replica["autoscaling_config"]["policy"]["policy_kwargs"]
    assert kwargs["batch_gate"] == replica["user_config"]["batch_gate"]


def test_render_needs_its_markers():
    with pytest.raises(ValueError, match="BEGIN generated serveConfigV2"):
        generate.render("k8s/rayservice-cpu.yaml", "apiVersion: ray.io/v1\nspec:\n  serveConfigV2: ''\n")


def test_an_override_into_a_renamed_key_fails_loudly():
    with pytest.raises(KeyError, match="not in the source"):
        generate._set({"applications": []}, ("applications", 0, "deployments"), [])


def test_check_mode_reports_a_stale_manifest(tmp_path, monkeypatch, capsys):
    for manifest in generate.OVERRIDES:
        (tmp_path / manifest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / manifest, tmp_path / manifest)
    for source in ("deploy.yaml", "deploy-gpu.yaml"):
        shutil.copy(REPO / source, tmp_path / source)
    monkeypatch.setattr(generate, "REPO", tmp_path)
    assert generate.main(["--check"]) == 0
    deploy_yaml = tmp_path / "deploy.yaml"
    deploy_yaml.write_text(deploy_yaml.read_text().replace("batch_gate: 4", "batch_gate: 6"))
    assert generate.main(["--check"]) == 1
    assert "+          batch_gate: 6" in capsys.readouterr().out
    assert generate.main([]) == 0  # rewrites the stale manifest
    assert generate.main(["--check"]) == 0


def test_the_gpu_manifest_says_how_weights_arrive(manifests):
    """The generated header names every downloaded checkpoint, and the Secret, HF_HOME and
    volume it promises are the gpu workers' own."""
    text = (REPO / "k8s/rayservice-gpu.yaml").read_text()
    engine = serve_config(manifests["rayservice-gpu"])["applications"][0]["args"]["engine"]
    header = text[text.index(generate.BEGIN):text.index("serveConfigV2: |")]
    for needed in (engine["model"], engine["trtllm"]["draft_model"], "HF_TOKEN", generate.HF_TOKEN_SECRET,
                   generate.HF_HOME, generate.HF_CACHE_VOLUME):
        assert needed in header, needed
    worker = manifests["rayservice-gpu"]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    container = worker["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == generate.HF_TOKEN_SECRET
    assert env["HF_HOME"]["value"] == generate.HF_HOME
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[generate.HF_CACHE_VOLUME] == generate.HF_HOME
    assert generate.HF_CACHE_VOLUME in {v["name"] for v in worker["volumes"]}


def test_the_gpu_replicas_keep_tensorrt_llms_worker_in_process(manifests):
    app = serve_config(manifests["rayservice-gpu"])["applications"][0]
    assert app["runtime_env"]["env_vars"]["TLLM_WORKER_USE_SINGLE_PROCESS"] == "1"
