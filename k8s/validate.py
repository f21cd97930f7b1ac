"""Check Kubernetes manifests as strictly as a cluster would, without a cluster.

`python -m k8s.validate k8s/*.yaml` checks every custom resource in the files against its
CRD made strict (k8s/crd.py), and each RayService further:
- the name is a DNS-1035 label of at most 47 characters (KubeRay appends `-xxxxx` to name
  the RayCluster, whose limit is 53);
- `rayClusterConfig` also passes the RayCluster CRD's `spec` schema;
- the rules KubeRay's operator enforces in Go (utils/validation.go) that the schema cannot
  express: min <= replicas <= max per worker group, unique group names, no `labels` in
  rayStartParams, token auth only with Ray >= 2.52; and one image for every Ray container
  (Ray needs the same Ray and Python on every node);
- the embedded `serveConfigV2` passes `deploy.config_check` (Serve's schema plus our
  AppArgs, unknown keys rejected), and the Serve fleet fits the worker groups: every
  Replica's CPUs/GPUs fit in one worker pod, and at `max_replicas` they fit in the groups'
  `maxReplicas` pods.

The KubeRay CRDs are read from ../shared/k8s (`--crd-dir`); `--crd FILE` adds another CRD
(e.g. Prometheus Operator's PodMonitor). A document whose kind has no CRD is an error.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import yaml

from k8s.crd import StrictCrd, load_crd, object_meta_schema, schema_errors

DEFAULT_CRD_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "k8s"
RAYSERVICE_CRD = "ray.io_rayservices.yaml"
RAYCLUSTER_CRD = "ray.io_rayclusters.yaml"

MAX_RAYCLUSTER_NAME = 53  # KubeRay utils.MaxRayClusterNameLength
MAX_RAYSERVICE_NAME = MAX_RAYCLUSTER_NAME - 6  # the RayCluster is named <rayservice>-<5 chars>
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MIN_RAY_FOR_TOKEN_AUTH = (2, 52, 0)
RAY_START_RESOURCE_KEYS = ("num-cpus", "num-gpus", "memory", "resources")
GPU_RESOURCE = "nvidia.com/gpu"


class ManifestValidator:
    """Holds the strict CRDs; `check_file` / `check_document` return problems as lines."""

    def __init__(self, crd_dir: Path = DEFAULT_CRD_DIR, extra_crds: Sequence[Path] = ()) -> None:
        crd_dir = Path(crd_dir)
        missing = [name for name in (RAYSERVICE_CRD, RAYCLUSTER_CRD) if not (crd_dir / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"KubeRay CRDs {missing} not found in {crd_dir.resolve()}: the shared directory beside "
                "the repository (../shared/k8s) must be present, or pass --crd-dir")
        self.rayservice = StrictCrd(load_crd(crd_dir / RAYSERVICE_CRD), "v1",
                                    object_meta_schema(MAX_RAYSERVICE_NAME, DNS1035_LABEL))
        self.raycluster = StrictCrd(load_crd(crd_dir / RAYCLUSTER_CRD), "v1",
                                    object_meta_schema(MAX_RAYCLUSTER_NAME, DNS1035_LABEL))
        self.crds = {(c.api_version, c.kind): c for c in (self.rayservice, self.raycluster)}
        for path in extra_crds:
            crd = StrictCrd(load_crd(path), metadata_schema=object_meta_schema(253, DNS1123_SUBDOMAIN))
            self.crds[(crd.api_version, crd.kind)] = crd

    def check_file(self, path: Path) -> list[str]:
        problems = []
        for i, document in enumerate(yaml.safe_load_all(Path(path).read_text())):
            if document is not None:
                problems += [f"document {i}: {p}" for p in self.check_document(document)]
        return problems

    def check_document(self, document: Any) -> list[str]:
        if not isinstance(document, dict):
            return ["not a mapping"]
        crd = self.crds.get((document.get("apiVersion"), document.get("kind")))
        if crd is None:
            return [f"no CRD loaded for apiVersion {document.get('apiVersion')!r} kind {document.get('kind')!r}"]
        problems = crd.errors(document)
        problems += [f"{where}: carries a CEL rule (x-kubernetes-validations) this check cannot evaluate"
                     for where in crd.cel_rules_reached(document)]
        if crd is self.rayservice and not problems:
            problems += self._rayservice_problems(document)
        return problems

    def _rayservice_problems(self, document: dict[str, Any]) -> list[str]:
        spec = document["spec"]
        cluster = spec["rayClusterConfig"]
        problems = [f"spec.rayClusterConfig (as a RayCluster spec): {p}"
                    for p in schema_errors(self.raycluster.subschema("spec"), cluster)]
        problems += [f"spec.rayClusterConfig.{p}" for p in kuberay_rules(cluster)]
        if "serveConfigV2" not in spec:
            return problems + ["spec.serveConfigV2: missing (the RayService would serve nothing)"]
        try:
            serve_config = yaml.safe_load(spec["serveConfigV2"])
        except yaml.YAMLError as exc:
            return problems + [f"spec.serveConfigV2: not valid YAML: {exc}"]
        if not isinstance(serve_config, dict):
            return problems + ["spec.serveConfigV2: not a YAML mapping"]
        from deploy.config_check import check_serve_config

        serve_problems = check_serve_config(serve_config)
        problems += [f"spec.serveConfigV2: {p}" for p in serve_problems]
        if not serve_problems:
            problems += [f"spec.serveConfigV2 on spec.rayClusterConfig.workerGroupSpecs: {p}"
                         for p in fleet_fits(serve_config, cluster)]
        return problems


def _groups(cluster: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [("headGroupSpec", cluster["headGroupSpec"])] + [
        (f"workerGroupSpecs[{i}]", g) for i, g in enumerate(cluster.get("workerGroupSpecs", []))]


def _version(text: str) -> Optional[tuple[int, ...]]:
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", text or "")
    return tuple(int(x) for x in match.groups()) if match else None


def kuberay_rules(cluster: dict[str, Any]) -> list[str]:
    """What KubeRay's ValidateRayClusterSpec rejects that the CRD schema lets through, plus one image."""
    problems = []
    names = [g.get("groupName") for g in cluster.get("workerGroupSpecs", [])]
    problems += [f"workerGroupSpecs: groupName {n!r} is used twice" for n in sorted({n for n in names if names.count(n) > 1})]
    head_image = cluster["headGroupSpec"]["template"]["spec"]["containers"][0].get("image")
    for where, group in _groups(cluster):
        params = group.get("rayStartParams", {})
        if "labels" in params:
            problems.append(f"{where}.rayStartParams.labels: not supported; use the group's `labels` field")
        if group.get("resources") and any(k in params for k in RAY_START_RESOURCE_KEYS):
            problems.append(f"{where}: resources set both in rayStartParams and in `resources`")
        image = group["template"]["spec"]["containers"][0].get("image")
        if image != head_image:
            problems.append(f"{where}.template.spec.containers[0].image: {image!r} differs from the head's "
                            f"{head_image!r}; every node needs the same Ray, Python and application code")
        if where != "headGroupSpec":
            low, high = group["minReplicas"], group["maxReplicas"]
            replicas = group.get("replicas", low)
            if not low <= replicas <= high:
                problems.append(f"{where}: needs minReplicas <= replicas <= maxReplicas, got {low}, {replicas}, {high}")
    if (cluster.get("authOptions") or {}).get("mode") == "token":
        version = _version(cluster.get("rayVersion", ""))
        if version is None or version < MIN_RAY_FOR_TOKEN_AUTH:
            problems.append(f"authOptions.mode token needs rayVersion >= 2.52.0, got {cluster.get('rayVersion')!r}")
    return problems


def quantity(value: Any) -> float:
    """A Kubernetes quantity as a float ('500m' -> 0.5, '64Gi' -> 64 * 2**30, 2 -> 2.0)."""
    text = str(value)
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
                "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    for suffix in sorted(suffixes, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * suffixes[suffix]
    return float(text)


def ray_resources(group: dict[str, Any]) -> tuple[float, float]:
    """(CPUs, GPUs) Ray sees on one pod of `group`: rayStartParams, else the container limits."""
    params = group.get("rayStartParams", {})
    container = group["template"]["spec"]["containers"][0]
    resources = container.get("resources", {})
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    cpu = params.get("num-cpus", limits.get("cpu", requests.get("cpu", 0)))
    gpu = params.get("num-gpus", limits.get(GPU_RESOURCE, 0))
    return quantity(cpu), quantity(gpu)


def fleet_fits(serve_config: dict[str, Any], cluster: dict[str, Any]) -> list[str]:
    """Problems if the Serve Replicas cannot be placed on the worker groups at their maximum."""
    from deploy.config import AppArgs
    from deploy.config_check import autoscaling_in_force

    problems = []
    workers = cluster.get("workerGroupSpecs", [])
    for app in serve_config.get("applications", []):
        args = AppArgs.model_validate(app.get("args") or {})
        override = next((d for d in app.get("deployments") or [] if d.get("name") == "Replica"), {})
        need_cpu, need_gpu = args.replica.num_cpus, args.replica.num_gpus
        if "ray_actor_options" in override:  # the file's replace the app's whole, Ray's defaults beneath
            actor = override["ray_actor_options"] or {}
            need_cpu, need_gpu = actor.get("num_cpus", 1), actor.get("num_gpus", 0)
        autoscaling = autoscaling_in_force(override)
        wanted = autoscaling.get("max_replicas", 1) if autoscaling else override.get("num_replicas", args.replica.num_replicas)
        capacity = 0
        for group in workers:
            cpus, gpus = ray_resources(group)
            fits = [cpus // need_cpu if need_cpu else float("inf"), gpus // need_gpu if need_gpu else float("inf")]
            per_pod = int(min(fits)) if min(fits) != float("inf") else 1
            capacity += per_pod * group["maxReplicas"]
        if wanted > capacity:
            problems.append(
                f"application {app.get('name')!r}: Serve may run {wanted} Replicas "
                f"({need_cpu:g} CPU, {need_gpu:g} GPU each) but the worker groups hold at most {capacity}")
    return problems


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k8s.validate", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--crd-dir", type=Path, default=DEFAULT_CRD_DIR, help="where the KubeRay CRDs are")
    parser.add_argument("--crd", type=Path, action="append", default=[], help="another CRD file to check against")
    options = parser.parse_args(list(argv) if argv is not None else None)
    try:
        validator = ManifestValidator(options.crd_dir, options.crd)
    except OSError as exc:  # a CRD file or directory that is not there: said, not a traceback
        parser.error(str(exc))
    failed = 0
    for path in options.files:
        problems = validator.check_file(path)
        for problem in problems:
            print(f"{path}: {problem}")
        failed += bool(problems)
        if not problems:
            print(f"{path}: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
