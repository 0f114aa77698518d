"""https endpoints: a real etcd serving TLS with client-certificate auth."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic_ft.etcd.client import EtcdClient, TlsFiles
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(path)


def _issue(
    directory: Path, name: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None, usages: list
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca[0].subject if ca else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if ca is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    else:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    cert = builder.sign(ca[1] if ca else key, hashes.SHA256())
    cert_path = directory / f"{name}.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key, str(cert_path), _write_key(directory / f"{name}-key.pem", key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    directory = tmp_path_factory.mktemp("pki")
    ca_cert, ca_key, ca_path, _ = _issue(directory, "ca", None, [])
    # The server's certificate also allows client auth: EtcdServer's readiness probe presents it.
    server_usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    _, _, server_cert, server_key = _issue(directory, "server", (ca_cert, ca_key), server_usages)
    _, _, client_cert, client_key = _issue(directory, "client", (ca_cert, ca_key), [ExtendedKeyUsageOID.CLIENT_AUTH])
    return {
        "server": TlsFiles(cacert=ca_path, cert=server_cert, key=server_key),
        "client": TlsFiles(cacert=ca_path, cert=client_cert, key=client_key),
        "ca_only": TlsFiles(cacert=ca_path),
    }


@pytest.fixture(scope="module")
def tls_etcd(pki: dict[str, TlsFiles]) -> Iterator[EtcdServer]:
    with EtcdServer(tls=pki["server"]) as server:
        yield server


def make(endpoint: str, run_id: str, tls: TlsFiles, **conf: object) -> EtcdftRendezvousHandler:
    return EtcdftRendezvousHandler(
        make_settings(
            run_id=run_id,
            endpoint=endpoint,
            min_nodes=2,
            max_nodes=2,
            local_addr="127.0.0.1",
            cacert=tls.cacert,
            cert=tls.cert,
            key=tls.key,
            **conf,
        )
    )


def test_rendezvous_and_store_over_https(tls_etcd: EtcdServer, pki: dict[str, TlsFiles], run_id: str) -> None:
    assert tls_etcd.endpoint.startswith("https://")
    a, b = make(tls_etcd.endpoint, run_id, pki["client"]), make(tls_etcd.endpoint, run_id, pki["client"])
    with ThreadPoolExecutor(2) as pool:
        infos = [f.result(30) for f in [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]]
    assert sorted(i.rank for i in infos) == [0, 1]
    infos[0].store.set("secret", "over tls")
    assert infos[1].store.get("secret") == b"over tls"
    a.shutdown()
    b.shutdown()


def test_missing_client_certificate_is_a_bounded_connection_error(
    tls_etcd: EtcdServer, pki: dict[str, TlsFiles], run_id: str
) -> None:
    with pytest.raises(RendezvousConnectionError, match=tls_etcd.endpoint.split(",")[0]):
        make(tls_etcd.endpoint, run_id, pki["ca_only"], connect_timeout=1, request_timeout=1)


def test_plain_http_to_a_tls_server_fails(tls_etcd: EtcdServer, run_id: str) -> None:
    plain = tls_etcd.endpoint.replace("https://", "")
    with pytest.raises(RendezvousConnectionError, match=plain):
        EtcdftRendezvousHandler(
            make_settings(run_id=run_id, endpoint=plain, min_nodes=1, max_nodes=1, connect_timeout=1, request_timeout=1)
        )


def test_ftrun_exchanges_the_job_config_over_client_certificate_tls(
    tls_etcd: EtcdServer, pki: dict[str, TlsFiles], run_id: str
) -> None:
    from elastic_ft.job_config import load_job_config
    from elastic_ft.launcher.ftrun import _exchange_job_config

    tls = pki["client"]
    conf = f"cacert={tls.cacert},cert={tls.cert},key={tls.key},etcd_prefix=/tls_jobs,last_call_timeout=1"
    args = argparse.Namespace(rdzv_id=run_id, rdzv_endpoint=tls_etcd.endpoint, rdzv_conf=conf)
    config = load_job_config("nodes: {min: 2, max: 3}\nnproc_per_node: 4\n")
    assert _exchange_job_config(args, config) == config  # stored
    assert _exchange_job_config(args, None) == config  # read back by another node
    settings = make_settings(
        run_id=run_id,
        endpoint=tls_etcd.endpoint,
        min_nodes=1,
        max_nodes=1,
        cacert=tls.cacert,
        cert=tls.cert,
        key=tls.key,
    )
    client = EtcdClient(settings.endpoints, tls=settings.tls)
    assert client.get(f"/tls_jobs/{run_id}/config")[0] is not None  # under the run's own prefix
    client.close()
