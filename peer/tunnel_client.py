"""The site's end of its control stream, for a daemon that only connects out.

``peer serve --outbound-only`` registers without an address and keeps ``Coordinator.Connect``
open (``coordinator/tunnel_server.py`` is the other end): the coordinator's calls for this site arrive
as ``ControlRequest`` messages and are answered by the same ``PeerServicer`` methods that serve
them over a direct connection, so every check (names, the coordinator-only rule, the run's plan)
is the same. The stream is opened again with the daemons' one retry policy
(``calls.backoff_delays``) whenever it breaks, until the daemon stops.

Authorization: the channel is mutual TLS to the certificate named ``coordinator`` (the link's
``Transport.channel(..., expect="coordinator")``), so a call read from it is the coordinator's:
the servicer sees that identity (:class:`TunnelContext`). On a plaintext daemon it sees none,
as on a plaintext server.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from google.protobuf import message_factory

from fedrelay import names
from fedrelay.callers import COORDINATOR_IDENTITY
from fedrelay.calls import backoff_delays, status_message
from fedrelay.transport import TUNNELED_METHODS
from fedrelay.v1 import coordinator_pb2 as cpb, peer_pb2

log = logging.getLogger("fedrelay.peer")

TUNNELED = TUNNELED_METHODS
_METHODS = peer_pb2.DESCRIPTOR.services_by_name["Peer"].methods_by_name
_STOP = object()


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class TunnelContext:
    """What a ``PeerServicer`` method needs of a gRPC context, for a call that came over the
    control stream: the coordinator's identity (under TLS) and ``abort``."""

    def __init__(self, secure: bool):
        self._secure = secure

    def auth_context(self) -> dict:
        if not self._secure:
            return {}
        return {"transport_security_type": [b"ssl"], "x509_common_name": [COORDINATOR_IDENTITY.encode()]}

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)

    def peer(self) -> str:
        return "control-stream"

    def is_active(self) -> bool:
        return True

    def invocation_metadata(self):
        return ()


def answer(servicer, request: cpb.ControlRequest, secure: bool):
    """The ``ControlReply`` messages for one tunneled call (one for a unary call; for a streaming
    one, one per response message with ``more`` set, then a last one). A refusal or failure is a
    reply with its gRPC code and message; nothing here raises."""
    def failed(code: grpc.StatusCode, details: str) -> cpb.ControlReply:
        return cpb.ControlReply(id=request.id, code=code.value[0], details=details)

    if request.method not in TUNNELED:
        yield failed(grpc.StatusCode.UNIMPLEMENTED, f"{request.method!r} is not answered over the control stream")
        return
    desc = _METHODS[request.method]
    try:
        message = message_factory.GetMessageClass(desc.input_type).FromString(request.request)
    except Exception as exc:  # noqa: BLE001 - a malformed message is refused, never raised
        yield failed(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}")
        return
    try:
        result = getattr(servicer, request.method)(message, TunnelContext(secure))
        if desc.server_streaming:
            for item in result:
                yield cpb.ControlReply(id=request.id, reply=item.SerializeToString(), more=True)
            yield cpb.ControlReply(id=request.id)
        else:
            yield cpb.ControlReply(id=request.id, reply=result.SerializeToString())
    except _Aborted as exc:
        yield failed(exc.code, exc.details)
    except names.InvalidName as exc:
        yield failed(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except Exception as exc:  # noqa: BLE001 - the daemon goes on serving
        log.exception("control call %s failed", request.method)
        yield failed(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


class ControlLink:
    """Keeps this site's control stream open (a thread) and answers the calls that come over it,
    each on a thread of a small pool (an evaluation does not hold up a status request)."""

    def __init__(self, link, servicer, name: str, instance: str, stop: threading.Event, workers: int = 8):
        self.link, self.servicer, self.name, self.instance, self.stop = link, servicer, name, instance, stop
        self.connected = threading.Event()  # the stream is open now (tests wait on it)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="control-call")
        self._thread = threading.Thread(target=self._loop, name="control-stream", daemon=True)

    def start(self) -> "ControlLink":
        self._thread.start()
        return self

    def _loop(self) -> None:
        delays = backoff_delays(cap=10.0)
        while not self.stop.is_set():
            try:
                self._session()
                delays = backoff_delays(cap=10.0)  # it was open: start the backoff again
            except grpc.RpcError as exc:
                if not self.stop.is_set():
                    log.warning("control stream to the coordinator at %s broke (%s); opening it again",
                                self.link.address, status_message(exc))
            except Exception:  # noqa: BLE001 - say so, and keep the stream open
                log.exception("control stream failed; opening it again")
            finally:
                self.connected.clear()
            self.stop.wait(next(delays))

    def _session(self) -> None:
        """One control stream, from its hello until it ends."""
        outgoing: queue.Queue = queue.Queue()
        outgoing.put(cpb.ControlReply(site=self.name, instance=self.instance))

        def requests():
            while True:
                item = outgoing.get()
                if item is _STOP:
                    return
                yield item

        stream = self.link.stub.Connect(requests())
        ended = threading.Event()

        def cancel_on_stop() -> None:  # the daemon stops: end the stream (this session's thread only)
            while not ended.wait(0.5):
                if self.stop.is_set():
                    stream.cancel()
                    return

        threading.Thread(target=cancel_on_stop, daemon=True, name="control-stop").start()
        try:
            for request in stream:
                if not self.connected.is_set():
                    self.connected.set()
                    log.info("control stream to the coordinator at %s is open", self.link.address)
                if request.id == 0:  # the coordinator's hello back: the stream is open
                    continue
                self._pool.submit(self._serve, request, outgoing)
        finally:
            ended.set()
            outgoing.put(_STOP)

    def _serve(self, request: cpb.ControlRequest, outgoing: queue.Queue) -> None:
        for reply in answer(self.servicer, request, self.link.transport.secure):
            outgoing.put(reply)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
