"""KubeRay's dashboard imports the policy on a CPU-only head: no torch, no native module."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
import autoscaling.policy, autoscaling.decision
heavy = sorted(m for m in sys.modules if m.split('.')[0] in
               {'torch', 'numpy', 'transformers', 'ray', 'replicas'} or '_sa_native' in m)
print(','.join(heavy))
"""


def test_policy_import_pulls_in_nothing_heavy():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = [m for m in out.stdout.strip().split(",") if m]
    # replicas.stats and replicas.speculation.gate are allowed (standard library only)
    allowed = ("replicas", "replicas.stats", "replicas.speculation", "replicas.speculation.gate")
    assert not [m for m in loaded if m not in allowed], loaded
