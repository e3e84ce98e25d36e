"""The Grafana dashboard queries exactly what the services export.

Every PromQL expression is parsed (promql-parser); each metric it selects must be a series of the
real registry (:mod:`tests.unit.deploy.exported_metrics`), and each label it matches or groups by
must be one of that metric's labels (or a label Prometheus attaches to the target).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from tests.unit.deploy import exported_metrics, settings_check

GRAFANA = Path(__file__).resolve().parents[3] / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "meshserve.json"
TARGET_LABELS = {"job", "instance", "component", "namespace", "pod", "container"}
"""Added by the scrape (deploy/prometheus/prometheus.yml relabels `component`; Kubernetes SD adds the rest)."""
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def _panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in doc["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _expressions() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in _panels(doc) for t in p.get("targets", [])]


def _parse(expr: str, values: dict[str, set[str]] | None = None) -> tuple[set[str], set[str]]:
    """(metric names selected, label names matched or grouped by) of one expression.

    ``values`` collects the values each label is matched against (regex alternatives split).
    """
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    tree = promql_parser.parse(expr)
    metrics: set[str] = set()
    labels: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"select metrics by name, not by matchers only: {expr}"
            metrics.add(node.name)
            labels.update(m.name for m in node.matchers.matchers)
            if values is not None:
                for m in node.matchers.matchers:
                    values.setdefault(m.name, set()).update(m.value.split("|"))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                labels.update(node.modifier.matching.labels)

    promql_parser.walk(tree, pre_visit=visit)
    return metrics, labels


def _family_labels(series: str) -> set[str] | None:
    """Labels of the meshserve metric a series belongs to (None for the default collectors' series)."""
    for metric in exported_metrics.exported().values():
        if series in metric.series:
            return set(metric.labels) | ({"le"} if series.endswith("_bucket") else set())
    return None


def test_every_queried_metric_and_label_is_exported() -> None:
    exported = exported_metrics.all_series()
    expressions = _expressions()
    assert len(expressions) >= 20
    for title, expr in expressions:
        metrics, labels = _parse(expr)
        for name in metrics:
            assert name in exported, f"panel {title!r} queries {name}, which no service exports"
        known = set().union(*[_family_labels(m) or set() for m in metrics]) | TARGET_LABELS
        assert labels <= known, f"panel {title!r} uses labels {sorted(labels - known)} no queried metric has"


def test_the_dashboard_shows_what_an_operator_needs() -> None:
    queried = set().union(*[_parse(expr)[0] for _, expr in _expressions()])
    required = {
        "meshserve_time_to_first_token_seconds_bucket",  # TTFT percentiles
        "meshserve_time_per_output_token_seconds_bucket",  # inter-token latency percentiles
        "meshserve_tokens_total",  # throughput
        "meshserve_queue_depth",
        "meshserve_cache_lookups_total",  # hit ratio
        "meshserve_route_decisions_total",  # route mix
        "meshserve_rate_limit_rejections_total",
        "meshserve_request_duration_seconds_count",  # errors by status
    }
    assert required <= queried


def test_label_values_are_ones_the_services_use() -> None:
    values: dict[str, set[str]] = {}
    for _, expr in _expressions():
        _parse(expr, values)
    services = {cls.service for cls in settings_check.SETTINGS if hasattr(cls, "service")} | {"cache"}
    assert values["service"] <= services, values["service"] - services
    assert values["direction"] <= {"input", "output"}
    assert values["result"] <= {"hit", "miss", "error", "corrupt", "skipped"}
    assert values["status"] <= {"OK"}  # used as status!="OK"


def test_the_check_rejects_a_misspelled_metric() -> None:
    metrics, _ = _parse('sum(rate(meshserve_time_to_first_token_second_bucket{service="router"}[5m]))')
    assert not metrics <= exported_metrics.all_series()
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(meshserve_tokens_total[5m])")  # unbalanced


def test_panels_use_the_provisioned_datasource() -> None:
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    (source,) = provisioned["datasources"]
    for panel in _panels(json.loads(DASHBOARD.read_text())):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": source["uid"]}
        assert all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"])
