"""A refusal of an operator's or a site's request, raised by the coordinator's behaviour modules
(``lifecycle``, ``registration``, ``reports``, ...) and turned into the gRPC status it names by
the servicer (``coordinator/service.py``), which aborts the call with it."""

from __future__ import annotations

import grpc


class Refused(Exception):
    """The request is refused with gRPC status ``code`` and ``message`` (the text the caller sees)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
