"""TLS on every hop of a real in-process cluster, with certificates from `omnistage certs`:
the image is the plaintext cluster's bit for bit, and a client that does not verify the
cluster's CA (plaintext, another CA, another name) gets nothing."""

from __future__ import annotations

import asyncio
import base64
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import httpx
import numpy as np
import pytest
from cryptography import x509

from omni_common.certs import SERVICES
from omni_common.client import Client
from omni_common.errors import OmniError
from omni_common.health import check_health
from omni_common.net.tls import CLUSTER_NAME, TlsSettings, bind, https_context
from omnistage_cli.main import main as cli

from .conftest import InProcessCluster, InProcessGateway

REQUEST = {"prompt": "over tls", "seed": 5, "width": 64, "height": 64, "steps": 3, "return_tensor": True}


def generate(address: str, **tls: object) -> np.ndarray:
    with Client(address, **tls) as client:  # type: ignore[arg-type]
        tensor = client.generate_result(**REQUEST).tensor  # type: ignore[arg-type]
    assert tensor is not None
    return tensor


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tls") / "certs"
    assert cli(["certs", str(directory)]) == 0
    return directory


@pytest.fixture(scope="module")
def clusters(tiny_model: Path, certs: Path) -> Iterator[tuple[InProcessCluster, np.ndarray]]:
    """A TLS cluster, and the image a plaintext cluster made before it."""
    plain = InProcessCluster(tiny_model)
    plain.start()
    try:
        expected = generate(plain.coordinator)
    finally:
        plain.stop()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMNISTAGE_TLS_CERT", str(certs / "coordinator.pem"))
        env.setenv("OMNISTAGE_TLS_KEY", str(certs / "coordinator-key.pem"))
        env.setenv("OMNISTAGE_TLS_CA", str(certs / "ca.pem"))
        secured = InProcessCluster(tiny_model)
        secured.start()
        yield secured, expected
        secured.stop()


def test_omnistage_certs_makes_a_ca_and_private_keys_for_every_service(certs: Path) -> None:
    assert stat.S_IMODE(certs.stat().st_mode) == 0o700
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    for service in SERVICES:
        assert stat.S_IMODE((certs / f"{service}-key.pem").stat().st_mode) == 0o600
        cert = x509.load_pem_x509_certificate((certs / f"{service}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {service, "localhost", CLUSTER_NAME} <= set(names.get_values_for_type(x509.DNSName))
        assert "127.0.0.1" in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}


def test_a_second_run_keeps_the_certificates_and_force_rotates_them(tmp_path: Path) -> None:
    assert cli(["certs", str(tmp_path / "c")]) == 0
    first = (tmp_path / "c" / "dit-denoise.pem").read_bytes()
    (tmp_path / "c" / "vae-decode.pem").unlink()
    assert cli(["certs", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "dit-denoise.pem").read_bytes() == first
    assert (tmp_path / "c" / "vae-decode.pem").exists()
    assert cli(["certs", str(tmp_path / "c"), "--force"]) == 0
    assert (tmp_path / "c" / "dit-denoise.pem").read_bytes() != first


def test_every_hop_over_tls_gives_the_plaintext_image_bit_for_bit(
    clusters: tuple[InProcessCluster, np.ndarray], certs: Path
) -> None:
    secured, expected = clusters
    got = generate(secured.coordinator, ca_cert=certs / "ca.pem")
    np.testing.assert_array_equal(got, expected)


def test_clients_that_do_not_verify_the_cluster_ca_get_nothing(
    clusters: tuple[InProcessCluster, np.ndarray], certs: Path, tmp_path: Path
) -> None:
    secured, _ = clusters
    assert cli(["certs", str(tmp_path / "other")]) == 0
    other_ca = (tmp_path / "other" / "ca.pem").read_bytes()
    ours = (certs / "ca.pem").read_bytes()
    for address in secured.addresses.values():
        assert check_health(address, tls=TlsSettings(ca=ours))
        assert not check_health(address, tls=TlsSettings())  # plaintext
        assert not check_health(address, tls=TlsSettings(ca=other_ca))
        assert not check_health(address, tls=TlsSettings(ca=ours, server_name="evil.example"))
    with pytest.raises(OmniError) as caught:
        generate(secured.coordinator, ca_cert=tmp_path / "other" / "ca.pem")
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_the_cli_against_a_tls_cluster_without_the_ca_says_to_pass_it(
    clusters: tuple[InProcessCluster, np.ndarray],
    certs: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    secured, _ = clusters
    monkeypatch.delenv("OMNISTAGE_TLS_CA")  # a new user's shell: no CA anywhere
    out = str(tmp_path / "x.png")
    for command in (["generate", "x", "-o", out, "--quiet"], ["models"]):
        assert cli([*command, "--address", secured.coordinator]) == 1
        printed = capsys.readouterr().err
        assert printed.startswith("error: UNAVAILABLE"), printed
        assert "--ca-cert .secrets/tls/ca.pem" in printed, printed
    # With a CA that did not sign the server's certificate, the hint says to check that instead.
    assert cli(["certs", str(tmp_path / "other")]) == 0
    bad = ["--ca-cert", str(tmp_path / "other" / "ca.pem")]
    assert cli(["generate", "x", "-o", out, "--address", secured.coordinator, "--quiet", *bad]) == 1
    assert "check that the CA given by --ca-cert" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.7"])
def test_plaintext_is_refused_off_loopback_unless_allowed(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def check() -> None:
        server = grpc.aio.server()
        with pytest.raises(SystemExit, match="refusing plaintext"):
            bind(server, f"{host}:0", "test", TlsSettings())
        monkeypatch.setenv("OMNISTAGE_ALLOW_PLAINTEXT", "1")
        if host == "0.0.0.0":  # bindable here
            port, said = bind(server, f"{host}:0", "test", TlsSettings())
            assert port > 0 and said.startswith("PLAINTEXT")

    asyncio.run(check())


def test_the_gateway_serves_https_and_reaches_the_coordinator_over_tls(
    clusters: tuple[InProcessCluster, np.ndarray], certs: Path
) -> None:
    secured, _ = clusters
    gateway = InProcessGateway(secured.loop, secured.coordinator)
    try:
        assert gateway.url.startswith("https://")
        ca = TlsSettings(ca=(certs / "ca.pem").read_bytes())
        assert check_health(f"{gateway.url}/health", tls=ca)
        assert not check_health(f"{gateway.url}/health".replace("https://", "http://"))
        body = {"prompt": "over https", "size": "64x64", "num_inference_steps": 2, "seed": 1}
        context = https_context(ca)
        assert context is not None
        response = httpx.post(f"{gateway.url}/v1/images/generations", json=body, verify=context, timeout=60)
        assert response.status_code == 200, response.text
        png = base64.b64decode(response.json()["data"][0]["b64_json"])
        assert png.startswith(b"\x89PNG")
    finally:
        gateway.stop()


def test_a_heartbeat_is_refused_unless_its_address_answers_as_the_replica_with_a_cluster_certificate(
    clusters: tuple[InProcessCluster, np.ndarray],
) -> None:
    """Replica identity (issue 38, finding 10): with TLS, a first heartbeat registers only when
    the coordinator, dialling the address it names, finds a cluster certificate there and a
    replica that says the same stage, model and address."""
    from omni_common.net.rpc import sync_channel
    from omnistage.v1 import coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc

    secured, _ = clusters
    with sync_channel(secured.addresses["dit-denoise"]) as channel:
        real = stage_pb2_grpc.StageStub(channel).Info(stage_pb2.StageInfoRequest(), timeout=10)

    async def plaintext_server() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    fake_server, port = secured.call(plaintext_server())
    try:
        elsewhere = stage_pb2.StageInfo()
        elsewhere.CopyFrom(real)
        elsewhere.address = f"127.0.0.1:{port}"  # no cluster certificate answers there
        posing = stage_pb2.StageInfo()
        posing.CopyFrom(elsewhere)
        posing.address, posing.stage = real.address, "vae-decode"  # a replica that says otherwise
        with sync_channel(secured.coordinator) as channel:
            registry = coordinator_pb2_grpc.RegistryStub(channel)
            for forged in (elsewhere, posing):
                with pytest.raises(grpc.RpcError) as refused:
                    registry.Heartbeat(forged, timeout=20)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        secured.call(fake_server.stop(0))
