"""Sealed envelopes for relayed transfers (fedrelay.sealing): round trips, confidentiality against
the relay, and refusals (wrong recipient, foreign CA, forged names, tampering, unexpected header),
each a SealError that leaves ``out`` untouched and no temp file behind."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedrelay import sealing
from fedrelay.coordinator import pki
from fedrelay.sealing import SealError, open_file, read_header, seal_file
from conftest import self_signed

HEADER = {"run_id": "run-1", "purpose": "model", "index": 2, "round": 0, "sender": "site-a", "receiver": "site-b"}
EXPECT = {"run_id": "run-1", "purpose": "model", "index": 2, "sender": "site-a", "receiver": "site-b"}


def _ident(folder: Path) -> dict[str, bytes]:
    return {n: (folder / f"{n}.pem").read_bytes() for n in ("key", "cert", "ca")}


@pytest.fixture(scope="module")
def ids(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root / "pki")
    out = {n: _ident(pki.enroll(n, root / "pki", root / n)) for n in ("site-a", "site-b", "site-c")}
    pki.init_ca(root / "rogue")  # another federation (or an attacker) with a site of the same name
    out["rogue-site-a"] = _ident(pki.enroll("site-a", root / "rogue", root / "rogue-a"))
    out["expired-site-a"] = _ident(pki.enroll("site-a", root / "pki", root / "expired-a", days=1,
                                              not_before=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=8)))
    return out


@pytest.fixture(autouse=True)
def small_segments(monkeypatch):
    monkeypatch.setattr(sealing, "SEGMENT_BYTES", 1000)


def seal(ids, tmp_path: Path, data: bytes, *, sender="site-a", receiver="site-b", header=None, **kw):
    (tmp_path / "payload.bin").write_bytes(data)
    return seal_file(tmp_path / "payload.bin", tmp_path / "env.seal", header=header or HEADER,
                     recipient_cert_pem=ids[receiver]["cert"], sender_key_pem=ids[sender]["key"],
                     sender_cert_pem=ids[sender]["cert"], **kw)


def unseal(ids, tmp_path: Path, *, receiver="site-b", cert=None, expect=EXPECT, env="env.seal"):
    return open_file(tmp_path / env, tmp_path / "out.bin", recipient_key_pem=ids[receiver]["key"],
                     recipient_cert_pem=cert or ids[receiver]["cert"], ca_pem=ids["site-b"]["ca"], expect=expect)


def refused(ids, tmp_path: Path, match: str, **kw) -> None:
    """open_file raises SealError matching ``match``; out.bin untouched; no temp file left."""
    (tmp_path / "out.bin").write_bytes(b"previous")
    with pytest.raises(SealError, match=match):
        unseal(ids, tmp_path, **kw)
    assert (tmp_path / "out.bin").read_bytes() == b"previous"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def split(env: bytes) -> tuple[dict, bytes, bytes]:
    """(header, signature, segments) of an envelope's bytes."""
    n = int.from_bytes(env[8:12], "big")
    m = int.from_bytes(env[12 + n:14 + n], "big")
    return json.loads(env[12:12 + n]), env[14 + n:14 + n + m], env[14 + n + m:]


def join(header: dict, key_pem: bytes, segments: bytes) -> bytes:
    hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    sig = serialization.load_pem_private_key(key_pem, None).sign(sealing.MAGIC + hb, ec.ECDSA(hashes.SHA256()))
    return sealing.MAGIC + len(hb).to_bytes(4, "big") + hb + len(sig).to_bytes(2, "big") + sig + segments


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 3500])
def test_round_trip(ids, tmp_path, size):
    data = os.urandom(size)
    n, digest = seal(ids, tmp_path, data)
    env = (tmp_path / "env.seal").read_bytes()
    assert (n, digest) == (len(env), hashlib.sha256(env).hexdigest())
    segments = max(1, -(-size // 1000))
    assert len(split(env)[2]) == size + 16 * segments
    h = unseal(ids, tmp_path)
    assert (tmp_path / "out.bin").read_bytes() == data
    assert h == read_header(tmp_path / "env.seal")
    assert h["payload_bytes"] == size and h["payload_sha256"] == hashlib.sha256(data).hexdigest()
    assert h["segment_bytes"] == 1000 and {k: h[k] for k in HEADER} == HEADER
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    for i in range(max(0, size - 63)):  # the relay sees no 64-byte window of the plaintext
        assert data[i:i + 64] not in env


def test_wrong_recipient(ids, tmp_path):
    seal(ids, tmp_path, os.urandom(3500))
    refused(ids, tmp_path, "not the key of the recipient certificate", receiver="site-c", cert=ids["site-b"]["cert"])
    refused(ids, tmp_path, "sealed to another certificate", receiver="site-c",
            expect={k: v for k, v in EXPECT.items() if k != "receiver"})


def test_sender_from_another_ca_or_expired(ids, tmp_path):
    seal(ids, tmp_path, os.urandom(3500), sender="rogue-site-a")
    refused(ids, tmp_path, "not signed by the federation CA")
    seal(ids, tmp_path, os.urandom(3500), sender="expired-site-a")
    refused(ids, tmp_path, "valid from")


def test_sender_name_mismatch(ids, tmp_path):
    with pytest.raises(SealError, match="sender certificate's name 'site-a'"):
        seal(ids, tmp_path, b"x", header=dict(HEADER, sender="site-c"))
    # A sender that skips seal_file's check and signs a header naming another site.
    seal(ids, tmp_path, os.urandom(3500))
    header, _, segments = split((tmp_path / "env.seal").read_bytes())
    (tmp_path / "forged.seal").write_bytes(join(dict(header, sender="site-c"), ids["site-a"]["key"], segments))
    refused(ids, tmp_path, "header sender 'site-c' is not the sender certificate's name 'site-a'", env="forged.seal",
            expect={})


def test_tampering(ids, tmp_path):
    seal(ids, tmp_path, os.urandom(3500))
    env = (tmp_path / "env.seal").read_bytes()
    _, _, segments = split(env)
    body = len(env) - len(segments)
    cases = {
        "segment": (env[:body + 1500] + bytes([env[body + 1500] ^ 1]) + env[body + 1501:], "fails authentication"),
        "header": (env[:40] + bytes([env[40] ^ 1]) + env[41:], "bad signature"),
        "truncated": (env[:-(500 + 16)], "truncated envelope"),
        "appended": (env + b"\0", "extended envelope"),
        "reordered": (env[:body] + segments[1016:2032] + segments[:1016] + segments[2032:], "fails authentication"),
        "magic": (b"FRSEAL2\n" + env[8:], "unsupported envelope version"),
        "garbage": (os.urandom(100), "not a sealed envelope"),
        "empty": (b"", "not a sealed envelope"),
    }
    for name, (data, match) in cases.items():
        (tmp_path / f"{name}.seal").write_bytes(data)
        refused(ids, tmp_path, match, env=f"{name}.seal")
    assert not (tmp_path / "missing.bin").exists()
    with pytest.raises(SealError, match="No such file"):
        open_file(tmp_path / "nope.seal", tmp_path / "missing.bin", recipient_key_pem=ids["site-b"]["key"],
                  recipient_cert_pem=ids["site-b"]["cert"], ca_pem=ids["site-b"]["ca"], expect={})
    assert not (tmp_path / "missing.bin").exists()


def test_expect_mismatch(ids, tmp_path):
    seal(ids, tmp_path, os.urandom(3500))
    refused(ids, tmp_path, "header run_id='run-1', expected 'run-2'", expect=dict(EXPECT, run_id="run-2"))
    refused(ids, tmp_path, "header extra=None", expect=dict(EXPECT, extra=1))


def test_seal_checks_recipient_and_header(ids, tmp_path):
    with pytest.raises(SealError, match="recipient certificate is 'site-c''s, not receiver 'site-b''s"):
        seal(ids, tmp_path, b"x", receiver="site-c", ca_pem=ids["site-b"]["ca"])
    with pytest.raises(SealError, match="not signed by the federation CA"):
        seal(ids, tmp_path, b"x", receiver="rogue-site-a", header=dict(HEADER, receiver="site-a"),
             ca_pem=ids["site-b"]["ca"])
    with pytest.raises(SealError, match="header lacks round"):
        seal(ids, tmp_path, b"x", header={k: v for k, v in HEADER.items() if k != "round"})
    with pytest.raises(SealError, match="must not set payload_sha256"):
        seal(ids, tmp_path, b"x", header=dict(HEADER, payload_sha256="0" * 64))
    with pytest.raises(SealError, match="sender key is not the key"):
        seal_file(tmp_path / "payload.bin", tmp_path / "env.seal", header=HEADER,
                  recipient_cert_pem=ids["site-b"]["cert"], sender_key_pem=ids["site-c"]["key"],
                  sender_cert_pem=ids["site-a"]["cert"])
    assert not (tmp_path / "env.seal").exists()


def test_recipient_key_must_be_p256(ids, tmp_path):
    _, cert = self_signed("site-b", ec.SECP384R1)
    with pytest.raises(SealError, match="key type EC secp384r1; sealing needs EC P-256"):
        seal_file(__file__, tmp_path / "env.seal", header=HEADER,
                  recipient_cert_pem=cert.public_bytes(serialization.Encoding.PEM),
                  sender_key_pem=ids["site-a"]["key"], sender_cert_pem=ids["site-a"]["cert"])
