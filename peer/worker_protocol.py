"""The messages between a site daemon and its worker processes, typed: the one description of
the protocol (``peer/worker_main.py`` is the worker's end, ``peer/worker_pool.py`` the daemon's).

On the pipe each message is one JSON object per line: requests on the worker's stdin, answers on
its stdout (its stderr carries log lines only). A request names itself with ``"op"``, an answer
with ``"event"``; every other key is a field of the message's dataclass below, with the same
name. Paths are ``str`` (absolute, on the site's host), times are seconds (``float``), counts
are images or samples (``int``).

Requests (``Request``) and the answer each expects:

====================  =====================  ==============================================
request (``op``)      answer (``event``)     what the worker does
====================  =====================  ==============================================
``Prepare``           ``Ready``              read the site's data with the run's task
``Describe``          ``Described``          the daemon's start-up check of every task
``SchemaJob``         ``Schemas``            the run's payload schemas (no data needed)
``TrainJob``          ``Trained``            one visit's local training
``AggregateJob``      ``Aggregated``         a star plan's aggregation
``EvaluateJob``       ``Evaluated``          the final model on the site's test split
====================  =====================  ==============================================

While a job runs the worker writes ``Epoch`` lines (progress, one per finished epoch) before its
answer. A request that fails is answered ``Error`` (``"Type: message"``) and the worker goes on;
a line that is not a JSON object with a string ``"op"`` ends it (exit code 2). What the jobs do
with their fields is documented in ``peer/jobs.py``.

Each message checks its fields as it is made (constructor or :meth:`Message.from_dict`): a
missing or unknown field, or a value of the wrong JSON type, raises :class:`ProtocolError` (a
``ValueError``) naming the message and the field. :func:`parse_request` and :func:`parse_answer`
read one line; ``to_json()`` writes one.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

__all__ = [
    "ProtocolError", "Message", "Request", "Answer", "Job",
    "Prepare", "Describe", "SchemaJob", "TrainJob", "AggregateJob", "EvaluateJob",
    "Ready", "Described", "Schemas", "Trained", "Aggregated", "Evaluated", "Epoch", "Error",
    "REQUESTS", "ANSWERS", "parse_request", "parse_answer", "request_from_dict", "answer_from_dict", "as_request",
]


class ProtocolError(ValueError):
    """A message that does not fit the protocol: unknown op or event, a missing or unknown
    field, a field of the wrong type, a line that is not a JSON object."""


# -- field checks ------------------------------------------------------------------------------------
def _describe(tp) -> str:
    """A type as the error message says it: ``int``, ``str or null``, ``list of str``, ..."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any JSON value"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return f"list of {_describe(args[0])}"
    if origin is dict:
        return f"object of {_describe(args[1])}"
    return {dict: "object", list: "list", float: "number", int: "integer", bool: "boolean",
            str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _fits(value, tp) -> bool:
    """Whether ``value`` (as JSON decodes it) is of the field type ``tp``. ``bool`` is not a
    number here, and an integer is a number (JSON writes ``1.0`` as ``1.0`` but a task may give 1)."""
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and _fits(v, args[1]) for k, v in value.items())
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = {k: v for k, v in typing.get_type_hints(cls).items()
                       if k in {f.name for f in dataclasses.fields(cls)}}
    return _HINTS[cls]


@dataclass(frozen=True)
class Message:
    """A message of the protocol (see the module docstring). Subclasses set ``KEY`` (``"op"``
    or ``"event"``) and ``NAME`` (its value on the pipe)."""

    KEY: ClassVar[str] = ""
    NAME: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name, tp in _hints(type(self)).items():
            value = getattr(self, name)
            if not _fits(value, tp):
                raise ProtocolError(f"{self._what()}: field {name!r} must be {_describe(tp)}, not "
                                    f"{type(value).__name__} {_short(value)}")

    @classmethod
    def _what(cls) -> str:
        return f"worker {'request' if cls.KEY == 'op' else 'answer'} {cls.NAME!r}"

    def to_dict(self) -> dict:
        """The JSON object sent on the pipe: ``{KEY: NAME, field: value, ...}``."""
        return {self.KEY: self.NAME, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    def to_json(self) -> str:
        """One line (no newline) for the pipe."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict):
        """The message from its JSON object; ``KEY`` may be left out (else it must be ``NAME``),
        fields with a default may be left out. Raises ``ProtocolError``."""
        if not isinstance(d, dict):
            raise ProtocolError(f"{cls._what()} must be a JSON object, not {type(d).__name__}")
        if cls.KEY in d and d[cls.KEY] != cls.NAME:
            raise ProtocolError(f"{cls._what()}: {cls.KEY} is {d[cls.KEY]!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k != cls.KEY and k not in fields)
        if unknown:
            raise ProtocolError(f"{cls._what()}: unknown field(s) {', '.join(map(repr, unknown))}")
        missing = [n for n, f in fields.items() if n not in d and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ProtocolError(f"{cls._what()}: missing field(s) {', '.join(map(repr, missing))}")
        return cls(**{k: v for k, v in d.items() if k != cls.KEY})


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- requests (daemon -> worker) ---------------------------------------------------------------------
@dataclass(frozen=True)
class Request(Message):
    """A request to a worker. ``ANSWER``: the answer it expects (besides ``Epoch`` and ``Error``)."""

    KEY: ClassVar[str] = "op"
    ANSWER: ClassVar[type] = Message


@dataclass(frozen=True)
class Job(Request):
    """A job (``peer/jobs.py``): run on the data the worker prepared (a schema job needs none).
    ``spec``: the run's model, :meth:`fedrelay.ModelSpec.to_dict` (its task is the one the
    worker prepares)."""

    spec: dict


@dataclass(frozen=True)
class _Training(Job):
    """What every training job of a run is told (``peer/node.py``'s ``_job_base``)."""

    params: dict  # the run's parameters, fedrelay.params.to_dict
    seed: int  # the run's seed (each use derives its own: peer.training.derive_seed)
    class_index: list[str]  # the run's class names, in label order
    site: str  # this site's name (its train/validation split's seed)
    aggregator: str  # the star plan's aggregator ("" for a chain: the hop carries the model only)
    options: dict  # the run's method options, typed (fedrelay.params.options): the aggregator's, the strategy's


@dataclass(frozen=True)
class SchemaJob(Job):
    """The payload schemas of a run; needs no data (answered before ``Prepare``)."""

    NAME: ClassVar[str] = "schema"
    strategy: str  # the run's strategy (fedrelay.registry)
    aggregator: str = ""  # a star plan's aggregator: its extra tensors' schema
    options: dict = field(default_factory=dict)  # the run's method options (fedrelay.params.options)


@dataclass(frozen=True)
class TrainJob(_Training):
    """One visit's local training (``peer.jobs.train``)."""

    NAME: ClassVar[str] = "train"
    position: int  # this site's position in the plan (round 1's training seed)
    round: int  # the visit's round, 1-based
    folder: str  # the visit's folder: warmup.safetensors and pool/model-<j>.safetensors persist there
    outgoing: str  # where the model to send is written
    received: str | None = None  # the hop's payload, None at a chain's first visit
    initial: dict | None = None  # the run's initial model (peer.jobs.initial_state), or None
    privacy_epochs: int = 0  # a DP run: the site's DP epochs over the run (0: no DP)


@dataclass(frozen=True)
class AggregateJob(_Training):
    """A star plan's aggregation at the aggregating site (``peer.jobs.aggregate``)."""

    NAME: ClassVar[str] = "aggregate"
    uploads: dict[str, str]  # site name -> its upload's payload path (this site's own included)
    final: str  # where the final model is written
    initial: dict | None = None  # the run's initial model (peer.jobs.initial_state), or None


@dataclass(frozen=True)
class EvaluateJob(Job):
    """A model on the site's test split (``peer.jobs.evaluate``)."""

    NAME: ClassVar[str] = "evaluate"
    model: str  # the safetensors model's path
    class_index: list[str]  # the run's class names, in label order
    params: dict | None = None  # a DP run: the run's parameters (its delta)
    privacy_books: list[str] = field(default_factory=list)  # a DP run: the run's privacy.json files here


@dataclass(frozen=True)
class Prepare(Request):
    """Read the site's folder with a task and set up the device (``peer.worker_main.Worker.prepare``)."""

    NAME: ClassVar[str] = "prepare"
    data: str  # the site's data folder
    device: str = "cpu"  # auto, cpu or cuda:N
    deterministic: bool = True  # deterministic kernels (peer.training.use_deterministic_kernels)
    task: str = ""  # the task's name ("": the default task)
    task_sha256: str = ""  # its code's pinned SHA-256 ("": not pinned)
    extra_tasks: list[str] = field(default_factory=list)  # module:attr tasks the daemon offers


@dataclass(frozen=True)
class Describe(Request):
    """The daemon's start-up check: each task describes and reads the folder
    (``peer.worker_main.Worker.describe``)."""

    NAME: ClassVar[str] = "describe"
    data: str  # the site's data folder
    tasks: dict[str, str]  # task name -> its code's SHA-256
    device: str = "cpu"  # auto, cpu or cuda:N (resolved in the answer)
    extra_tasks: list[str] = field(default_factory=list)  # module:attr tasks the daemon offers


# -- answers (worker -> daemon) ----------------------------------------------------------------------
@dataclass(frozen=True)
class Answer(Message):
    """An answer from a worker."""

    KEY: ClassVar[str] = "event"


@dataclass(frozen=True)
class Ready(Answer):
    """``Prepare`` done."""

    NAME: ClassVar[str] = "ready"
    seconds: float  # the time it took
    device: str  # the device, auto resolved (cpu or cuda:N)
    train: int  # training samples read
    test: int  # test samples read


@dataclass(frozen=True)
class Described(Answer):
    """``Describe`` done. ``tasks``: name -> ``{"summary": DataSummary.to_dict(), "models":
    [name, ...], "positive_class": str or None, "augmentations": [name, ...]}`` (the train-time
    augmentations the task offers, ``--augment``; an answer without the key: none), or
    ``{"error": "Type: message"}`` for a task that cannot read the folder."""

    NAME: ClassVar[str] = "described"
    device: str  # the device, auto resolved
    seconds: float  # the time it took
    tasks: dict[str, dict]

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, found in self.tasks.items():
            ok = (_fits(found.get("error"), str) if "error" in found else
                  _fits(found.get("summary"), dict) and _fits(found.get("models"), list[str])
                  and _fits(found.get("positive_class"), str | None)
                  and _fits(found.get("augmentations", []), list[str]))
            if not ok:
                raise ProtocolError(f"{self._what()}: task {name!r} must hold an error string, or a summary object, "
                                    f"a list of model names, a positive class and a list of augmentation names, "
                                    f"not {_short(found)}")


@dataclass(frozen=True)
class Schemas(Answer):
    """``SchemaJob`` done: torch-free payload schemas, ``{tensor name: [shape, dtype]}``
    (``fedrelay.payload``): a chain hop's, the run's model's, and a star upload's extra tensors'."""

    NAME: ClassVar[str] = "schemas"
    hop: dict[str, list]
    model: dict[str, list]
    extras: dict[str, list]


@dataclass(frozen=True)
class Trained(Answer):
    """``TrainJob`` done."""

    NAME: ClassVar[str] = "trained"
    seconds: float  # the training's time
    pool: int  # pool models trained (the warm-up not counted)


@dataclass(frozen=True)
class Aggregated(Answer):
    """``AggregateJob`` done."""

    NAME: ClassVar[str] = "aggregated"
    seconds: float  # the aggregation's time
    models: int  # uploads combined


@dataclass(frozen=True)
class Evaluated(Answer):
    """``EvaluateJob`` done (``fedrelay.scoring``)."""

    NAME: ClassVar[str] = "evaluated"
    correct: int  # top-1 correct test samples
    total: int  # test samples
    metrics: dict[str, float]  # the site's exact metrics, built-in and the task's own
    stats: dict  # aggregate statistics for the run's global figures (and "privacy" in a DP run)
    seconds: float  # the evaluation's time


@dataclass(frozen=True)
class Epoch(Answer):
    """Progress while a job runs: one epoch ended (``peer.training.fit``'s ``on_epoch``)."""

    NAME: ClassVar[str] = "epoch"
    images: int  # training images per epoch (0: not a local training epoch, e.g. an aggregator's)
    stage: str  # "warmup", the strategy's stage, or "aggregate"
    model: int  # the pool model's index (0: the warm-up or an aggregator)
    epoch: int  # 1-based
    epochs: int  # the stage's epochs
    train_loss: float  # mean training loss of the epoch
    val_accuracy: float | None  # on the validation split, None where not measured
    seconds: float  # since the stage began


@dataclass(frozen=True)
class Error(Answer):
    """The request failed: ``"Type: message"`` of what it raised."""

    NAME: ClassVar[str] = "error"
    error: str


SchemaJob.ANSWER, TrainJob.ANSWER, AggregateJob.ANSWER, EvaluateJob.ANSWER = Schemas, Trained, Aggregated, Evaluated
Prepare.ANSWER, Describe.ANSWER = Ready, Described

REQUESTS: dict[str, type[Request]] = {c.NAME: c for c in (Prepare, Describe, SchemaJob, TrainJob, AggregateJob,
                                                         EvaluateJob)}
ANSWERS: dict[str, type[Answer]] = {c.NAME: c for c in (Ready, Described, Schemas, Trained, Aggregated, Evaluated,
                                                       Epoch, Error)}


def _from_dict(d, key: str, table: dict, what: str):
    if not isinstance(d, dict):
        raise ProtocolError(f"a worker {what} must be a JSON object, not {type(d).__name__}")
    name = d.get(key)
    if name not in table:
        raise ProtocolError(f"unknown worker {what} {key} {name!r} (known: {', '.join(table)})")
    return table[name].from_dict(d)


def _loads(line: str | bytes, what: str):
    try:
        return json.loads(line)
    except ValueError as exc:
        raise ProtocolError(f"a worker {what} line is not JSON: {exc}") from None


def request_from_dict(d: dict) -> Request:
    """The request a JSON object is (by its ``"op"``). Raises ``ProtocolError``."""
    return _from_dict(d, "op", REQUESTS, "request")


def answer_from_dict(d: dict) -> Answer:
    """The answer a JSON object is (by its ``"event"``). Raises ``ProtocolError``."""
    return _from_dict(d, "event", ANSWERS, "answer")


def parse_request(line: str | bytes) -> Request:
    """One request line. Raises ``ProtocolError``."""
    return request_from_dict(_loads(line, "request"))


def parse_answer(line: str | bytes) -> Answer:
    """One answer line. Raises ``ProtocolError``."""
    return answer_from_dict(_loads(line, "answer"))


def as_request(req: Request | dict) -> Request:
    """``req`` itself, or the request its JSON object is. Raises ``ProtocolError``."""
    return req if isinstance(req, Request) else request_from_dict(req)
