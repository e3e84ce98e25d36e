"""Optional TLS on Envoy's public listener: HTTPS for the openai client, TLS gRPC, no plaintext."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import ssl
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.controlplane.frontdoor import FrontDoor
from tests.integration.frontdoor.conftest import sink, start_named_gateway

pytestmark = pytest.mark.integration


def self_signed(directory: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1/localhost, signed by its own key; returns (cert path, key path)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


async def test_tls_listener_serves_https_and_grpc_over_tls(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    root = await asyncio.to_thread(Path(cert).read_bytes)
    gateway = await start_named_gateway("tls-gateway")
    try:
        async with FrontDoor([f"127.0.0.1:{gateway.port}"], sink, tls_cert=cert, tls_key=key) as door:
            assert door.base_url.startswith("https://")
            http_client = openai.DefaultAsyncHttpxClient(verify=ssl.create_default_context(cafile=cert))
            async with openai.AsyncOpenAI(base_url=door.base_url, api_key="k", http_client=http_client) as client:
                assert [m.id async for m in client.models.list()] == ["tls-gateway"]

            credentials = grpc.ssl_channel_credentials(root_certificates=root)
            async with grpc.aio.secure_channel(door.address, credentials) as channel:
                reply = await inference_pb2_grpc.InferenceStub(channel).ListModels(pb.ListModelsRequest())
                assert reply.models[0].id == "tls-gateway"

            async with aiohttp.ClientSession() as session:
                with pytest.raises(aiohttp.ClientError):  # plaintext HTTP is not served on a TLS listener
                    async with session.get(f"http://{door.address}/v1/models") as reply:
                        await reply.read()
    finally:
        await gateway.stop()
