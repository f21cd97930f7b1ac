"""Write the RayService manifests' `serveConfigV2` from deploy.yaml / deploy-gpu.yaml.

One source for the Serve application: the manifests embed the local config files with a
short, declared list of cluster overrides (`OVERRIDES`, each with its reason), so a change
to deploy.yaml reaches Kubernetes by running `python -m k8s.generate` (`make k8s-manifests`)
and cannot drift unnoticed (`--check`, and tests/k8s). Only the block between the
`# BEGIN generated serveConfigV2` and `# END generated serveConfigV2` lines is rewritten;
the rest of each manifest (the Ray cluster) is written by hand, with its comments.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

REPO = Path(__file__).resolve().parents[1]
BEGIN = "# BEGIN generated serveConfigV2"
END = "# END generated serveConfigV2"
INDENT = "  "  # serveConfigV2 sits under `spec:`


@dataclass(frozen=True)
class Override:
    """One difference between the local config file and the cluster's serve config."""

    path: tuple[Any, ...]  # keys and list indices into the config document
    value: Any
    reason: str


# Every Ray node runs a Serve proxy: KubeRay's serve service (<name>-serve-svc) sends traffic
# to each pod whose proxy is healthy, and a RayService worker pod is Ready only when its
# proxy answers (the readiness probe checks :8000/-/healthz).
_CLUSTER_HTTP = (
    Override(("proxy_location",), "EveryNode",
             "a proxy on every pod: KubeRay's serve service and worker readiness probes need one"),
    Override(("http_options", "host"), "0.0.0.0", "the serve service reaches the proxies by pod IP"),
)

GPU_AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 4,               # one GPU per Replica: the gpu worker group's maxReplicas
    "target_ongoing_requests": 48,   # the pack target (autoscaling simulator, gpu profile)
    "look_back_period_s": 15,
    "upscale_delay_s": 10,
    "downscale_delay_s": 300,        # a GPU Replica takes minutes to come back
    "policy": {
        "policy_function": "autoscaling.policy:AcceptanceAwarePolicy",
        # pinned to the Replica's user_config batch_gate (not followed when it changes): hybrid on
        # TensorRT-LLM drafts at every batch size and its replicas report no gate to read
        "policy_kwargs": {"batch_gate": 16},
    },
}

OVERRIDES: dict[str, tuple[str, tuple[Override, ...]]] = {
    "k8s/rayservice-cpu.yaml": ("deploy.yaml", _CLUSTER_HTTP + (
        Override(("applications", 0, "deployments", 0, "autoscaling_config", "max_replicas"), 4,
                 "two 2-CPU worker pods at most (cpu group maxReplicas), two 1-CPU Replicas each"),
    )),
    "k8s/rayservice-gpu.yaml": ("deploy-gpu.yaml", _CLUSTER_HTTP + (
        Override(("applications", 0, "deployments", 0, "autoscaling_config"), GPU_AUTOSCALING,
                 "acceptance-aware autoscaling over the gpu worker group (one GPU per Replica)"),
    )),
}


def _set(document: Any, path: Sequence[Any], value: Any) -> None:
    """Set `path` in `document`; every step but the last must exist (a renamed key fails here)."""
    node = document
    for i, step in enumerate(path[:-1]):
        try:
            node = node[step]
        except (KeyError, IndexError, TypeError) as exc:
            raise KeyError(f"override path {list(path)}: {list(path[: i + 1])} is not in the source") from exc
    node[path[-1]] = copy.deepcopy(value)


def serve_config(manifest: str) -> dict[str, Any]:
    """The serve config `manifest` embeds: its source file with the declared overrides."""
    source, overrides = OVERRIDES[manifest]
    document = yaml.safe_load((REPO / source).read_text())
    for override in overrides:
        _set(document, override.path, override.value)
    return document


# Where a trtllm Replica's weights come from, stated in the generated header; the env and
# volume it names are the gpu worker's, written by hand below the block (tests/k8s checks them).
HF_TOKEN_SECRET = "hf-token"
HF_HOME = "/data/hf"
HF_CACHE_VOLUME = "hf-cache"


def weights_note(config: dict[str, Any]) -> list[str]:
    """How each application's model weights reach its Replicas, read from the serve config."""
    lines = []
    for app in config.get("applications", []):
        engine = (app.get("args") or {}).get("engine") or {}
        if engine.get("kind") != "trtllm":
            lines.append(f"Weights ({app['name']}): the embedded model ships in the image; nothing is downloaded.")
            continue
        hub = [engine["model"], (engine.get("trtllm") or {}).get("draft_model")]
        lines += [f"Weights ({app['name']}): each Replica downloads {' and '.join(filter(None, hub))}",
                  f"  from the Hugging Face Hub at start (the gated model with HF_TOKEN from the Secret "
                  f"{HF_TOKEN_SECRET}),",
                  f"  into HF_HOME={HF_HOME} on the volume {HF_CACHE_VOLUME} (emptyDir; a ReadWriteMany "
                  "PersistentVolumeClaim shares one copy)."]
    return lines


def _path_text(path: Sequence[Any]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def render_block(manifest: str) -> str:
    """The generated lines, BEGIN to END, indented for `spec:`."""
    source, overrides = OVERRIDES[manifest]
    header = [f"{BEGIN}: written by `python -m k8s.generate` from {source}.",
              f"# Edit {source} (or OVERRIDES in k8s/generate.py) and regenerate; here it differs in:"]
    header += [f"#   {_path_text(o.path)}: {o.reason}" for o in overrides]
    config = serve_config(manifest)
    header += [f"# {line}" for line in weights_note(config)]
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=100)
    lines = [INDENT + line for line in header] + [INDENT + "serveConfigV2: |"]
    lines += [INDENT * 2 + line if line else "" for line in body.splitlines()]
    lines.append(INDENT + END)
    return "\n".join(lines) + "\n"


def render(manifest: str, text: str) -> str:
    """`text` (the manifest) with its generated block replaced by a fresh one."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip().startswith(BEGIN)]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"{manifest}: needs exactly one '{BEGIN}' line before one '{END}' line")
    return "".join(lines[: starts[0]]) + render_block(manifest) + "".join(lines[ends[0] + 1:])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k8s.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report manifests that are out of date")
    options = parser.parse_args(argv)
    stale = 0
    for manifest in OVERRIDES:
        path = REPO / manifest
        current = path.read_text()
        fresh = render(manifest, current)
        if fresh == current:
            continue
        if options.check:
            stale += 1
            sys.stdout.writelines(difflib.unified_diff(
                current.splitlines(keepends=True), fresh.splitlines(keepends=True), manifest, f"{manifest} (generated)"))
        else:
            path.write_text(fresh)
            print(f"wrote {manifest}")
    if stale:
        print(f"{stale} manifest(s) out of date: run `python -m k8s.generate`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
