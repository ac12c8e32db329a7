"""Property-based fuzzing of running daemons over mutual TLS: thousands of generated malformed
safetensors payloads and malformed handoff streams, each of which must be answered with an
error status, leave nothing on disk, and leave the daemon healthy; and generated names in
ReportHop (coordinator) and Assign (peer), each answered INVALID_ARGUMENT when it breaks its rule,
with only clean names reaching the ledger or a path."""

from __future__ import annotations

import collections
import hashlib
import json
import re
import struct

import grpc
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from safetensors.torch import load, save

from fedrelay import names
from fedrelay.coordinator.plan import chain_plan
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, peer_pb2

from test_security import (GOOD, assignment, coordinator, cstub, header, ids, peer, snapshot,  # noqa: F401 - fixtures
                           stub)
from test_transfer import CLASSES

PAYLOAD_EXAMPLES = 1800
STREAM_EXAMPLES = 1500
# The unit tier fuzzes the same daemons with a sixth of the examples; the thorough runs (every
# example above) are in the integration tier (`make test` runs both).
QUICK = 6


def examples(full: int):
    """``examples`` parametrized: ``quick`` (``full // QUICK``, unit tier) and ``thorough`` (``full``,
    marked integration)."""
    return pytest.mark.parametrize("examples", [pytest.param(full // QUICK, id="quick"),
                                                pytest.param(full, id="thorough", marks=pytest.mark.integration)])


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True, print_blob=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])

REFERENCE = load(GOOD)
NAMES = sorted(REFERENCE)
HEADER_LEN = struct.unpack("<Q", GOOD[:8])[0]
ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.OUT_OF_RANGE,
          grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED,
          grpc.StatusCode.FAILED_PRECONDITION}


def is_the_runs_model(data: bytes) -> bool:
    """The test's own oracle: safetensors with exactly the reference names, shapes and dtypes,
    all finite. (A mutation can, rarely, produce such a payload; those are not malformed.)"""
    try:
        state = load(data)
    except BaseException:  # noqa: BLE001 - any parser failure means malformed
        return False
    if sorted(state) != NAMES:
        return False
    return all(state[k].shape == REFERENCE[k].shape and state[k].dtype == REFERENCE[k].dtype
               and (not state[k].is_floating_point() or bool(torch.isfinite(state[k]).all())) for k in NAMES)


DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "X", ""]


@st.composite
def random_header_payload(draw) -> bytes:
    """A hand-made safetensors file: a JSON header of random entries (any dtype, shape, offsets,
    also nonsense types), a random body, and a length prefix that may lie."""
    entries = {}
    for i in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(NAMES + ["x", "", "__metadata__", "../../etc/passwd"]))
        entries[name] = {
            "dtype": draw(st.sampled_from(DTYPES)),
            "shape": draw(st.lists(st.integers(-2, 70000), max_size=4)),
            "data_offsets": draw(st.lists(st.integers(-1, 1 << 20), min_size=0, max_size=3)),
        }
        if draw(st.booleans()):
            entries[name] = draw(st.sampled_from([None, 1, "x", [], {"dtype": "F32"}]))
    text = json.dumps(entries).encode()
    if draw(st.booleans()):
        text = text + b" " * draw(st.integers(0, 16))
    body = draw(st.binary(max_size=512))
    declared = draw(st.one_of(st.just(len(text)), st.integers(0, (1 << 64) - 1)))
    return struct.pack("<Q", declared) + text + body


@st.composite
def mutated_model(draw) -> bytes:
    """The run's real model bytes, damaged: cut, length prefix changed, header bytes overwritten
    or inserted, or one tensor value made NaN/Inf."""
    kind = draw(st.sampled_from(["cut", "prefix", "overwrite-header", "insert-header", "poison"]))
    data = bytearray(GOOD)
    if kind == "cut":
        return bytes(data[: draw(st.integers(1, len(GOOD) - 1))])
    if kind == "prefix":
        n = draw(st.integers(0, (1 << 64) - 1).filter(lambda n: n != HEADER_LEN))
        return struct.pack("<Q", n) + bytes(data[8:])
    if kind == "overwrite-header":
        pos = draw(st.integers(0, 8 + HEADER_LEN - 1))
        new = draw(st.binary(min_size=1, max_size=8))
        data[pos:pos + len(new)] = new
        return bytes(data)
    if kind == "insert-header":
        pos = draw(st.integers(8, 8 + HEADER_LEN))
        return bytes(data[:pos]) + draw(st.binary(min_size=1, max_size=8)) + bytes(data[pos:])
    name = draw(st.sampled_from([k for k in NAMES if REFERENCE[k].is_floating_point() and REFERENCE[k].numel()]))
    state = {k: v.clone() for k, v in REFERENCE.items()}
    state[name].view(-1)[draw(st.integers(0, state[name].numel() - 1))] = draw(
        st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return save(state, metadata={"format": "pt"})


@st.composite
def wrong_tensors(draw) -> bytes:
    """Valid safetensors whose tensors are not the run's model: other names, shapes, dtypes."""
    state = {}
    for _ in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(NAMES + ["evil", "a.b", "features"]))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.int64, torch.uint8, torch.float64]))
        state[name] = torch.zeros(shape, dtype=dtype)
    return save(state)


PAYLOADS = st.one_of(st.binary(min_size=1, max_size=4096), random_header_payload(), mutated_model(),
                     wrong_tensors())


def refused(stub_, messages) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub_.Handoff(iter(messages), timeout=30)
    return err.value


def chunked(data: bytes, size: int) -> list[common_pb2.ModelChunk]:
    return [common_pb2.ModelChunk(data=data[i:i + size]) for i in range(0, len(data), size)]


@examples(PAYLOAD_EXAMPLES)
def test_fuzz_malformed_payloads(peer, ids, examples):  # noqa: F811 - fixtures
    node, address = peer
    sender = stub(ids["site-a"], address)
    before = snapshot(node, "fuzz")
    seen = []

    @fuzz_settings(examples)
    @given(data=PAYLOADS, chunk=st.sampled_from([1 << 16, 1 << 20]))
    def one(data, chunk):
        assume(not is_the_runs_model(data))
        err = refused(sender, [common_pb2.ModelChunk(header=header("fuzz", data))] + chunked(data, chunk))
        assert err.code() in ERRORS, (err.code(), err.details())
        assert err.details()
        seen.append(err.code())

    one()
    assert len(seen) >= examples * 0.9
    assert snapshot(node, "fuzz") == before
    assert stub(ids["coordinator"], address).GetStatus(peer_pb2.StatusRequest(), timeout=5).name == "site-b"


@st.composite
def bad_stream(draw, run_id: str) -> list:
    """A handoff stream of the run's real model (``run_id``, assigned at the peer) with one thing
    wrong."""
    size = draw(st.sampled_from([1 << 16, 1 << 18, 1 << 20]))
    chunks = chunked(GOOD, size)
    h = header(run_id, GOOD)
    kind = draw(st.sampled_from(["no-header", "header-late", "second-header", "truncate", "extend", "swap",
                                 "drop-chunk", "duplicate-chunk", "sha", "size", "over-cap", "hop", "run",
                                 "purpose", "sender", "header-only", "flip"]))
    if kind == "no-header":
        return chunks
    if kind == "header-late":
        i = draw(st.integers(1, len(chunks)))
        return chunks[:i] + [common_pb2.ModelChunk(header=h)] + chunks[i:]
    if kind == "second-header":
        i = draw(st.integers(0, len(chunks)))
        return [common_pb2.ModelChunk(header=h)] + chunks[:i] + [common_pb2.ModelChunk(header=h)] + chunks[i:]
    if kind == "truncate":
        cut = draw(st.integers(1, len(GOOD)))
        return [common_pb2.ModelChunk(header=h)] + chunked(GOOD[:-cut], size)
    if kind == "extend":
        return [common_pb2.ModelChunk(header=h)] + chunks + [common_pb2.ModelChunk(data=draw(st.binary(min_size=1, max_size=64)))]
    if kind in ("swap", "drop-chunk", "duplicate-chunk"):
        assume(len(chunks) >= 2)
        i, j = draw(st.integers(0, len(chunks) - 1)), draw(st.integers(0, len(chunks) - 1))
        body = list(chunks)
        if kind == "swap":
            assume(chunks[i].data != chunks[j].data)
            body[i], body[j] = body[j], body[i]
        elif kind == "drop-chunk":
            del body[i]
        else:
            body.insert(j, chunks[i])
        return [common_pb2.ModelChunk(header=h)] + body
    if kind == "flip":
        pos = draw(st.integers(0, len(GOOD) - 1))
        data = bytearray(GOOD)
        data[pos] ^= draw(st.integers(1, 255))
        return [common_pb2.ModelChunk(header=h)] + chunked(bytes(data), size)
    if kind == "header-only":
        return [common_pb2.ModelChunk(header=h)]
    if kind == "sha":
        h.sha256 = draw(st.one_of(st.text(max_size=70), st.binary(min_size=32, max_size=32).map(bytes.hex)))
        assume(h.sha256 != hashlib.sha256(GOOD).hexdigest())
    elif kind == "size":
        h.total_bytes = draw(st.integers(0, 5 * len(GOOD)).filter(lambda n: n != len(GOOD)))
    elif kind == "over-cap":
        h.total_bytes = draw(st.integers(5 * len(GOOD) + (1 << 20), (1 << 64) - 1))
    elif kind == "hop":
        h.hop = draw(st.integers(0, (1 << 32) - 1).filter(lambda n: n != 1))
    elif kind == "run":
        h.run_id = draw(st.text(max_size=40).filter(lambda s: s not in ("fuzz", "replay", "bad", "final", "after", "stall")
                                                    and not s.startswith(("fuzz-", "after-"))))
    elif kind == "purpose":
        h.purpose = draw(st.sampled_from([common_pb2.PURPOSE_UNSPECIFIED, common_pb2.FINAL_MODEL, 7]))
    elif kind == "sender":
        h.sender = draw(st.text(max_size=20).filter(lambda s: s != "site-a"))
    return [common_pb2.ModelChunk(header=h)] + chunks


@examples(STREAM_EXAMPLES)
def test_fuzz_malformed_handoff_streams(peer, ids, examples):  # noqa: F811 - fixtures
    node, address = peer
    sender = stub(ids["site-a"], address)
    # Runs of this test's own (the quick and the thorough run share the module's daemon)
    run_id, after = f"fuzz-{examples}", f"after-{examples}"
    for r in (run_id, after):
        stub(ids["coordinator"], address).Assign(assignment(r), timeout=10)
    before = snapshot(node, run_id)
    seen = []

    @fuzz_settings(examples)
    @given(messages=bad_stream(run_id))
    def one(messages):
        err = refused(sender, messages)
        assert err.code() in ERRORS, (err.code(), err.details())
        assert err.details()
        seen.append(err.code())

    one()
    assert len(seen) >= examples * 0.9
    # Nothing changed but, at most, one partial file of the assigned sender's bytes (a stream that
    # ended short is kept for a resume; it is never taken as the model).
    now = snapshot(node, run_id)
    parts = [k for k in set(now) - set(before) if k.endswith(".part")]
    assert len(parts) <= 1
    assert {k: v for k, v in now.items() if k not in parts} == before
    # Still healthy: status answers, and the predecessor's real model is then accepted.
    assert stub(ids["coordinator"], address).GetStatus(peer_pb2.StatusRequest(), timeout=5).name == "site-b"
    receipt = sender.Handoff(iter([common_pb2.ModelChunk(header=header(after, GOOD))] + chunked(GOOD, 1 << 20)),
                             timeout=30)
    assert not receipt.duplicate and (node.state_dir / "runs" / after / "received.safetensors").read_bytes() == GOOD


# -- names from the wire: ReportHop at the coordinator, Assign at the peer ---------------------------
# The rules, written out again as the test's oracle (fedrelay.names is what is tested).
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
SITE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
SHA = re.compile(r"[0-9a-f]{64}")
NAME_EXAMPLES = 400


def names_like(valid: list[str], pattern: str) -> st.SearchStrategy[str]:
    """Strings near a rule: valid ones, any text (controls, newlines, '/' and all), strings of the
    rule's characters around its length limit, and paths."""
    return st.one_of(st.sampled_from(valid), st.text(max_size=80), st.from_regex(pattern, fullmatch=True),
                     st.sampled_from(["", "..", "../x", "a/b", ".x", "x" * 64, "x" * 65, "a" * 10_000, "a\x00b",
                                      "a\nb", "-a", "a-", "A" * 63, "é"]))


def valid_class(s: str) -> bool:
    return (1 <= len(s) <= 128 and s.isprintable() and "/" not in s and "\\" not in s and not s.startswith(".")
            and s == s.strip())


@st.composite
def some_broken(draw, fields: dict) -> dict:
    """A dict of field -> value where 0-2 fields (drawn) come from their "near" strategy and the
    others are valid."""
    broken = draw(st.sets(st.sampled_from(sorted(fields)), max_size=2))
    return {k: draw(near if k in broken else st.sampled_from(valid)) for k, (valid, near) in fields.items()}


def test_fuzz_report_hop_fields(coordinator, ids):  # noqa: F811 - fixtures
    address, ledger = coordinator
    ledger.create_run("fz", strategy="fedelmy", arch="cnn", seed=1, params={}, class_index=["Bag"], model={},
                      chain=[{"name": "site-a", "address": "127.0.0.1:9"}, {"name": "site-b", "address": "127.0.0.1:9"}],
                      warnings=[], insecure=False, plan=chain_plan(["site-a", "site-b"]).to_json())
    site = cstub(ids["site-a"], address)
    seen = collections.Counter()
    fields = {
        "run_id": (["fz"], names_like(["fz", "nope", "20261123-061500-ab12cd"], r"[A-Za-z0-9_./-]{0,70}")),
        "sender": (["site-a"], names_like(["site-a", "site-b"], r"[a-z0-9./-]{0,70}")),
        "receiver": (["site-b"], names_like(["site-b", "site-c"], r"[a-z0-9./-]{0,70}")),
        "sha256": (["ab" * 32, "0f" * 32], st.one_of(st.binary(min_size=32, max_size=32).map(bytes.hex),
                                                    st.text(max_size=70))),
        "hop": ([1, 2], st.one_of(st.integers(0, 3), st.integers(0, (1 << 32) - 1))),
        "purpose": ([1], st.sampled_from([0, 1, 2, 7])),
    }

    @fuzz_settings(NAME_EXAMPLES)
    @given(f=some_broken(fields))
    def one(f):
        report = cpb.HopReport(payload_bytes=10, started=1.0, ended=2.0, **f)
        valid = (RUN_ID.fullmatch(f["run_id"]) and SITE.fullmatch(f["sender"]) and SITE.fullmatch(f["receiver"])
                 and SHA.fullmatch(f["sha256"]) and f["hop"] < names.MAX_HOP)
        try:
            site.ReportHop(report, timeout=30)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
            assert len(err.details()) < 400, err.details()
        if not valid:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, report)
        else:  # NOT_FOUND: another run; PERMISSION_DENIED: not a transfer of the plan, or another sender;
            # INVALID_ARGUMENT: the purpose; ALREADY_EXISTS: hop 1 was already reported otherwise
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS), code
        seen[code] += 1

    one()
    assert seen[grpc.StatusCode.INVALID_ARGUMENT] and seen[grpc.StatusCode.OK], seen
    for h in ledger.hops("fz"):  # only clean names reached the ledger
        assert SITE.fullmatch(h["sender"]) and SITE.fullmatch(h["receiver"]) and SHA.fullmatch(h["sha256"])
    cstub(ids["operator"], address).ListRuns(cpb.ListRunsRequest(), timeout=10)  # still serving


def rename(a, old: str, new: str, address: str | None = None) -> None:
    """Give the site ``old`` of an assignment another name (and address) everywhere it appears:
    the order, the planned transfers, the peers' addresses."""
    a.order[list(a.order).index(old)] = new
    for t in a.transfers:
        t.sender = new if t.sender == old else t.sender
        t.receiver = new if t.receiver == old else t.receiver
    for ref in a.peers:
        if ref.name == old:
            ref.name = new
            ref.address = ref.address if address is None else address


def test_fuzz_assign_fields(peer, ids):  # noqa: F811 - fixtures
    node, address = peer
    coord = stub(ids["coordinator"], address)
    seen = collections.Counter()
    fields = {
        "run_id": (["fz-ok", "20261123-061500-ab12cd", "fz_2"],
                   names_like(["fz-ok", "x"], r"[A-Za-z0-9_./-]{0,70}")),
        "first": (["site-a"], names_like(["site-a", "site-b"], r"[a-z0-9./-]{0,70}")),
        "successor": (["site-c"], names_like(["site-c"], r"[a-z0-9./-]{0,70}")),
        "address": (["127.0.0.1:2", "site-c:50071", "[::1]:7"], st.one_of(st.text(max_size=40), st.sampled_from(
            ["host:0", "host:65536", "[::1]:5", "[zz]:5", "a b:1", ":1", "x" * 300 + ":1", "h:1\n"]))),
        "extra": ([[], ["Extra class 1"]], st.lists(st.one_of(st.sampled_from(CLASSES), st.text(max_size=200)),
                                                     max_size=3)),
    }

    @fuzz_settings(NAME_EXAMPLES)
    @given(f=some_broken(fields))
    def one(f):
        a = assignment(f["run_id"])
        rename(a, "site-a", f["first"])
        rename(a, "site-c", f["successor"], address=f["address"])
        a.class_index.extend(f["extra"])
        classes = list(a.class_index)
        host, _, port = f["address"].rpartition(":")
        addr_ok = (bool(re.fullmatch(r"\[[0-9a-fA-F:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", host))
                   and re.fullmatch(r"[0-9]{1,5}", port) is not None and 1 <= int(port) <= 65535)
        valid = (RUN_ID.fullmatch(f["run_id"]) and SITE.fullmatch(f["first"]) and SITE.fullmatch(f["successor"])
                 and len({f["first"], "site-b", f["successor"]}) == 3 and addr_ok
                 and all(valid_class(c) for c in classes) and len(set(classes)) == len(classes))
        try:
            coord.Assign(a, timeout=30)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
            assert len(err.details()) < 400, err.details()
        if valid:  # INVALID_ARGUMENT: e.g. the run was already assigned differently
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), code
        else:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, a)
        seen[code] += 1

    one()
    assert seen[grpc.StatusCode.INVALID_ARGUMENT] and seen[grpc.StatusCode.OK], seen
    for folder in (node.state_dir / "runs").iterdir():  # every run folder has a clean name
        assert RUN_ID.fullmatch(folder.name), folder
        assert all(valid_class(c) for c in node.runs[folder.name].assignment.class_index)
    assert stub(ids["coordinator"], address).GetStatus(peer_pb2.StatusRequest(), timeout=5).name == "site-b"
