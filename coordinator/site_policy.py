"""Asking every site's own policy before a run starts (``Peer.CheckPolicy``; docs/site-policy.md).

A site may keep a policy of the runs it accepts (``peer/policy.py``). ``StartChain`` asks each
site of a new run, with the very assignment it would send, before it assigns any: a site that
refuses fails the run before any site has kept, trained or sent anything (in a star plan every
site starts training as soon as it is assigned, so asking at ``Assign`` alone would be too late
for the sites assigned before the one that refuses). ``Assign`` checks the policy again: the
file may change in between.
"""

from __future__ import annotations

import logging

import grpc

from fedrelay.calls import assignment_refusal

log = logging.getLogger("fedrelay.coordinator")


def first_refusal(asks, timeout: float) -> tuple[str, str] | None:
    """``asks``: (site, ``PeerStub``, ``Assignment``) in the order to ask. Returns (site,
    reason) of the first site whose policy refuses its assignment, or None when none does.
    A site that cannot answer (unreachable; an older daemon without ``CheckPolicy``:
    UNIMPLEMENTED) is passed over: its ``Assign`` still applies its policy, and reports any other
    problem."""
    for site, stub, assignment in asks:
        try:
            stub.CheckPolicy(assignment, timeout=timeout)
        except grpc.RpcError as exc:
            reason, by_policy = assignment_refusal(exc)
            if by_policy:
                return site, reason
            log.info("site %s did not answer the policy check of run %s (%s); its assignment will tell",
                     site, assignment.run_id, reason)
    return None
