"""The building blocks of a light site daemon (docs/explanation/scale.md): payload validation without torch
(fedrelay/payload.py) and host-wide worker slots (peer/slots.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fedrelay import payload
from fedrelay.files import atomic_write
from fedrelay.tensors import encode_state
from fedrelay.peer.slots import HostSlots

pytestmark = pytest.mark.integration


def test_payload_checks_without_torch(tmp_path):
    """A fresh interpreter (with the daemon-side modules scan, slots, workers imported) checks good, NaN, wrong-shape, renamed and garbage payloads with
    fedrelay.payload and never imports torch."""
    script = textwrap.dedent("""
        import json, sys
        import numpy as np
        from safetensors.numpy import save
        from fedrelay import payload
        import fedrelay.tasks.image_folder.scan, fedrelay.peer.slots, fedrelay.peer.worker_pool  # the daemon's side
        schema = {"w": ((2, 3), "F32"), "n": ((), "I64")}
        good = {"w": np.ones((2, 3), np.float32), "n": np.array(5, np.int64)}
        out = {}
        def verdict(data):
            try:
                payload.check_payload(data, schema)
                return "ok"
            except ValueError as exc:
                return str(exc)
        out["good"] = verdict(save(good))
        out["nan"] = verdict(save({**good, "w": np.array([[1, 2, float("nan")], [0, 0, 0]], np.float32)}))
        out["inf"] = verdict(save({**good, "w": np.full((2, 3), np.inf, np.float32)}))
        out["shape"] = verdict(save({**good, "w": np.ones((3, 2), np.float32)}))
        out["dtype"] = verdict(save({**good, "w": np.ones((2, 3), np.float64)}))
        out["names"] = verdict(save({"v": good["w"], "n": good["n"]}))
        out["garbage"] = verdict(b"\\xff" * 64)
        out["torch"] = "torch" in sys.modules
        print(json.dumps(out))
    """)
    got = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                    timeout=60).stdout)
    assert got["torch"] is False
    assert got["good"] == "ok"
    assert "holds NaN or Inf" in got["nan"] and "holds NaN or Inf" in got["inf"]
    assert "tensor 'w' is ((3, 2), 'F32')" in got["shape"]
    assert "'F64'" in got["dtype"]
    assert "tensor names differ" in got["names"] and "'v'" in got["names"]
    assert got["garbage"].startswith("not a valid safetensors payload")


def test_schema_from_torch_matches_the_run_model(tmp_path):
    """The torch-free schema of the small CNN accepts a real model state (as wire encodes it)
    and refuses the same state with one NaN; it survives a JSON round trip."""
    import torch

    from fedrelay.models import build_seeded, expected_signature, state_bytes

    from fedrelay.tasks.image_folder import spec as image_spec

    spec = image_spec("cnn", 1, (8, 8), 3)
    schema = payload.schema_from_torch(expected_signature(spec))
    payload.dump_schema(schema, tmp_path / "schema.json")
    assert payload.load_schema(tmp_path / "schema.json") == schema
    assert payload.payload_bytes(schema) == state_bytes(spec)
    state = build_seeded(spec, 1).state_dict()
    payload.check_payload(encode_state(state), schema)
    state["classifier.3.bias"] = state["classifier.3.bias"].clone()
    state["classifier.3.bias"][0] = torch.nan
    with pytest.raises(ValueError, match="holds NaN or Inf"):
        payload.check_payload(encode_state(state), schema)


def test_slots_are_bounded_host_wide_and_freed_by_a_killed_holder(tmp_path):
    """Two slots: two holders (one of them another process) leave none; SIGKILL of that
    process frees its slot at once."""
    slots = HostSlots(2, tmp_path / "slots")
    script = textwrap.dedent(f"""
        import sys
        from fedrelay.peer.slots import HostSlots
        slot = HostSlots(2, {str(tmp_path / 'slots')!r}).try_acquire()
        print(slot.index, flush=True)
        sys.stdin.read()
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "0"
        mine = slots.try_acquire()
        assert mine is not None and mine.index == 1
        assert slots.try_acquire() is None and slots.held() == 2
        assert slots.acquire(timeout=0.3) is None
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(timeout=10) == -signal.SIGKILL
        again = slots.acquire(timeout=5)
        assert again is not None and again.index == 0
        again.release()
        mine.release()
        mine.release()  # idempotent
        assert slots.held() == 0
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(ValueError, match=">= 1"):
        HostSlots(0, tmp_path / "slots")


def test_numpy_dtypes_named_like_safetensors():
    assert payload.payload_bytes({"a": ((2, 2), "F32"), "b": ((), "I64")}) == 24
    assert np.dtype(np.float32) in payload._NUMPY_TO_ST


def test_scan_site_registers_like_load_site_without_torch(three_sites, tmp_path):
    """scan_site (headers only, in a fresh interpreter without torch) gives the class names,
    counts and shape that load_site gives; an RGB image among grey ones is refused by name."""
    from PIL import Image

    from fedrelay.tasks.image_folder.data import load_site

    site = three_sites[0]
    script = textwrap.dedent(f"""
        import json, sys
        from fedrelay.tasks.image_folder.scan import scan_site
        s = scan_site({str(site)!r})
        print(json.dumps([s.class_names, list(s.image_shape), s.train_counts, s.test_counts,
                          "torch" in sys.modules]))
    """)
    names, shape, train, test, torch_loaded = json.loads(subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60).stdout)
    full = load_site(site)
    assert not torch_loaded
    assert (names, tuple(shape), train, test) == (full.class_names, full.image_shape, full.train_counts,
                                                  full.test_counts)
    from fedrelay.tasks.image_folder.scan import DataError, scan_site

    bad = tmp_path / "bad"
    (bad / "train" / "a").mkdir(parents=True)
    Image.new("L", (8, 8)).save(bad / "train" / "a" / "1.png")
    Image.new("RGB", (8, 8)).save(bad / "train" / "a" / "2.png")
    with pytest.raises(DataError, match="2.png has shape"):
        scan_site(bad)


def test_worker_process_evaluates_and_a_killed_one_says_why(three_sites, tmp_path):
    """A worker process prepares a site, gives the payload schema and evaluates a model; killed
    with SIGKILL it is reported with its reason; its slot is freed when it is closed."""
    import os

    from fedrelay.tasks.image_folder.data import load_site
    from fedrelay.models import build_seeded
    from fedrelay.tasks.image_folder import spec as image_spec
    from fedrelay.peer.worker_protocol import EvaluateJob, Prepare, ProtocolError, SchemaJob
    from fedrelay.peer.worker_pool import WorkerDied, WorkerError, WorkerProcess

    site = load_site(three_sites[0])
    c, h, w = site.image_shape
    classes = site.class_names
    k = max(2, len(classes))
    spec = image_spec("cnn", c, (h, w), k).to_dict()
    model = tmp_path / "m.safetensors"
    atomic_write(model, encode_state(build_seeded(image_spec("cnn", c, (h, w), k), 3).state_dict()))
    slots = HostSlots(1, tmp_path / "slots")
    worker = WorkerProcess(slot=slots.try_acquire())
    try:
        ready = worker.request(Prepare(data=str(three_sites[0]), device="cpu"), timeout=120)
        assert ready["train"] == sum(site.train_counts.values())
        schema = worker.request(SchemaJob(spec=spec, strategy="fedelmy"), timeout=60)
        assert "classifier.3.bias" in schema["model"] and schema["hop"] == schema["model"]
        assert schema["extras"] == {}
        assert payload.payload_bytes({k: (tuple(s), d) for k, (s, d) in schema["model"].items()}) > 0
        got = worker.request(EvaluateJob(model=str(model), spec=spec, class_index=classes), timeout=60)
        assert got["total"] == site.num_samples("test") and 0 <= got["correct"] <= got["total"]
        with pytest.raises(WorkerError, match="FileNotFoundError"):
            worker.request(EvaluateJob(model=str(tmp_path / "none"), spec=spec, class_index=classes), timeout=60)
        with pytest.raises(ProtocolError, match="'schema': missing field"):  # refused here, nothing sent
            worker.request({"op": "schema", "spec": spec}, timeout=60)
        assert slots.try_acquire() is None  # the worker's slot is held
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match="killed by SIGKILL"):
            worker.request(SchemaJob(spec=spec, strategy="fedelmy"), timeout=60)
    finally:
        worker.close()
    assert slots.held() == 0


def test_a_worker_answers_a_malformed_request_and_ends_at_an_unreadable_line():
    """The worker's end of peer/worker_protocol.py: a request with an unknown op or a missing
    field is answered with an error naming it, and the worker goes on; a line that is not a JSON
    object with an op ends it with exit code 2."""
    from fedrelay.peer.worker_protocol import Error, parse_answer

    proc = subprocess.Popen([sys.executable, "-m", "fedrelay.peer.worker_main"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        answers = []
        for line in ['{"op": "fly"}', '{"op": "evaluate", "model": "/m"}',
                     '{"op": "schema", "spec": {}, "strategy": 5}']:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()  # one at a time: a worker ends as soon as its stdin closes
            answers.append(parse_answer(proc.stdout.readline()))
        proc.stdin.write("not json\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 2 and "unreadable request" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert all(isinstance(a, Error) for a in answers)
    assert "unknown worker request op 'fly'" in answers[0].error
    assert "'evaluate': missing field(s) 'spec', 'class_index'" in answers[1].error
    assert "field 'strategy' must be string, not int 5" in answers[2].error
