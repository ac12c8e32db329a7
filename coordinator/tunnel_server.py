"""The coordinator's end of the control streams of sites that only connect out.

A site started with ``peer serve --outbound-only`` accepts no inbound connection. It opens
``Coordinator.Connect`` (a bidirectional stream) and keeps it open; the coordinator sends the
``Peer`` calls it has for that site down the stream (``ControlRequest``: an id, the method name,
the serialized request) and the site answers each with ``ControlReply`` messages of the same id
(``peer/tunnel_client.py`` is the site's end). :class:`TunnelStub` quacks like the generated
``PeerStub`` for the calls the coordinator makes (``stub.Assign(request, timeout=...)``), so
the service's code does not care how a site is reached.

A call on a site whose stream is not open, or that breaks while the call waits, raises
:class:`TunnelError` with UNAVAILABLE (a ``grpc.RpcError``: the service's retries treat it like
an unreachable daemon); a call with no answer within its timeout, DEADLINE_EXCEEDED.

A site's answers are parsed defensively, as gRPC parses a direct daemon's: a reply whose bytes
are not the method's reply message, or whose status code is not one of gRPC's, raises
:class:`TunnelError` with INTERNAL (what a direct call's client answers for a response it cannot
deserialize), and a refusal's details are cut to ``DETAILS_CHARS`` characters. The service
then treats the site as it treats a daemon that refused (StartChain: the run fails, or is not
started; evaluation: the run fails), never as an unexpected exception.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

import grpc

from fedrelay.transport import TUNNELED_METHODS
from fedrelay.v1 import coordinator_pb2 as cpb, peer_pb2

TUNNELED = TUNNELED_METHODS
_METHODS = peer_pb2.DESCRIPTOR.services_by_name["Peer"].methods_by_name
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_END = object()
DETAILS_CHARS = 2_000  # characters of a site's refusal details kept (gRPC's own headers hold ~8 KiB)


def _reply_type(method: str):
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(_METHODS[method].output_type)


class TunnelError(grpc.RpcError):
    """A tunneled call that failed: ``code()`` and ``details()`` as a gRPC error's."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return f"{self._code.name}: {self._details}"


class Tunnel:
    """One site's open control stream: requests wait in ``outbox`` for the stream's sender, and
    the replies the stream's reader hands to :meth:`deliver` wake the calls waiting for them."""

    def __init__(self, site: str, instance: str):
        self.site, self.instance = site, instance
        self.outbox: queue.Queue = queue.Queue()
        self.closed = threading.Event()
        self.opened = time.time()
        self._ids = itertools.count(1)
        self._waiting: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()

    def _send(self, method: str, request, timeout: float) -> tuple[int, queue.Queue]:
        if method not in TUNNELED:
            raise TunnelError(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not sent over a control stream")
        if self.closed.is_set():
            raise TunnelError(grpc.StatusCode.UNAVAILABLE, f"{self.site}'s control stream is closed")
        call_id, answers = next(self._ids), queue.Queue()
        with self._lock:
            self._waiting[call_id] = answers
        self.outbox.put(cpb.ControlRequest(id=call_id, method=method, request=request.SerializeToString(),
                                           timeout=timeout))
        return call_id, answers

    def _answer(self, call_id: int, answers: queue.Queue, timeout: float) -> cpb.ControlReply:
        try:
            reply = answers.get(timeout=timeout)
        except queue.Empty:
            self._forget(call_id)
            raise TunnelError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"{self.site} did not answer over its control stream within {timeout:g} s") from None
        if reply is _END:
            self._forget(call_id)
            raise TunnelError(grpc.StatusCode.UNAVAILABLE, f"{self.site}'s control stream broke during the call")
        if reply.code:
            self._forget(call_id)
            code = _CODES.get(reply.code)
            if code is None or code == grpc.StatusCode.OK:
                raise TunnelError(grpc.StatusCode.INTERNAL, f"{self.site} answered over its control stream with "
                                                            f"status code {reply.code}, which is not a gRPC status")
            details = reply.details
            raise TunnelError(code, details if len(details) <= DETAILS_CHARS
                              else f"{details[:DETAILS_CHARS]}... ({len(details)} characters)")
        return reply

    def _parse(self, method: str, data: bytes):
        """The reply message of ``method`` in ``data``; a ``TunnelError`` (INTERNAL) when the
        bytes are not one."""
        cls = _reply_type(method)
        try:
            return cls.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or anything else the parser raises
            raise TunnelError(grpc.StatusCode.INTERNAL,
                              f"{self.site} answered {method} over its control stream with bytes that are not a "
                              f"{cls.DESCRIPTOR.name} ({type(exc).__name__})") from None

    def call(self, method: str, request, timeout: float):
        """Send a unary Peer call and wait up to ``timeout`` seconds for its reply message.
        Raises :class:`TunnelError`."""
        call_id, answers = self._send(method, request, timeout)
        reply = self._answer(call_id, answers, timeout)
        self._forget(call_id)
        return self._parse(method, reply.reply)

    def stream(self, method: str, request, timeout: float):
        """Send a response-streaming Peer call (FetchModel); a generator of its response
        messages, each waited for up to ``timeout`` seconds. Raises :class:`TunnelError`."""
        call_id, answers = self._send(method, request, timeout)
        try:
            while True:
                reply = self._answer(call_id, answers, timeout)
                if not reply.more:
                    return
                yield self._parse(method, reply.reply)
        finally:
            self._forget(call_id)

    def deliver(self, reply: cpb.ControlReply) -> None:
        """A reply read from the stream: handed to the call waiting for its id (a late reply to
        a call that gave up is dropped)."""
        with self._lock:
            answers = self._waiting.get(reply.id)
        if answers is not None:
            answers.put(reply)

    def _forget(self, call_id: int) -> None:
        with self._lock:
            self._waiting.pop(call_id, None)

    def close(self) -> None:
        """The stream ended: every waiting call fails with UNAVAILABLE."""
        self.closed.set()
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for answers in waiting:
            answers.put(_END)


class TunnelStub:
    """A ``PeerStub`` look-alike for a site that only connects out: ``stub.Method(request,
    timeout=...)`` goes over the site's current control stream (``Tunnels``)."""

    def __init__(self, tunnels: "Tunnels", site: str):
        self._tunnels, self._site = tunnels, site

    def __getattr__(self, method: str):
        if method not in TUNNELED:
            raise AttributeError(method)

        def call(request, timeout: float | None = None):
            tunnel = self._tunnels.get(self._site)
            if tunnel is None:
                raise TunnelError(grpc.StatusCode.UNAVAILABLE,
                                  f"{self._site} only connects out and its control stream is not open")
            if _METHODS[method].server_streaming:
                return tunnel.stream(method, request, timeout or 60.0)
            return tunnel.call(method, request, timeout or 60.0)

        return call


class Tunnels:
    """The open control streams, one per site (a newer stream of a site replaces the older)."""

    def __init__(self):
        self._open: dict[str, Tunnel] = {}
        self._lock = threading.Lock()
        self.on_open = []  # callables(site): a site's stream opened (the service re-sends what it owes)

    def open(self, site: str, instance: str) -> Tunnel:
        tunnel = Tunnel(site, instance)
        with self._lock:
            old, self._open[site] = self._open.get(site), tunnel
        if old is not None:
            old.close()
        for callback in self.on_open:
            callback(site)
        return tunnel

    def drop(self, tunnel: Tunnel) -> None:
        tunnel.close()
        with self._lock:
            if self._open.get(tunnel.site) is tunnel:
                del self._open[tunnel.site]

    def get(self, site: str) -> Tunnel | None:
        with self._lock:
            tunnel = self._open.get(site)
        return tunnel if tunnel is not None and not tunnel.closed.is_set() else None

    def stub(self, site: str) -> TunnelStub:
        return TunnelStub(self, site)

    def any_open(self) -> bool:
        """Whether any site's control stream is registered (a cheap test before a search)."""
        return bool(self._open)

    def close(self) -> None:
        with self._lock:
            tunnels, self._open = list(self._open.values()), {}
        for tunnel in tunnels:
            tunnel.close()
