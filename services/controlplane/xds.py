"""Filesystem xDS: the control plane's view of the gateway replicas, served to Envoy as CDS + EDS files.

Why files: Envoy's filesystem subscription (``path_config_source`` + ``watched_directory``) needs no
extra server, survives a control-plane restart (the last state stays on disk) and is atomic: each
update is written to a temporary file in the same directory and ``os.replace``d over the old one,
which Envoy sees as one move event and reloads. A gRPC ADS server would buy push-acknowledgement
(NACK handling) at the cost of a long-lived server and a dependency on Envoy's generated protos.

Two clusters, both EDS:
- ``meshserve_gateway_grpc``: the gateways' gRPC ports (HTTP/2, active gRPC health checks);
- ``meshserve_gateway_http``: the OpenAI HTTP adapters (HTTP/1.1, ``GET /healthz`` checks).
A replica set change rewrites only that cluster's EDS file; CDS is written once.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

GRPC_CLUSTER = "meshserve_gateway_grpc"
HTTP_CLUSTER = "meshserve_gateway_http"
_CLA = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
_CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
_HTTP2 = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"endpoint {address!r} must be host:port")
    return host, int(port)


class FileXds:
    """Writes Envoy's CDS/EDS files into ``directory``; each ``set_endpoints`` is one atomic update."""

    def __init__(self, directory: str | Path, health_interval_s: float = 1.0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._health_interval_s = health_interval_s
        self._versions: dict[str, int] = {}
        self.endpoints: dict[str, list[str]] = {GRPC_CLUSTER: [], HTTP_CLUSTER: []}

    @property
    def cds_path(self) -> Path:
        return self.directory / "cds.yaml"

    def eds_path(self, cluster: str) -> Path:
        return self.directory / f"eds_{cluster}.yaml"

    def write_all(self) -> None:
        """Write every EDS file, then CDS (so the clusters' EDS sources exist when Envoy reads CDS)."""
        for cluster, addresses in self.endpoints.items():
            self.set_endpoints(cluster, addresses)
        self._write(self.cds_path, self._discovery("cds", [self._cluster(c) for c in self.endpoints]))

    def set_endpoints(self, cluster: str, addresses: Iterable[str]) -> int:
        """Replace ``cluster``'s endpoints; returns the new EDS version."""
        if cluster not in self.endpoints:
            raise KeyError(f"unknown cluster {cluster!r}; expected one of {sorted(self.endpoints)}")
        self.endpoints[cluster] = list(addresses)
        lb_endpoints = []
        for address in self.endpoints[cluster]:
            host, port = _split(address)
            socket = {"address": host, "port_value": port}
            lb_endpoints.append({"endpoint": {"address": {"socket_address": socket}}})
        assignment = {"@type": _CLA, "cluster_name": cluster, "endpoints": [{"lb_endpoints": lb_endpoints}]}
        self._write(self.eds_path(cluster), self._discovery(cluster, [assignment]))
        return self._versions[cluster]

    def _discovery(self, key: str, resources: list[dict[str, Any]]) -> dict[str, Any]:
        self._versions[key] = self._versions.get(key, 0) + 1
        return {"version_info": str(self._versions[key]), "resources": resources}

    def _cluster(self, name: str) -> dict[str, Any]:
        interval = f"{self._health_interval_s:g}s"
        check: dict[str, Any] = {
            "timeout": "1s",
            "interval": interval,
            "no_traffic_interval": interval,  # default 60 s would keep a dead idle replica for a minute
            "healthy_threshold": 1,
            "unhealthy_threshold": 2,
        }
        cluster: dict[str, Any] = {
            "@type": _CLUSTER,
            "name": name,
            "type": "EDS",
            "connect_timeout": "1s",
            "lb_policy": "ROUND_ROBIN",
            # Envoy batches host-health changes for 1 s by default before its workers see them; a
            # replica set this small gains nothing from batching, so changes apply at once.
            "common_lb_config": {"update_merge_window": "0s"},
            # Without this Envoy keeps a removed replica while it still passes health checks, so a
            # replica the control plane takes out for draining would keep receiving new requests.
            "ignore_health_on_host_removal": True,
            "eds_cluster_config": {
                "eds_config": {
                    "resource_api_version": "V3",
                    "path_config_source": {
                        "path": str(self.eds_path(name)),
                        "watched_directory": {"path": str(self.directory)},
                    },
                }
            },
            # A host that fails its checks leaves rotation; one that passes joins at once.
            "health_checks": [check],
        }
        if name == GRPC_CLUSTER:
            check["grpc_health_check"] = {}
            cluster["typed_extension_protocol_options"] = _HTTP2
        else:
            check["http_health_check"] = {"path": "/healthz"}
        return cluster

    def _write(self, path: Path, doc: dict[str, Any]) -> None:
        """Write ``doc`` next to ``path`` and rename it over ``path`` (Envoy sees one move)."""
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".yaml")
        try:
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump(doc, f, sort_keys=False)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
