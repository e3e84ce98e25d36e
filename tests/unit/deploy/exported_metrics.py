"""Every Prometheus metric the services export, read from the real registry.

:func:`exported` imports each module under ``services/`` that uses prometheus_client (found by
reading the sources, not from a list), which registers its metrics in the default registry exactly
as a running service does, then reads the registry. Series names follow the exposition format:
a counter ``x`` is scraped as ``x_total``; a histogram ``h`` as ``h_bucket``, ``h_sum``, ``h_count``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

ROOT = Path(__file__).resolve().parents[3]
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


@dataclass(frozen=True)
class Metric:
    name: str
    """Family name as documented: counters with their ``_total`` suffix (how they are queried)."""
    type: str
    labels: tuple[str, ...]
    help: str
    module: str

    @property
    def series(self) -> set[str]:
        base = self.name.removesuffix("_total") if self.type == "counter" else self.name
        return {base + suffix for suffix in _SUFFIXES[self.type]}


def metric_modules() -> list[str]:
    """Modules of services/ that define Prometheus metrics (they import prometheus_client)."""
    found = []
    for path in sorted((ROOT / "services").rglob("*.py")):
        if "/pb/" in path.as_posix():
            continue
        text = path.read_text()
        if "prometheus_client import" in text and any(
            f"{kind}(" in text for kind in ("Counter", "Gauge", "Histogram", "Summary", "MetricFamily")
        ):
            found.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


@cache
def exported() -> dict[str, Metric]:
    """meshserve's metrics by documented name (``meshserve_*``)."""
    owners: dict[int, str] = {}
    for module in metric_modules():
        mod = importlib.import_module(module)
        for value in vars(mod).values():
            if isinstance(value, MetricWrapperBase):
                owners.setdefault(id(value), module)
    metrics: dict[str, Metric] = {}
    collectors = {id(c): c for c in REGISTRY._collector_to_names}  # the registry's own view
    for key, collector in collectors.items():
        if not isinstance(collector, MetricWrapperBase):
            _add_custom(metrics, collector)
            continue
        if key not in owners:
            continue
        (family,) = collector.describe()
        name = family.name + "_total" if family.type == "counter" else family.name
        if not name.startswith("meshserve_"):
            continue
        metrics[name] = Metric(name, family.type, tuple(collector._labelnames), family.documentation, owners[key])
    return metrics


def _add_custom(metrics: dict[str, Metric], collector: object) -> None:
    """A custom collector of ours (``describe()`` yields its families, e.g. the cache's counters)."""
    module = type(collector).__module__
    describe = getattr(collector, "describe", None)
    if not module.startswith("services.") or describe is None:
        return
    for family in describe():
        name = family.name + "_total" if family.type == "counter" else family.name
        if name.startswith("meshserve_"):
            metrics[name] = Metric(name, family.type, tuple(family._labelnames), family.documentation, module)


def all_series() -> set[str]:
    """Every series name a scrape of a meshserve service can contain (ours and the default collectors')."""
    names = {s for m in exported().values() for s in m.series}
    for family in REGISTRY.collect():  # process_*, python_* of the default collectors
        names.update(sample.name for sample in family.samples)
    return names
