"""The coordinator's side of revocation (``coordinator revoke NAME``): the ledger's record of who
revoked whom, when and why, and the certificate revocation list it publishes.

The operator signs the list with the CA's key at its own desk (``fedrelay.coordinator.pki.revoke``:
the CA's key never comes to the coordinator) and sends it with ``Coordinator.Revoke``. The
coordinator checks it against the federation's CA, that it is newer than the one it holds and
that it holds the serials named, then, in one transaction, writes:

- ``revocations`` (one row per revoked certificate: site, serial (hex), revoked_by: the
  operator's certificate name, revoked_at: unix seconds, reason), and
- ``crls`` (every list published: number, DER bytes, published: unix seconds),

and takes the list into its :class:`fedrelay.revocation.RevocationList`: the coordinator's guard
refuses the site's calls from then on and cancels those in flight, ``GetCrl`` serves the list
(``RegisterReply.crl_number`` tells the sites a newer one exists), and every running run of the
site gets a ``revoked`` event in its hash chain (``CoordinatorService.Revoke``). A restarted
coordinator loads the newest list from the ledger.

The tables are this module's (created here on the ledger's connection, under its lock).
"""

from __future__ import annotations

import logging
import time

from fedrelay import revocation
from fedrelay.transport import Transport
from fedrelay.revocation import CrlError, Revoked

log = logging.getLogger("fedrelay.coordinator")

SCHEMA = """
CREATE TABLE IF NOT EXISTS revocations (  -- coordinator revoke: who revoked whom, when and why
    serial TEXT PRIMARY KEY,         -- the revoked certificate's serial number, hex
    name TEXT NOT NULL,              -- the site it named
    revoked_by TEXT NOT NULL,        -- the operator's certificate name
    revoked_at REAL NOT NULL,        -- unix seconds
    reason TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS crls (    -- every certificate revocation list published
    number INTEGER PRIMARY KEY,
    der BLOB NOT NULL,
    published REAL NOT NULL          -- unix seconds
);
"""


class RevocationRefused(ValueError):
    """A revocation the coordinator does not take (the message says why)."""


class Revocations:
    """Revocations and the published CRL of one coordinator (``ledger``: its ``Ledger``;
    ``transport``: its ``transport.Transport``, whose CA certificate the lists must verify with)."""

    def __init__(self, ledger, transport: Transport):
        self.ledger = ledger
        self.secure = transport.secure
        self.list = revocation.RevocationList(transport.ca if transport.secure else None)
        with ledger.lock:
            ledger.store.db.executescript(SCHEMA)
        self._entries = self._read_entries()
        newest = ledger.store.all("SELECT number, der FROM crls ORDER BY number DESC LIMIT 1")
        if newest:
            try:
                self.list.update(bytes(newest[0]["der"]), self.entries(), source="the ledger's newest CRL")
            except CrlError as exc:  # e.g. a ledger moved to another federation's coordinator
                log.error("the ledger's revocation list %d is not used: %s", newest[0]["number"], exc)

    def entries(self) -> list[Revoked]:
        """Every revoked certificate the ledger holds, oldest first (kept in memory)."""
        return list(self._entries)

    def _read_entries(self) -> list[Revoked]:
        rows = self.ledger.store.all("SELECT * FROM revocations ORDER BY revoked_at, serial")
        return [Revoked(r["name"], int(r["serial"], 16), r["revoked_at"], r["revoked_by"], r["reason"]) for r in rows]

    def of(self, name: str) -> Revoked | None:
        """The latest revocation of site ``name``, or None."""
        found = [e for e in self.entries() if e.name == name]
        return found[-1] if found else None

    def names(self) -> dict[str, Revoked]:
        """Revoked site name -> its latest revocation (ever: see ``current``)."""
        return {e.name: e for e in self.entries()}

    def current(self, certificates: dict[str, bytes]) -> dict[str, Revoked]:
        """The sites revoked now: revoked, and not registered since with a certificate that is
        not on the list (``certificates``: name -> the PEM certificate each site registered with;
        a site enrolled anew with a new key is back in good standing once it registers)."""
        out = {}
        for name, entry in self.names().items():
            pem = certificates.get(name)
            if pem is not None:
                serial = self.list.serial_for(pem)
                if serial is not None and not self.list.is_revoked(serial):
                    continue
            out[name] = entry
        return out

    def revoke(self, name: str, serials: list[str], crl_der: bytes, revoked_by: str, reason: str = "") -> Revoked:
        """Record the revocation of site ``name``'s certificates ``serials`` (hex) by
        ``revoked_by`` and publish ``crl_der`` (the CA-signed list holding them). Returns the
        entry recorded (time: now). Raises ``RevocationRefused`` (a plaintext coordinator, no
        serials, a list that is not the CA's, older than the one held, or without the serials)."""
        if not self.secure:
            raise RevocationRefused("a plaintext coordinator (--insecure) has no certificates to revoke")
        if not serials:
            raise RevocationRefused(f"no certificate serial of {name} to revoke")
        try:
            wanted = {int(s, 16) for s in serials}
        except ValueError:
            raise RevocationRefused(f"serials must be hex numbers, not {serials!r}") from None
        try:
            crl = revocation.load_crl(crl_der, "the revocation list sent")
            revocation.verify_crl(crl, self.list.ca_pem, "the revocation list sent")
        except CrlError as exc:
            raise RevocationRefused(str(exc)) from None
        number = revocation.crl_number(crl)
        if number < self.list.number:
            raise RevocationRefused(f"the revocation list sent is number {number}, older than the one published "
                                    f"({self.list.number}): sign a new one from the CA's crl.pem")
        listed = {r.serial_number for r in crl}
        missing = wanted - listed
        if missing:
            raise RevocationRefused("the revocation list sent does not hold the serial(s) "
                                    + ", ".join(f"{s:x}" for s in sorted(missing)))
        now = time.time()
        with self.ledger.lock:
            db = self.ledger.store.db
            db.execute("BEGIN IMMEDIATE")
            try:
                for serial in sorted(wanted):
                    db.execute("INSERT OR REPLACE INTO revocations (serial, name, revoked_by, revoked_at, reason) "
                               "VALUES (?, ?, ?, ?, ?)", (f"{serial:x}", name, revoked_by, now, reason))
                db.execute("INSERT OR REPLACE INTO crls (number, der, published) VALUES (?, ?, ?)",
                           (number, crl_der, now))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            self._entries = self._read_entries()
        self.list.update(crl_der, self.entries(), source=f"the revocation list from {revoked_by}")
        log.warning("site %s revoked by %s%s: certificate(s) %s; revocation list %d published", name, revoked_by,
                    f" ({reason})" if reason else "", ", ".join(f"{s:x}" for s in sorted(wanted)), number)
        return Revoked(name, min(wanted), now, revoked_by, reason)

    # -- the wire ------------------------------------------------------------------------------------
    @staticmethod
    def entry_pb(e: Revoked, reinstated: bool = False):
        from fedrelay.v1 import coordinator_pb2 as cpb

        return cpb.CrlEntry(name=e.name, serial=f"{e.serial:x}", revoked_at=e.revoked_at, revoked_by=e.revoked_by,
                            reason=e.reason, reinstated=reinstated)

    def reply(self, certificates: dict[str, bytes]):
        """The ``CrlReply`` of ``GetCrl``: the newest list (DER) and every revoked certificate,
        those of sites enrolled anew since marked ``reinstated`` (``current``)."""
        from fedrelay.v1 import coordinator_pb2 as cpb

        now = self.current(certificates)
        return cpb.CrlReply(crl=self.list.der, number=self.list.number,
                            entries=[self.entry_pb(e, reinstated=e.name not in now) for e in self.entries()])
