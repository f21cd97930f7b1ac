"""KubeRay deployment: manifest generation and strict validation (run from the repo root).

`python -m k8s.generate` rewrites the `serveConfigV2` blocks of the RayService manifests
from deploy.yaml / deploy-gpu.yaml; `python -m k8s.validate` checks every manifest against
KubeRay's CRDs made strict. Not part of the installed package: the image carries only
deploy, replicas and autoscaling.
"""
