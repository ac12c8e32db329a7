"""The typed messages between a site daemon and its workers (peer/worker_protocol.py): every
request and answer survives its line; malformed lines and wrong answers are refused with a
message naming the message and the field. Unit tests: no process, no torch."""

from __future__ import annotations

import json

import pytest

from fedrelay.peer import worker_protocol as wp
from fedrelay.peer.worker_protocol import ProtocolError

SPEC = {"task": "image-folder", "model": "cnn", "num_classes": 2, "input": {"channels": 1, "height": 8, "width": 8},
        "task_version": "1", "task_sha256": "ab" * 32}
BASE = {"spec": SPEC, "params": {"strategy": "fedelmy", "lr": 1e-3}, "seed": 5, "class_index": ["a", "b"],
        "site": "site-a", "aggregator": "", "options": {}}

REQUESTS = [
    wp.Prepare(data="/data/site-a", device="cpu", deterministic=True, task="image-folder", task_sha256="ab" * 32,
               extra_tasks=["mod:Task"]),
    wp.Describe(data="/data/site-a", tasks={"image-folder": "ab" * 32}, device="auto"),
    wp.SchemaJob(spec=SPEC, strategy="fedavg", aggregator="mean", options={"init": "shared"}),
    wp.TrainJob(**BASE, position=1, round=2, folder="/run/v2", outgoing="/run/v2/out.safetensors",
                received="/run/in.safetensors", initial={"kind": "shared"}, privacy_epochs=7),
    wp.AggregateJob(**{**BASE, "aggregator": "mean"}, uploads={"site-a": "/u/a", "site-b": "/u/b"}, final="/f",
                    initial=None),
    wp.EvaluateJob(spec=SPEC, model="/run/final.safetensors", class_index=["a", "b"], params={"dp_delta": 1e-5},
                   privacy_books=["/run/v1/privacy.json"]),
]
ANSWERS = [
    wp.Ready(seconds=1.5, device="cpu", train=48, test=24),
    wp.Described(device="cpu", seconds=0.25, tasks={
        "image-folder": {"summary": {"classes": {"a": [1, 2]}}, "models": ["cnn"], "positive_class": None},
        "broken": {"error": "DataError: no images"}}),
    wp.Schemas(hop={"w": [[2, 3], "F32"]}, model={"w": [[2, 3], "F32"]}, extras={}),
    wp.Trained(seconds=3.0, pool=2),
    wp.Aggregated(seconds=0.5, models=3),
    wp.Evaluated(correct=20, total=24, metrics={"accuracy": 0.83}, stats={"confusion": [[1, 0], [0, 1]]}, seconds=0.1),
    wp.Epoch(images=40, stage="warmup", model=0, epoch=1, epochs=2, train_loss=0.7, val_accuracy=None, seconds=0.2),
    wp.Error(error="ValueError: bad"),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: m.NAME)
def test_every_request_survives_its_line(msg):
    line = msg.to_json()
    assert "\n" not in line and json.loads(line)["op"] == msg.NAME
    assert wp.parse_request(line) == msg
    assert wp.request_from_dict(msg.to_dict()) == msg and wp.as_request(msg.to_dict()) == msg
    assert wp.as_request(msg) is msg


@pytest.mark.parametrize("msg", ANSWERS, ids=lambda m: m.NAME)
def test_every_answer_survives_its_line(msg):
    line = msg.to_json()
    assert json.loads(line)["event"] == msg.NAME
    assert wp.parse_answer(line) == msg and wp.answer_from_dict(json.loads(line)) == msg


def test_each_request_names_the_answer_it_expects():
    assert [r.ANSWER for r in REQUESTS] == [wp.Ready, wp.Described, wp.Schemas, wp.Trained, wp.Aggregated,
                                            wp.Evaluated]
    assert set(wp.REQUESTS) == {"prepare", "describe", "schema", "train", "aggregate", "evaluate"}
    assert set(wp.ANSWERS) == {"ready", "described", "schemas", "trained", "aggregated", "evaluated", "epoch",
                               "error"}


def test_the_job_dicts_keep_their_keys():
    """The JSON on the pipe has the keys the daemon's job dicts always had: a job built from its
    old dict gives that dict back (defaults filled in)."""
    old = {**BASE, "op": "train", "position": 0, "round": 1, "folder": "/v", "received": None, "outgoing": "/v/o",
           "initial": None}
    assert wp.TrainJob.from_dict(old).to_dict() == {**old, "privacy_epochs": 0}
    schema = {"op": "schema", "spec": SPEC, "strategy": "fedelmy", "aggregator": "", "options": {}}
    assert wp.SchemaJob.from_dict(schema).to_dict() == schema
    evaluate = {"op": "evaluate", "model": "/m", "spec": SPEC, "class_index": ["a"]}
    assert wp.EvaluateJob.from_dict(evaluate).to_dict() == {**evaluate, "params": None, "privacy_books": []}
    # Prepare and Describe: what a test or the daemon leaves out takes its default (the op too)
    assert wp.Prepare.from_dict({"data": "/d"}) == wp.Prepare(data="/d", device="cpu", deterministic=True, task="",
                                                              task_sha256="", extra_tasks=[])


@pytest.mark.parametrize("line, message", [
    ("not json", "request line is not JSON"),
    ("[1, 2]", "must be a JSON object, not list"),
    ('{"data": "/d"}', "unknown worker request op None"),
    ('{"op": "fly"}', "unknown worker request op 'fly'"),
    ('{"op": "prepare"}', "worker request 'prepare': missing field(s) 'data'"),
    ('{"op": "prepare", "data": 3}', "field 'data' must be string, not int 3"),
    ('{"op": "prepare", "data": "/d", "deterministic": 1}', "field 'deterministic' must be boolean"),
    ('{"op": "prepare", "data": "/d", "colour": "red"}', "unknown field(s) 'colour'"),
    ('{"op": "describe", "data": "/d", "tasks": {"t": 5}}', "field 'tasks' must be object of string, not dict"),
    ('{"op": "evaluate", "model": "/m", "spec": {}, "class_index": ["a", 2]}', "'class_index' must be list of string"),
    ('{"op": "train", "spec": {}}', "missing field(s) 'params', 'seed', 'class_index', 'site'"),
])
def test_malformed_requests_are_refused_by_name(line, message):
    with pytest.raises(ProtocolError) as err:
        wp.parse_request(line)
    assert message in str(err.value)


def test_malformed_answers_and_fields_are_refused():
    with pytest.raises(ProtocolError, match="unknown worker answer event 'done'"):
        wp.parse_answer('{"event": "done"}')
    with pytest.raises(ProtocolError, match="'trained': missing field"):
        wp.parse_answer('{"event": "trained", "seconds": 1.0}')
    with pytest.raises(ProtocolError, match="'pool' must be integer, not float 2.5"):
        wp.Trained(seconds=1.0, pool=2.5)
    with pytest.raises(ProtocolError, match="'pool' must be integer, not bool"):
        wp.Trained(seconds=1.0, pool=True)
    with pytest.raises(ProtocolError, match="'val_accuracy' must be number or null"):
        wp.Epoch(images=1, stage="s", model=0, epoch=1, epochs=1, train_loss=0.1, val_accuracy="high", seconds=1)
    with pytest.raises(ProtocolError, match="task 'x' must hold an error string"):
        wp.Described(device="cpu", seconds=0.0, tasks={"x": {"summary": {}, "models": [1]}})
    with pytest.raises(ProtocolError, match="op is 'train'"):
        wp.Prepare.from_dict({"op": "train", "data": "/d"})
    assert wp.Epoch(images=1, stage="s", model=0, epoch=1, epochs=1, train_loss=1, val_accuracy=0.5,
                    seconds=0).train_loss == 1  # an integer is a number


def test_a_described_task_may_list_its_augmentations_as_names():
    found = {"summary": {"classes": {"a": [1, 2]}}, "models": ["cnn"], "positive_class": None}
    answer = wp.Described(device="cpu", seconds=0.0, tasks={"t": {**found, "augmentations": ["flip-crop"]}})
    assert wp.parse_answer(answer.to_json()) == answer
    wp.Described(device="cpu", seconds=0.0, tasks={"t": found})  # an older worker's answer: no key, none offered
    with pytest.raises(ProtocolError, match="task 't' must hold .* a list of augmentation names"):
        wp.Described(device="cpu", seconds=0.0, tasks={"t": {**found, "augmentations": "flip-crop"}})


def test_messages_are_frozen():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        REQUESTS[0].data = "/elsewhere"
