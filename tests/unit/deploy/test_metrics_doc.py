"""docs/metrics.md lists exactly the metrics the services export, with their types and labels."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.deploy import exported_metrics

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"


def _documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `(meshserve_\w+)` \| (\w+) \| ([^|]+) \|", line)
        if m:
            labels = () if m[3].strip() == "(none)" else tuple(x.strip() for x in m[3].split(","))
            assert m[1] not in rows, f"{m[1]} is documented twice"
            rows[m[1]] = (m[2], labels)
    return rows


def test_every_exported_metric_is_documented_with_its_type_and_labels() -> None:
    documented = _documented()
    exported = exported_metrics.exported()
    assert set(exported) - set(documented) == set(), "exported but not in docs/metrics.md"
    assert set(documented) - set(exported) == set(), "documented but no service exports it"
    for name, metric in exported.items():
        assert documented[name] == (metric.type, metric.labels), name


def test_metrics_are_found_in_every_module_that_defines_them() -> None:
    modules = exported_metrics.metric_modules()
    assert {"services.common.metrics", "services.router.metrics", "services.gateway.ratelimit"} <= set(modules)
    owners = {m.module for m in exported_metrics.exported().values()}
    assert owners <= set(modules)
