"""xDS files and the Envoy bootstrap, rendered without running Envoy."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.controlplane.envoy import EnvoyConfig, render_bootstrap
from services.controlplane.xds import GRPC_CLUSTER, HTTP_CLUSTER, FileXds


def test_endpoints_are_written_atomically_with_a_new_version(tmp_path: Path) -> None:
    xds = FileXds(tmp_path)
    xds.endpoints[GRPC_CLUSTER] = ["127.0.0.1:1001"]
    xds.write_all()
    cds = yaml.safe_load(xds.cds_path.read_text())
    assert {c["name"] for c in cds["resources"]} == {GRPC_CLUSTER, HTTP_CLUSTER}
    grpc_cluster = next(c for c in cds["resources"] if c["name"] == GRPC_CLUSTER)
    assert "grpc_health_check" in grpc_cluster["health_checks"][0]
    assert grpc_cluster["ignore_health_on_host_removal"] is True

    before = yaml.safe_load(xds.eds_path(GRPC_CLUSTER).read_text())["version_info"]
    xds.set_endpoints(GRPC_CLUSTER, ["127.0.0.1:1001", "127.0.0.1:1002"])
    eds = yaml.safe_load(xds.eds_path(GRPC_CLUSTER).read_text())
    assert int(eds["version_info"]) == int(before) + 1
    hosts = eds["resources"][0]["endpoints"][0]["lb_endpoints"]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"] for e in hosts]
    assert ports == [1001, 1002]
    assert not list(tmp_path.glob(".tmp-*"))  # nothing half-written left behind


def test_bad_endpoint_and_unknown_cluster_are_refused(tmp_path: Path) -> None:
    xds = FileXds(tmp_path)
    with pytest.raises(ValueError, match="host:port"):
        xds.set_endpoints(GRPC_CLUSTER, ["no-port"])
    with pytest.raises(KeyError):
        xds.set_endpoints("other", [])


def test_bootstrap_plaintext_and_tls(tmp_path: Path) -> None:
    config = EnvoyConfig(xds_dir=tmp_path, listen_port=8080, admin_port=9901, internal_port=9902)
    doc = render_bootstrap(config)
    public = doc["static_resources"]["listeners"][0]
    assert public["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8080}
    assert "transport_socket" not in public["filter_chains"][0]
    assert doc["dynamic_resources"]["cds_config"]["path_config_source"]["path"] == f"{tmp_path}/cds.yaml"

    tls = render_bootstrap(EnvoyConfig(tmp_path, 8080, 9901, 9902, tls_cert="c.pem", tls_key="k.pem"))
    socket = tls["static_resources"]["listeners"][0]["filter_chains"][0]["transport_socket"]
    assert socket["typed_config"]["common_tls_context"]["alpn_protocols"] == ["h2", "http/1.1"]
    with pytest.raises(ValueError, match="both"):
        render_bootstrap(EnvoyConfig(tmp_path, 8080, 9901, 9902, tls_cert="c.pem"))
