"""The manifests under k8s/ and KubeRay's CRDs, which live beside the repository.

The CRDs (../shared/k8s, KubeRay v1.7.0) are data shared between projects and never copied
in; CI always has them, so their absence fails every test here with one clear message
rather than skipping the manifests' validation silently.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / ".." / "shared" / "k8s"
CRD_FILES = ("ray.io_rayservices.yaml", "ray.io_rayclusters.yaml")
K8S = REPO / "k8s"
# keyed by file stem: a parameter id "gpu" would make the root conftest skip the test (no CUDA)
MANIFESTS = {"rayservice-cpu": K8S / "rayservice-cpu.yaml", "rayservice-gpu": K8S / "rayservice-gpu.yaml"}


@pytest.fixture(scope="session")
def crd_dir() -> Path:
    missing = [name for name in CRD_FILES if not (CRD_DIR / name).is_file()]
    if missing:
        pytest.fail(f"KubeRay CRDs {missing} are missing from {CRD_DIR.resolve()}: the shared directory "
                    "must sit beside the repository (../shared/k8s) to validate k8s/", pytrace=False)
    return CRD_DIR


@pytest.fixture(scope="session")
def validator(crd_dir):
    from k8s.validate import ManifestValidator

    return ManifestValidator(crd_dir)


@pytest.fixture(scope="session")
def manifests() -> dict[str, dict]:
    """The committed RayService manifests, parsed, by file stem."""
    return {stem: yaml.safe_load(path.read_text()) for stem, path in MANIFESTS.items()}


def serve_config(manifest: dict) -> dict:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])
