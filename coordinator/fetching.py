"""Fetching a run's final model for the operator (``Coordinator.FetchModel``): from the site that
produced it, else from any site whose copy both ends attested, streamed through unchanged."""

from __future__ import annotations

from typing import Callable, Iterator

import grpc

from fedrelay.calls import status_message, transfer_timeout
from fedrelay.coordinator.refusal import Refused
from fedrelay.v1 import peer_pb2


def final_model(ledger, run_id: str) -> tuple[dict, list[str]]:
    """The run and the sites that hold its final model, in the order they are asked: the site
    that produced it, then those whose copy of it both ends attested. Raises ``Refused``
    (NOT_FOUND: unknown run; FAILED_PRECONDITION: no final model yet)."""
    run = ledger.run(run_id)
    if run is None:
        raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown run {run_id!r}")
    if not run["final_sha256"]:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"run {run_id} has no final model yet")
    holders = [run["final_site"]] + [h["receiver"] for h in ledger.hops(run_id, "final")
                                     if h["status"] == "done" and h["sha256"] == run["final_sha256"]]
    return run, holders


def stream(run: dict, holders: list[str], stub: Callable, address: Callable[[str], str]) -> Iterator:
    """The final model's ``ModelChunk`` stream from the first of ``holders`` that has it
    (``stub(site dict)``: a site's Peer stub; ``address(name)``: its registered address).
    Raises ``Refused`` (UNAVAILABLE: no holder answers, or the stream broke)."""
    errors = []
    for name in dict.fromkeys(h for h in holders if h):
        chunks = stub({"name": name, "address": address(name)}).FetchModel(
            peer_pb2.FetchModelRequest(run_id=run["run_id"], sha256=run["final_sha256"]),
            timeout=transfer_timeout(run["model_bytes"] or 0))
        try:
            first = next(chunks)  # the header: this site holds the model
        except grpc.RpcError as exc:
            errors.append(f"{name}: {status_message(exc)}")
            continue
        yield first
        try:
            yield from chunks
        except grpc.RpcError as exc:
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          f"the final model's stream from {name} broke: {status_message(exc)}") from None
        return
    raise Refused(grpc.StatusCode.UNAVAILABLE, "cannot fetch the final model: " + "; ".join(errors))
