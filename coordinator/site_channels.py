"""The coordinator's channels to the sites' peer daemons: one per (site, address), made once and
reused by every call (gRPC reconnects it as needed), or the control stream of a site that only
connects out (``coordinator/tunnel_server.py``)."""

from __future__ import annotations

import threading

import grpc

from fedrelay.transport import Transport
from fedrelay.coordinator.plan import PeerInfo
from fedrelay.v1 import common_pb2, peer_pb2_grpc


class SiteChannels:
    """Peer stubs of the sites registered in ``ledger``, over ``transport``, or over ``tunnels``."""

    def __init__(self, ledger, transport: Transport, tunnels):
        self.ledger = ledger
        self.transport = transport
        self.tunnels = tunnels
        self._channels: dict[tuple[str, str], tuple[grpc.Channel, peer_pb2_grpc.PeerStub]] = {}
        self._lock = threading.Lock()

    def stub(self, site: dict | PeerInfo | common_pb2.SiteRef) -> peer_pb2_grpc.PeerStub:
        """The Peer stub of a site's daemon at its latest registered address (a daemon restarted
        elsewhere re-registers), else the address given (``site``: a dict with ``name`` and
        ``address``, or an object with those attributes)."""
        name, address = (site["name"], site["address"]) if isinstance(site, dict) else (site.name, site.address)
        key = (name, self.address(name, address))
        if not key[1]:  # a site that only connects out: over its control stream
            return self.tunnels.stub(name)
        with self._lock:
            if key not in self._channels:
                channel = self.transport.channel(key[1], expect=name)
                self._channels[key] = (channel, peer_pb2_grpc.PeerStub(channel))
            return self._channels[key][1]

    def address(self, name: str, fallback: str = "") -> str:
        """The address ``name`` last registered with, else ``fallback``."""
        peer = self.ledger.peer(name)
        return peer["address"] if peer else fallback

    def close(self) -> None:
        """Close every channel (the daemon is stopping)."""
        with self._lock:
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()
