"""Sites make their own keys (docs/site-keys-and-revocation.md): `peer init` writes the site's key and request at
the site, `coordinator enroll --csr` signs the request, the private key never reaches the
operator's folder; bad requests are refused with a clear message; a site-made identity speaks
mutual TLS with the coordinator and signs reports that verify against the CA."""

from __future__ import annotations

import stat

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from typer.testing import CliRunner

from fedrelay import signing
from fedrelay.server import make_server
from fedrelay.transport import Transport
from fedrelay.cli.coordinator import app as coord_app
from fedrelay.cli.peer import app as peer_app
from fedrelay.coordinator import pki
from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.service import CoordinatorService
from fedrelay.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc

runner = CliRunner()


def said(result) -> str:
    """A command's output on one line (rich wraps long messages at the terminal's width)."""
    return " ".join(result.output.split())


def _pub(obj) -> bytes:
    return obj.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.fixture(scope="module")
def enrolled(tmp_path_factory):
    """A CA, and site-a enrolled from the commands alone: `peer init` at the site, `enroll --csr`
    at the operator's desk, `peer install-cert` back at the site."""
    root = tmp_path_factory.mktemp("keys")
    assert runner.invoke(coord_app, ["init-ca", "--out", str(root / "pki")]).exit_code == 0
    r = runner.invoke(peer_app, ["init", "--name", "site-a", "--state-dir", str(root / "state"),
                                 "--host", "site-a.example.org", "--host", "10.0.0.5"])
    assert r.exit_code == 0, r.output
    site_tls = root / "state" / "tls"
    r = runner.invoke(coord_app, ["enroll", "--csr", str(site_tls / "site-a.csr"), "--ca", str(root / "pki"),
                                  "--out", str(root / "operator-out")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(peer_app, ["install-cert", str(root / "operator-out"), "--tls", str(site_tls)])
    assert r.exit_code == 0, r.output
    return root, site_tls


def test_the_key_stays_at_the_site(enrolled):
    root, site_tls = enrolled
    assert stat.S_IMODE((site_tls / "key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE(site_tls.stat().st_mode) == 0o700
    # The operator's folder holds the certificates only, and nothing under the PKI is the site's key.
    assert {p.name for p in (root / "operator-out").iterdir()} == {"cert.pem", "ca.pem"}
    key = serialization.load_pem_private_key((site_tls / "key.pem").read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    site_key = (site_tls / "key.pem").read_bytes()
    assert not any(p.is_file() and p.read_bytes() == site_key for p in (root / "pki").rglob("*"))
    cert = x509.load_pem_x509_certificate((site_tls / "cert.pem").read_bytes())
    assert _pub(cert) == _pub(key)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "site-a"
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "site-a.example.org" in sans.get_values_for_type(x509.DNSName)
    assert [str(i) for i in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    # The CA keeps a copy of what it issued (revocation finds it by name).
    assert [c.serial_number for c in pki.issued(root / "pki", "site-a")] == [cert.serial_number]
    assert Transport.from_dir(site_tls).identity == "site-a"


def test_init_never_replaces_a_key_silently(enrolled):
    _, site_tls = enrolled
    r = runner.invoke(peer_app, ["init", "--name", "site-a", "--tls", str(site_tls)])
    assert r.exit_code == 2 and "--force" in said(r)
    r = runner.invoke(peer_app, ["init", "--name", "Bad_Name", "--tls", str(site_tls.parent / "x")])
    assert r.exit_code == 2 and "--name" in said(r) and "Traceback" not in r.output


def _csr(key, name: str) -> bytes:
    req = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])).sign(key, hashes.SHA256()))
    return req.public_bytes(serialization.Encoding.PEM)


def test_bad_requests_are_refused_clearly(enrolled, tmp_path):
    root, site_tls = enrolled
    ca = str(root / "pki")

    def enroll(pem: bytes, *extra: str):
        path = tmp_path / "req.csr"
        path.write_bytes(pem)
        return runner.invoke(coord_app, ["enroll", "--csr", str(path), "--ca", ca, "--out", str(tmp_path / "o"),
                                         *extra])

    p256 = ec.generate_private_key(ec.SECP256R1())
    cases = {
        "reserved": (_csr(p256, "operator"), "reserved identity"),
        "other curve": (_csr(ec.generate_private_key(ec.SECP384R1()), "site-x"), "EC P-256"),
        "not a csr": (b"hello", "not a certificate signing request"),
        "bad name": (_csr(p256, "Site_X"), "site name"),
    }
    for what, (pem, words) in cases.items():
        r = enroll(pem)
        assert r.exit_code == 2 and words in said(r) and "Traceback" not in r.output, (what, r.output)
    # A request altered after it was signed (another public key swapped in) does not verify.
    good = (site_tls / "site-a.csr").read_bytes()
    der = x509.load_pem_x509_csr(good).public_bytes(serialization.Encoding.DER)
    other = x509.load_pem_x509_csr(_csr(p256, "site-a")).public_key()
    old_pub, new_pub = _pub(x509.load_pem_x509_csr(good)), other.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    r = enroll(der.replace(old_pub, new_pub))
    assert r.exit_code == 2 and "does not verify" in said(r)
    r = enroll(good, "site-b")
    assert r.exit_code == 2 and "is for 'site-a', not 'site-b'" in said(r)
    # A certificate for another key is not installed beside the site's key.
    other_dir = tmp_path / "other"
    pki.enroll("site-a", root / "pki", other_dir)
    r = runner.invoke(peer_app, ["install-cert", str(other_dir), "--tls", str(site_tls)])
    assert r.exit_code == 2 and "not for the key" in said(r)


def test_site_made_identity_speaks_tls_and_signs_reports(enrolled, tmp_path):
    """The coordinator accepts the site-made identity over mutual TLS, and a report signed with
    the site's own key verifies against the CA (fedrelay/signing.py, as the ledger checks it)."""
    root, site_tls = enrolled
    site = Transport.from_dir(site_tls)
    coordinator = Transport.from_dir(root / "pki" / "coordinator")
    ledger = Ledger(tmp_path / "ledger.sqlite")
    service = CoordinatorService(ledger, transport=coordinator)
    server, port = make_server("127.0.0.1:0", transport=coordinator)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    server.start()
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(site.channel(f"127.0.0.1:{port}", expect="coordinator"))
        reply = stub.Register(cpb.RegisterRequest(name="site-a", address="127.0.0.1:1", instance="i1"), timeout=10)
        assert reply.heartbeat_seconds > 0
        assert ledger.peer("site-a") is not None
        with pytest.raises(grpc.RpcError) as err:  # its certificate names site-a only
            stub.Register(cpb.RegisterRequest(name="site-b", address="127.0.0.1:1"), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        server.stop(0)
        service.close()
        ledger.close()
    signed = signing.signer_for(site).sign(cpb.FailureReport(run_id="r1", site="site-a", error="x"))
    record = signing.received(signed, "site-a", site.cert)
    cert = signing.load_certificate(site.cert)
    signing.check_certificate(cert, signing.load_ca((root / "pki" / "ca" / "ca.pem").read_bytes()), "site-a")
    signing.verify(record.record, record.signature, cert)
