"""PodMonitor, Grafana dashboard and alert rules: they select our pods, and chart and watch the
metrics replicas emit (each query parsed as PromQL by promql-parser)."""

from __future__ import annotations

import json
import re

import promql_parser
import pytest
import yaml

from replicas import stats
from tests.k8s.conftest import K8S

KUBERAY_POD_LABELS = {"ray.io/is-ray-node": "yes"}  # set by KubeRay on every Ray pod (labelPod)
OUR_METRICS = {f"ray_{getattr(stats, name)}" for name in dir(stats) if name.startswith("METRIC_")}
HISTOGRAMS = {"ray_spec_acceptance_length", "ray_request_ttft_seconds", "ray_ingress_ttft_seconds",
              "ray_request_tpot_seconds"}


@pytest.fixture(scope="module")
def podmonitor():
    return yaml.safe_load((K8S / "podmonitor.yaml").read_text())


@pytest.fixture(scope="module")
def dashboard():
    return json.loads((K8S / "grafana-dashboard.json").read_text())


def _ray_pods(manifest):
    cluster = manifest["spec"]["rayClusterConfig"]
    yield "head", cluster["headGroupSpec"]["template"]
    for group in cluster["workerGroupSpecs"]:
        yield group["groupName"], group["template"]


def test_podmonitor_selects_every_ray_pod(manifests, podmonitor):
    assert (podmonitor["apiVersion"], podmonitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    wanted = podmonitor["spec"]["selector"]["matchLabels"]
    for name, manifest in manifests.items():
        for group, template in _ray_pods(manifest):
            labels = {**template["metadata"]["labels"], **KUBERAY_POD_LABELS}
            assert wanted.items() <= labels.items(), (name, group)


def test_podmonitor_scrapes_the_port_every_ray_container_names(manifests, podmonitor):
    ports = {endpoint["port"] for endpoint in podmonitor["spec"]["podMetricsEndpoints"]}
    assert ports == {"metrics"}
    for name, manifest in manifests.items():
        for group, template in _ray_pods(manifest):
            named = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
            assert named.get("metrics") == 8080, (name, group)  # Ray's metrics-export-port under KubeRay
            assert named.get("serve") == 8000, (name, group)  # every pod runs a proxy (EveryNode)


def _exprs(dashboard):
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_dashboard_charts_exactly_the_metrics_replicas_emit(dashboard):
    used = set()
    for title, expr in _exprs(dashboard):
        for name in re.findall(r"\bray_[a-z_]+", expr):
            assert name not in HISTOGRAMS, (title, name)  # a histogram is read as _bucket/_sum/_count
            base = re.sub(r"_(bucket|sum|count)$", "", name) if name.rsplit("_", 1)[0] in HISTOGRAMS else name
            assert base in OUR_METRICS, (title, name)
            used.add(base)
        assert expr.count("(") == expr.count(")"), title
    assert used == OUR_METRICS
    assert HISTOGRAMS <= OUR_METRICS


def test_every_query_filters_on_the_label_the_podmonitor_adds(dashboard, podmonitor):
    targets = {r["targetLabel"] for e in podmonitor["spec"]["podMetricsEndpoints"] for r in e["relabelings"]}
    assert "rayservice" in targets
    for title, expr in _exprs(dashboard):
        selectors = re.findall(r"\bray_[a-z_]+(\{[^}]*\})?", expr)
        assert selectors and all(s == '{rayservice=~"$rayservice"}' for s in selectors), title
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "rayservice"} <= variables


def test_dashboard_panels_are_well_formed(dashboard):
    panels = dashboard["panels"]
    assert dashboard["uid"] and dashboard["title"]
    assert len({p["id"] for p in panels}) == len(panels)
    boxes = [(p["gridPos"]["x"], p["gridPos"]["y"], p["gridPos"]["w"], p["gridPos"]["h"]) for p in panels]
    for i, (x, y, w, h) in enumerate(boxes):
        assert x + w <= 24
        for x2, y2, w2, h2 in boxes[i + 1:]:
            assert x + w <= x2 or x2 + w2 <= x or y + h <= y2 or y2 + h2 <= y, "panels overlap"
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


# Serve's own metrics the alerts read, as Ray 2.60 names them (seen on a live Serve's /metrics)
SERVE_METRICS = {"ray_serve_deployment_replica_healthy", "ray_serve_num_http_requests_total"}


def _selectors(node):
    """The vector selectors of a parsed PromQL expression."""
    if isinstance(node, promql_parser.VectorSelector):
        yield node
        return
    for attr in ("lhs", "rhs", "expr", "param", "args", "vector_selector"):
        child = getattr(node, attr, None)
        for item in child if isinstance(child, list) else [child]:
            if isinstance(item, promql_parser.Expr):
                yield from _selectors(item)


def _metric(name: str) -> str:
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return base if base in HISTOGRAMS else name


def test_every_dashboard_query_parses_as_promql(dashboard):
    for title, expr in _exprs(dashboard):
        parsed = promql_parser.parse(expr.replace("$__rate_interval", "5m").replace("$rayservice", ".*"))
        assert {_metric(s.name) for s in _selectors(parsed)} <= OUR_METRICS, title


def test_the_alerts_parse_and_read_metrics_that_exist_on_the_podmonitors_label():
    rules = yaml.safe_load((K8S / "prometheus-rules.yaml").read_text())
    assert (rules["apiVersion"], rules["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    alerts = [rule for group in rules["spec"]["groups"] for rule in group["rules"]]
    assert len({a["alert"] for a in alerts}) == len(alerts) >= 5
    read = set()
    for alert in alerts:
        assert {"expr", "for", "labels", "annotations"} <= alert.keys(), alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning", "info")
        assert {"summary", "description"} <= alert["annotations"].keys()
        selectors = list(_selectors(promql_parser.parse(alert["expr"])))
        for selector in selectors:
            assert _metric(selector.name) in OUR_METRICS | SERVE_METRICS, (alert["alert"], selector.name)
            matchers = {(m.name, str(m.op), m.value) for m in selector.matchers.matchers}
            assert ("rayservice", "MatchOp.NotEqual", "") in matchers, alert["alert"]
            read.add(_metric(selector.name))
    assert SERVE_METRICS <= read  # the set above is what the alerts read, no more
