"""The federation's identities: ``init-ca`` (the CA, the coordinator's and the operator's
identities), ``enroll`` (a site's certificate from its request, a site kit, a further operator)
and ``revoke`` (a site's certificates, published through the coordinator)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import typer

from fedrelay.cli import connection, exits
from fedrelay.cli.common import INSECURE, address_callback, console, err_console, fail, json_option
from fedrelay.cli.connection import COORD, TLS
from fedrelay.cli.views import local_time
from fedrelay.text import safe


HOSTS = typer.Option(None, "--host", help="Host name or IP others dial this identity at (repeatable; goes in the "
                     "certificate's SAN) \\[default: localhost, 127.0.0.1, ::1].")


def init_ca(
    out: Path = typer.Option(..., "--out", "-o", help="PKI folder to create: ca/, coordinator/, operator/."),
    host: list[str] = HOSTS,
    as_json: bool = json_option('Print {"ca", "coordinator", "operator"} (the folders written) as JSON.'),
) -> None:
    """Create the federation's CA, the coordinator's identity (OUT/coordinator) and the operator's (OUT/operator)."""
    from fedrelay.coordinator.pki import DEFAULT_HOSTS, PKIError, init_ca as do_init

    try:
        do_init(out, hosts=host or DEFAULT_HOSTS)
    except PKIError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(str(exc), exits.FAILED)
    if as_json:
        print(json.dumps({k: str(out / k) for k in ("ca", "coordinator", "operator")}))
        return
    console.print(f"CA in {out / 'ca'} (keep ca-key.pem private); identities: {out / 'coordinator'} "
                  f"(coordinator serve --tls), {out / 'operator'} (operator commands --tls)", highlight=False)


def enroll(
    name: str = typer.Argument(None, help="The site's name: its identity, and what it passes as `peer serve --name` "
                               "(with --csr: optional, the request must name it)."),
    ca: Path = typer.Option(..., "--ca", help="The PKI folder made by init-ca."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write cert.pem and ca.pem to (without --csr, for local "
                             "trials: key.pem too)."),
    csr: Path = typer.Option(None, "--csr", dir_okay=False, help="The site's certificate signing request (NAME.csr "
                             "from `peer init` at the site): signed with the CA; the site's key stays at the site."),
    host: list[str] = typer.Option(None, "--host", help="Host name or IP others dial this site at (repeatable; goes in "
                                   "the certificate's SAN) \\[default: those the request asks for; without --csr: "
                                   "localhost, 127.0.0.1, ::1]."),
    days: int = typer.Option(825, "--days", help="Validity of the certificate in days."),
    force: bool = typer.Option(False, "--force", help="Replace the certificate (and key, without --csr) of an --out "
                               "folder that already holds them."),
    kit: bool = typer.Option(False, "--kit", help="Also write a site kit into --out: peer.env, the systemd unit, "
                             "start-peer.sh and a README.md with ports, install steps and checks (needs --csr: a "
                             "kit holds no private key)."),
    kit_coordinator: str = typer.Option(None, "--coordinator", "-c", callback=address_callback, help="--kit: the coordinator's HOST:PORT, written "
                                        "into peer.env \\[default: a placeholder to edit]."),
    kit_outbound: bool = typer.Option(False, "--outbound-only", help="--kit: a site that accepts no inbound "
                                      "connection (its peer.env sets FEDRELAY_OUTBOUND_ONLY=1; its models come "
                                      "through the relay)."),
    kit_port: int = typer.Option(50071, "--port", help="--kit: the port the site's daemon listens on; it is "
                                 "advertised at the first --host."),
    operator: bool = typer.Option(False, "--operator", help="Enroll a further operator NAME instead of a site: "
                                  "its certificate names operator.NAME, which may start and stop runs (the ledger "
                                  "records which operator did; a site's policy may accept only some operators)."),
    as_json: bool = json_option('Print {"name", "out", "kit"} as JSON.'),
) -> None:
    """Sign a site's certificate request (--csr, from `peer init` at the site) and write its
    certificate and the CA's (give them back to the site: `peer install-cert`); with --kit, the
    folder is a whole site kit; with --operator, a key and certificate for a further operator (--tls
    DIR for the operator commands). Without --csr (LOCAL TRIALS ONLY), a site's key is made here,
    at the operator's desk, and must then be carried to the site."""
    from fedrelay.coordinator.pki import (DEFAULT_HOSTS, PKIError, check_name, enroll as do_enroll,
                                          operator_identity, sign_csr)

    if days < 1:
        fail("--days must be >= 1")
    if operator:
        if kit:
            fail("--kit makes a site's kit; it does not go with --operator")
        if csr is not None:
            fail("--operator makes the further operator's key and certificate here; it does not go with --csr")
        try:
            name = operator_identity(name)
        except PKIError as exc:
            fail(f"--operator: {exc}")
    if not kit and (kit_coordinator is not None or kit_port != 50071 or kit_outbound):
        fail("--coordinator, --port and --outbound-only only go with --kit")
    if kit and csr is None:
        fail("--kit needs --csr: a site kit holds no private key made by the operator; have the site run "
             "`peer init --name NAME` and send you its NAME.csr")
    if csr is None and not name:
        fail("name the site to enrol, or pass its request with --csr NAME.csr")
    request = None
    if csr is not None:
        try:
            request = csr.read_bytes()
        except OSError as exc:
            fail(f"--csr {csr}: cannot read it ({exc.strerror or exc})")
        from fedrelay.identity import IdentityError, csr_name, load_csr

        try:
            parsed = load_csr(request, f"--csr {csr}")
        except IdentityError as exc:
            fail(str(exc))
        asked = csr_name(parsed)
        if name and asked != name:
            fail(f"--csr {csr} is for {asked!r}, not {name!r}")
        name = asked
    try:
        if not operator:
            check_name(name)
    except PKIError as exc:
        fail(str(exc))
    hosts = host or (None if csr is not None else DEFAULT_HOSTS)
    if kit:
        from fedrelay.coordinator.kit import write_kit
        from fedrelay.names import InvalidName, check_address

        try:
            if kit_coordinator is not None:
                check_address(kit_coordinator, "--coordinator")
            if not 1 <= kit_port <= 65535:
                raise ValueError(f"--port must be 1-65535, not {kit_port}")
        except (InvalidName, ValueError) as exc:
            fail(str(exc))
    held = [f for f in (("cert.pem",) if csr is not None else ("key.pem", "cert.pem")) if (out / f).exists()]
    if held and not force:
        fail(f"{out} already holds {' and '.join(held)}: an identity is never overwritten silently; pass --force "
             "to replace it, or choose another --out folder")
    try:
        if csr is not None:
            from fedrelay.identity import CA_FILE, CERT_FILE, KEY_FILE, write_private

            _, cert_pem, ca_pem = sign_csr(request, ca, name=name, hosts=hosts, days=days, source=f"--csr {csr}")
            _check_own_key(out / KEY_FILE, cert_pem)
            out.mkdir(parents=True, exist_ok=True)
            write_private(out / CERT_FILE, cert_pem, 0o644)
            write_private(out / CA_FILE, ca_pem, 0o644)
            from fedrelay.identity import csr_hosts, load_csr

            kit_hosts = host or [h for h in csr_hosts(load_csr(request)) if h != name] or list(DEFAULT_HOSTS)
        else:
            do_enroll(name, ca, out, hosts=hosts, days=days)
            kit_hosts = hosts
        if kit:
            write_kit(out, name, hosts=kit_hosts, coordinator=kit_coordinator, port=kit_port,
                      outbound_only=kit_outbound)
    except (PKIError, ValueError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(str(exc), exits.FAILED)
    if as_json:
        print(json.dumps({"name": name, "out": str(out), "kit": kit, "operator": operator}))
        if kit and kit_coordinator is None:
            err_console.print("[bold yellow]warning:[/] no --coordinator: peer.env holds a placeholder "
                              "coordinator address to edit", highlight=False)
        return
    if csr is not None:
        from fedrelay.identity import request_fingerprint

        from cryptography import x509 as _x509

        san = _x509.load_pem_x509_certificate(cert_pem).extensions.get_extension_for_class(
            _x509.SubjectAlternativeName).value
        dialled = [str(v) for v in san.get_values_for_type(_x509.DNSName)] + [
            str(v) for v in san.get_values_for_type(_x509.IPAddress)]
        console.print(f"certificate for {name}, dialled at {', '.join(dialled)}", highlight=False, soft_wrap=True)
        console.print(f"enrolled {name}: {out} (cert.pem, ca.pem) for the key of its request (request SHA-256 "
                      f"{request_fingerprint(parsed)}: the site's `peer init` printed the same); the site installs "
                      f"them beside its key: peer install-cert {out} --tls ITS_TLS_FOLDER", highlight=False,
                      soft_wrap=True)
    else:
        console.print(f"enrolled {name}: {out} (key.pem, cert.pem, ca.pem)", highlight=False)
        err_console.print("[bold yellow]for local trials only:[/] this site's private key was made here, at the "
                          "operator's desk; a real site makes its own with `peer init` and you sign its request with "
                          "`enroll --csr`", highlight=False, soft_wrap=True)
    if kit:
        console.print(f"site kit in {out}: cert.pem, ca.pem, peer.env, fedrelay-peer.service, start-peer.sh, "
                      "README.md (no private key: the site keeps its own)", highlight=False, soft_wrap=True)
        if kit_coordinator is None:
            err_console.print("[bold yellow]warning:[/] no --coordinator: peer.env holds a placeholder "
                              "coordinator address to edit", highlight=False)


def _check_own_key(key_path: Path, cert_pem: bytes) -> None:
    """Refuse to write a certificate beside a key it is not for (an --out folder that holds
    another key). Raises ``ValueError``."""
    if not key_path.exists():
        return
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except ValueError:
        raise ValueError(f"{key_path} is not a PEM private key; choose another --out folder") from None
    if key.public_key().public_bytes(*der) != x509.load_pem_x509_certificate(cert_pem).public_key().public_bytes(*der):
        raise ValueError(f"{key_path} is another key than the request's; choose another --out folder")


def revoke(
    name: str = typer.Argument(..., help="The site to revoke (its certificate name)."),
    ca: Path = typer.Option(..., "--ca", help="The PKI folder made by init-ca: its CA key signs the revocation list "
                            "(PKI/ca/crl.pem), and PKI/ca/issued holds the site's certificates."),
    reason: str = typer.Option("", "--reason", help="Why, recorded in the ledger with who revoked the site and when."),
    serial: list[str] = typer.Option(None, "--serial", help="Revoke this certificate serial (hex; repeatable) "
                                     "\\[default: every certificate PKI/ca/issued holds for NAME]."),
    coordinator: str = COORD,
    as_json: bool = json_option('Print {"name", "serials", "revoked_by", "revoked_at", "crl_number", "runs"} as '
                                'JSON (serials in hex, revoked_at in unix seconds).'),
    tls: Path = TLS,
    insecure: bool = INSECURE,
) -> None:
    """Revoke a site: sign a new certificate revocation list with the CA (PKI/ca/crl.pem) and
    publish it through the coordinator, which records who revoked the site, when and why. The
    site's next call to the coordinator or to any site is refused and its transfers in flight
    stop (the sites fetch the list with their next heartbeat); its running runs are routed around
    it. No daemon restarts."""
    from fedrelay.coordinator.pki import PKIError, check_name, crl_path, issued, revoke as sign_revocation

    try:
        check_name(name)
    except PKIError as exc:
        fail(str(exc))
    if serial:
        try:
            serials = [int(s, 16) for s in serial]
        except ValueError:
            fail(f"--serial must be hex serial numbers (as `openssl x509 -serial` prints them), not {serial!r}")
    else:
        try:
            serials = [c.serial_number for c in issued(ca, name)]
        except OSError as exc:
            fail(f"--ca {ca}: {exc.strerror or exc}")
        if not serials:
            fail(f"--ca {ca} holds no certificate issued to {name} (PKI/ca/issued); pass its serial with --serial HEX")
    with connection.open_client(coordinator, tls, insecure) as client:  # the TLS options are checked before the CRL changes
        try:
            crl_der, number = sign_revocation(ca, serials)
        except (PKIError, OSError) as exc:
            fail(str(exc))
        try:
            reply = client.revoke(name, serials, crl_der, reason=reason)
        except grpc.RpcError as exc:
            err_console.print(f"[yellow]the revocation list {number} is signed ({crl_path(ca)}) but was not "
                              "published:[/]", highlight=False)
            connection.rpc_fail(exc, coordinator)
    if as_json:
        print(json.dumps({"name": name, "serials": [f"{s:x}" for s in serials], "revoked_by": reply.revoked_by,
                          "revoked_at": reply.revoked_at, "crl_number": reply.crl_number, "runs": list(reply.runs)}))
        return
    runs = f"; running run(s) routed around it: {', '.join(reply.runs)}" if reply.runs else ""
    console.print(f"revoked {safe(name)} (certificate(s) {', '.join(f'{s:x}' for s in serials)}) by "
                  f"{safe(reply.revoked_by)} at {local_time(reply.revoked_at)}; revocation list {reply.crl_number} "
                  f"published ({crl_path(ca)}): the site's calls are refused from the next heartbeat of each "
                  f"site{runs}", highlight=False, soft_wrap=True)
