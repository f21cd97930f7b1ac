"""The image recipes, checked by reading them (no Docker engine here), and the import the
KubeRay dashboard performs, checked for real in a fresh interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest

from tests.k8s.conftest import K8S, REPO, serve_config

DOCKERFILES = {"rayservice-cpu": K8S / "Dockerfile.cpu", "rayservice-gpu": K8S / "Dockerfile.gpu"}


def _instructions(path):
    """Dockerfile instructions as single lines (continuations joined, comments dropped)."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#") and not current:
            continue
        current += raw.rstrip().removesuffix("\\") + " "
        if not raw.rstrip().endswith("\\"):
            if current.strip():
                lines.append(" ".join(current.split()))
            current = ""
    return lines


def _arg(path, name):
    found = [line.split("=", 1)[1] for line in _instructions(path) if line.startswith(f"ARG {name}=")]
    assert len(found) == 1, (path.name, name, found)
    return found[0]


def _pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.mark.parametrize("manifest", sorted(DOCKERFILES))
def test_ray_version_is_the_same_in_image_and_manifest(manifests, manifest):
    import ray

    pinned = _arg(DOCKERFILES[manifest], "RAY_VERSION")
    assert manifests[manifest]["spec"]["rayClusterConfig"]["rayVersion"] == pinned
    # the serve config is validated here with the installed Ray: the same minor release
    assert pinned.split(".")[:2] == ray.__version__.split(".")[:2]


@pytest.mark.parametrize("manifest", sorted(DOCKERFILES))
def test_manifest_runs_the_image_the_recipe_builds(manifests, manifest):
    image = manifests[manifest]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    assert f"-t {image} ." in DOCKERFILES[manifest].read_text() or f"/{image} ." in DOCKERFILES[manifest].read_text()
    assert image.split(":")[1].startswith(_pyproject()["project"]["version"] + "-")


def test_gpu_image_is_the_tensorrt_llm_release_the_docs_pin():
    pinned = re.findall(r"nvcr\.io/nvidia/tensorrt-llm/release:[\w.]+", (REPO / "docs" / "trtllm.md").read_text())
    assert pinned and _arg(DOCKERFILES["rayservice-gpu"], "TRTLLM_IMAGE") == pinned[0]
    assert "FROM ${TRTLLM_IMAGE}" in _instructions(DOCKERFILES["rayservice-gpu"])


def test_cpu_image_is_slim_python_with_cpu_torch():
    steps = _instructions(DOCKERFILES["rayservice-cpu"])
    assert [s for s in steps if s.startswith("FROM ")] == [
        "FROM python:${PYTHON_VERSION}-slim-bookworm AS wheel", "FROM python:${PYTHON_VERSION}-slim-bookworm"]
    assert any("--index-url https://download.pytorch.org/whl/cpu" in s and "torch==" in s for s in steps)


def test_images_install_this_package():
    cpu = _instructions(DOCKERFILES["rayservice-cpu"])
    assert any(s.startswith("RUN pip wheel") and s.endswith(" -w /wheels .") for s in cpu)
    assert any(s.startswith("RUN pip install") and "/wheels/specserve-*.whl" in s for s in cpu)
    gpu = _instructions(DOCKERFILES["rayservice-gpu"])
    # no deps: the package's torch/transformers pins must not replace NVIDIA's builds
    assert any(s.startswith("RUN pip install") and "--no-deps" in s and " . " in s + " " for s in gpu)


@pytest.mark.parametrize("manifest", sorted(DOCKERFILES))
def test_build_context_carries_every_installed_package(manifest):
    needed = ["pyproject.toml", "README.md", "csrc/"] + [f"{p}/" for p in _pyproject()["tool"]["scikit-build"]["wheel"]["packages"]]
    copies = {source for s in _instructions(DOCKERFILES[manifest]) if s.startswith("COPY ") and "--from" not in s
              for source in s.split()[1:-1]}
    assert set(needed) <= copies
    ignore = (DOCKERFILES[manifest].parent / (DOCKERFILES[manifest].name + ".dockerignore")).read_text().splitlines()
    assert ignore[next(i for i, line in enumerate(ignore) if not line.startswith("#"))] == "**"  # allowlist
    assert {f"!{p}" for p in needed} <= set(ignore) and "**/*.so" in ignore


@pytest.mark.parametrize("manifest", sorted(DOCKERFILES))
def test_images_fail_their_build_if_the_dashboard_could_not_import(manifest):
    steps = _instructions(DOCKERFILES[manifest])
    assert any("import sys, deploy.router, autoscaling.policy; assert 'torch' not in sys.modules" in s for s in steps)
    # KubeRay's readiness probe on RayService workers is `bash -c "wget ..."`
    assert any(s.startswith("RUN apt-get") and " wget " in s for s in steps)


def test_the_cpu_images_build_checks_pass_here():
    """The Python its build runs to fail early (the dashboard's imports, the model, an engine
    start), run for real: one named a class long gone, and the image could not build."""
    checks = [m.group(1) for step in _instructions(DOCKERFILES["rayservice-cpu"]) if step.startswith("RUN python")
              for m in re.finditer(r'python -c "([^"]*)"', step)]
    assert len(checks) == 3, checks
    for check in checks:
        done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, (check, done.stderr[-2000:])


def test_dashboard_imports_the_configured_router_and_policy_without_torch(manifests):
    """What KubeRay's dashboard does on a CPU-only head: import both classes, nothing heavy."""
    from deploy.app import ROUTER_CLASS

    paths = {ROUTER_CLASS}
    for manifest in manifests.values():
        for app in serve_config(manifest)["applications"]:
            for deployment in app.get("deployments", []):
                paths.add(deployment["autoscaling_config"]["policy"]["policy_function"])
    script = (
        "import importlib, sys\n"
        f"for path in {sorted(paths)!r}:\n"
        "    module, _, name = path.partition(':')\n"
        "    getattr(importlib.import_module(module), name)\n"
        "heavy = [m for m in ('torch', 'transformers', 'tensorrt_llm', 'replicas.speculation._sa_native') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
