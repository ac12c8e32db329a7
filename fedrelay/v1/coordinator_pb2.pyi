from fedrelay.v1 import common_pb2 as _common_pb2
from fedrelay.v1 import peer_pb2 as _peer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClassCount(_message.Message):
    __slots__ = ("name", "train", "test")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    TEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    train: int
    test: int
    def __init__(self, name: _Optional[str] = ..., train: _Optional[int] = ..., test: _Optional[int] = ...) -> None: ...

class TaskOffer(_message.Message):
    __slots__ = ("name", "version", "sha256", "models", "classes", "input_json", "stats_json", "error", "positive_class", "augmentations")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    INPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    POSITIVE_CLASS_FIELD_NUMBER: _ClassVar[int]
    AUGMENTATIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    sha256: str
    models: _containers.RepeatedScalarFieldContainer[str]
    classes: _containers.RepeatedCompositeFieldContainer[ClassCount]
    input_json: str
    stats_json: str
    error: str
    positive_class: str
    augmentations: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., sha256: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., classes: _Optional[_Iterable[_Union[ClassCount, _Mapping]]] = ..., input_json: _Optional[str] = ..., stats_json: _Optional[str] = ..., error: _Optional[str] = ..., positive_class: _Optional[str] = ..., augmentations: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("name", "address", "tasks", "device", "version", "instance", "outbound_only")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_ONLY_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    tasks: _containers.RepeatedCompositeFieldContainer[TaskOffer]
    device: str
    version: str
    instance: str
    outbound_only: bool
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., tasks: _Optional[_Iterable[_Union[TaskOffer, _Mapping]]] = ..., device: _Optional[str] = ..., version: _Optional[str] = ..., instance: _Optional[str] = ..., outbound_only: _Optional[bool] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("version", "heartbeat_seconds", "relay", "crl_number", "revoked_sites")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    CRL_NUMBER_FIELD_NUMBER: _ClassVar[int]
    REVOKED_SITES_FIELD_NUMBER: _ClassVar[int]
    version: str
    heartbeat_seconds: int
    relay: str
    crl_number: int
    revoked_sites: int
    def __init__(self, version: _Optional[str] = ..., heartbeat_seconds: _Optional[int] = ..., relay: _Optional[str] = ..., crl_number: _Optional[int] = ..., revoked_sites: _Optional[int] = ...) -> None: ...

class ControlRequest(_message.Message):
    __slots__ = ("id", "method", "request", "timeout")
    ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    id: int
    method: str
    request: bytes
    timeout: float
    def __init__(self, id: _Optional[int] = ..., method: _Optional[str] = ..., request: _Optional[bytes] = ..., timeout: _Optional[float] = ...) -> None: ...

class ControlReply(_message.Message):
    __slots__ = ("id", "reply", "code", "details", "more", "site", "instance")
    ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    id: int
    reply: bytes
    code: int
    details: str
    more: bool
    site: str
    instance: str
    def __init__(self, id: _Optional[int] = ..., reply: _Optional[bytes] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., more: _Optional[bool] = ..., site: _Optional[str] = ..., instance: _Optional[str] = ...) -> None: ...

class ResolveSiteRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class HopReport(_message.Message):
    __slots__ = ("run_id", "hop", "purpose", "sender", "receiver", "payload_bytes", "wire_bytes", "sha256", "started", "ended", "attempts", "resumed_from", "round", "schema_sha256", "route", "sealed_bytes", "relay", "sealed_sha256", "signature")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    PURPOSE_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_SHA256_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    SEALED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    SEALED_SHA256_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    hop: int
    purpose: _common_pb2.Purpose
    sender: str
    receiver: str
    payload_bytes: int
    wire_bytes: int
    sha256: str
    started: float
    ended: float
    attempts: int
    resumed_from: int
    round: int
    schema_sha256: str
    route: str
    sealed_bytes: int
    relay: str
    sealed_sha256: str
    signature: bytes
    def __init__(self, run_id: _Optional[str] = ..., hop: _Optional[int] = ..., purpose: _Optional[_Union[_common_pb2.Purpose, str]] = ..., sender: _Optional[str] = ..., receiver: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., started: _Optional[float] = ..., ended: _Optional[float] = ..., attempts: _Optional[int] = ..., resumed_from: _Optional[int] = ..., round: _Optional[int] = ..., schema_sha256: _Optional[str] = ..., route: _Optional[str] = ..., sealed_bytes: _Optional[int] = ..., relay: _Optional[str] = ..., sealed_sha256: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ReceiptReport(_message.Message):
    __slots__ = ("run_id", "purpose", "hop", "sender", "receiver", "payload_bytes", "sha256", "schema_sha256", "received", "route", "relay_wire_bytes", "signature")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PURPOSE_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_SHA256_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    RELAY_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    purpose: _common_pb2.Purpose
    hop: int
    sender: str
    receiver: str
    payload_bytes: int
    sha256: str
    schema_sha256: str
    received: float
    route: str
    relay_wire_bytes: int
    signature: bytes
    def __init__(self, run_id: _Optional[str] = ..., purpose: _Optional[_Union[_common_pb2.Purpose, str]] = ..., hop: _Optional[int] = ..., sender: _Optional[str] = ..., receiver: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., schema_sha256: _Optional[str] = ..., received: _Optional[float] = ..., route: _Optional[str] = ..., relay_wire_bytes: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ProgressReport(_message.Message):
    __slots__ = ("run_id", "site", "kind", "state", "detail", "stage", "model", "epoch", "epochs", "train_loss", "val_accuracy", "seconds")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    VAL_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    site: str
    kind: str
    state: str
    detail: str
    stage: str
    model: int
    epoch: int
    epochs: int
    train_loss: float
    val_accuracy: float
    seconds: float
    def __init__(self, run_id: _Optional[str] = ..., site: _Optional[str] = ..., kind: _Optional[str] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ..., stage: _Optional[str] = ..., model: _Optional[int] = ..., epoch: _Optional[int] = ..., epochs: _Optional[int] = ..., train_loss: _Optional[float] = ..., val_accuracy: _Optional[float] = ..., seconds: _Optional[float] = ...) -> None: ...

class FinalReport(_message.Message):
    __slots__ = ("run_id", "site", "sha256", "model_bytes", "missing", "signature")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    site: str
    sha256: str
    model_bytes: int
    missing: _containers.RepeatedScalarFieldContainer[str]
    signature: bytes
    def __init__(self, run_id: _Optional[str] = ..., site: _Optional[str] = ..., sha256: _Optional[str] = ..., model_bytes: _Optional[int] = ..., missing: _Optional[_Iterable[str]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class FailureReport(_message.Message):
    __slots__ = ("run_id", "site", "error", "signature")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    site: str
    error: str
    signature: bytes
    def __init__(self, run_id: _Optional[str] = ..., site: _Optional[str] = ..., error: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("duplicate",)
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    def __init__(self, duplicate: _Optional[bool] = ...) -> None: ...

class StartChainRequest(_message.Message):
    __slots__ = ("peers", "order", "seed", "params", "model", "task", "task_sha256", "rounds", "aggregator")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_SHA256_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedScalarFieldContainer[str]
    order: str
    seed: int
    params: _common_pb2.TrainingParams
    model: str
    task: str
    task_sha256: str
    rounds: int
    aggregator: str
    def __init__(self, peers: _Optional[_Iterable[str]] = ..., order: _Optional[str] = ..., seed: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.TrainingParams, _Mapping]] = ..., model: _Optional[str] = ..., task: _Optional[str] = ..., task_sha256: _Optional[str] = ..., rounds: _Optional[int] = ..., aggregator: _Optional[str] = ...) -> None: ...

class StartChainReply(_message.Message):
    __slots__ = ("run_id", "order", "warnings")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    order: _containers.RepeatedScalarFieldContainer[str]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., order: _Optional[_Iterable[str]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id", "after_seq")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    after_seq: int
    def __init__(self, run_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("run_id", "seq", "time", "kind", "site", "message", "data_json")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DATA_JSON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    seq: int
    time: float
    kind: str
    site: str
    message: str
    data_json: str
    def __init__(self, run_id: _Optional[str] = ..., seq: _Optional[int] = ..., time: _Optional[float] = ..., kind: _Optional[str] = ..., site: _Optional[str] = ..., message: _Optional[str] = ..., data_json: _Optional[str] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id", "offset")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    offset: int
    def __init__(self, run_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class HopRecord(_message.Message):
    __slots__ = ("hop", "sender", "receiver", "payload_bytes", "wire_bytes", "sha256", "started", "ended", "attempts", "resumed_from", "round", "status", "receiver_sha256", "receiver_bytes", "route", "sealed_bytes", "relay_wire_bytes", "relay")
    HOP_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_SHA256_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    SEALED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELAY_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    hop: int
    sender: str
    receiver: str
    payload_bytes: int
    wire_bytes: int
    sha256: str
    started: float
    ended: float
    attempts: int
    resumed_from: int
    round: int
    status: str
    receiver_sha256: str
    receiver_bytes: int
    route: str
    sealed_bytes: int
    relay_wire_bytes: int
    relay: str
    def __init__(self, hop: _Optional[int] = ..., sender: _Optional[str] = ..., receiver: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., started: _Optional[float] = ..., ended: _Optional[float] = ..., attempts: _Optional[int] = ..., resumed_from: _Optional[int] = ..., round: _Optional[int] = ..., status: _Optional[str] = ..., receiver_sha256: _Optional[str] = ..., receiver_bytes: _Optional[int] = ..., route: _Optional[str] = ..., sealed_bytes: _Optional[int] = ..., relay_wire_bytes: _Optional[int] = ..., relay: _Optional[str] = ...) -> None: ...

class SiteAccuracy(_message.Message):
    __slots__ = ("accuracy", "test_samples", "metrics", "privacy")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    TEST_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    accuracy: float
    test_samples: int
    metrics: _containers.ScalarMap[str, float]
    privacy: PrivacySpent
    def __init__(self, accuracy: _Optional[float] = ..., test_samples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., privacy: _Optional[_Union[PrivacySpent, _Mapping]] = ...) -> None: ...

class PrivacySpent(_message.Message):
    __slots__ = ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "steps", "sample_rate", "accountant")
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    epsilon: float
    delta: float
    noise_multiplier: float
    max_grad_norm: float
    steps: int
    sample_rate: float
    accountant: str
    def __init__(self, epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., noise_multiplier: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., steps: _Optional[int] = ..., sample_rate: _Optional[float] = ..., accountant: _Optional[str] = ...) -> None: ...

class FinalResult(_message.Message):
    __slots__ = ("sha256", "accuracy", "per_site", "metrics")
    class PerSiteEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SiteAccuracy
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SiteAccuracy, _Mapping]] = ...) -> None: ...
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    PER_SITE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    accuracy: float
    per_site: _containers.MessageMap[str, SiteAccuracy]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, sha256: _Optional[str] = ..., accuracy: _Optional[float] = ..., per_site: _Optional[_Mapping[str, SiteAccuracy]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RunSummary(_message.Message):
    __slots__ = ("run_id", "strategy", "order", "model_bytes", "hops", "final", "status", "params", "seed", "arch", "class_index", "warnings", "error", "created", "ended", "final_transfers", "insecure", "skipped", "contributors", "rounds", "plan", "final_site", "planned_hops", "uploads", "planned_uploads", "aggregator", "upload_bytes", "live", "cancelled_by", "cancel_reason", "task", "task_version", "task_sha256", "model_spec_json", "revoked", "started_by", "refused_by", "refusal", "refused_by_policy")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    CLASS_INDEX_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    FINAL_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    INSECURE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    FINAL_SITE_FIELD_NUMBER: _ClassVar[int]
    PLANNED_HOPS_FIELD_NUMBER: _ClassVar[int]
    UPLOADS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_UPLOADS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_BY_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REASON_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_VERSION_FIELD_NUMBER: _ClassVar[int]
    TASK_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    STARTED_BY_FIELD_NUMBER: _ClassVar[int]
    REFUSED_BY_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    REFUSED_BY_POLICY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    strategy: str
    order: _containers.RepeatedScalarFieldContainer[str]
    model_bytes: int
    hops: _containers.RepeatedCompositeFieldContainer[HopRecord]
    final: FinalResult
    status: str
    params: _common_pb2.TrainingParams
    seed: int
    arch: str
    class_index: _containers.RepeatedScalarFieldContainer[str]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    error: str
    created: float
    ended: float
    final_transfers: _containers.RepeatedCompositeFieldContainer[HopRecord]
    insecure: bool
    skipped: _containers.RepeatedScalarFieldContainer[str]
    contributors: _containers.RepeatedScalarFieldContainer[str]
    rounds: int
    plan: _containers.RepeatedCompositeFieldContainer[_common_pb2.PlannedTransfer]
    final_site: str
    planned_hops: int
    uploads: _containers.RepeatedCompositeFieldContainer[HopRecord]
    planned_uploads: int
    aggregator: str
    upload_bytes: int
    live: _containers.RepeatedCompositeFieldContainer[SiteLive]
    cancelled_by: str
    cancel_reason: str
    task: str
    task_version: str
    task_sha256: str
    model_spec_json: str
    revoked: _containers.RepeatedCompositeFieldContainer[CrlEntry]
    started_by: str
    refused_by: str
    refusal: str
    refused_by_policy: bool
    def __init__(self, run_id: _Optional[str] = ..., strategy: _Optional[str] = ..., order: _Optional[_Iterable[str]] = ..., model_bytes: _Optional[int] = ..., hops: _Optional[_Iterable[_Union[HopRecord, _Mapping]]] = ..., final: _Optional[_Union[FinalResult, _Mapping]] = ..., status: _Optional[str] = ..., params: _Optional[_Union[_common_pb2.TrainingParams, _Mapping]] = ..., seed: _Optional[int] = ..., arch: _Optional[str] = ..., class_index: _Optional[_Iterable[str]] = ..., warnings: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ..., created: _Optional[float] = ..., ended: _Optional[float] = ..., final_transfers: _Optional[_Iterable[_Union[HopRecord, _Mapping]]] = ..., insecure: _Optional[bool] = ..., skipped: _Optional[_Iterable[str]] = ..., contributors: _Optional[_Iterable[str]] = ..., rounds: _Optional[int] = ..., plan: _Optional[_Iterable[_Union[_common_pb2.PlannedTransfer, _Mapping]]] = ..., final_site: _Optional[str] = ..., planned_hops: _Optional[int] = ..., uploads: _Optional[_Iterable[_Union[HopRecord, _Mapping]]] = ..., planned_uploads: _Optional[int] = ..., aggregator: _Optional[str] = ..., upload_bytes: _Optional[int] = ..., live: _Optional[_Iterable[_Union[SiteLive, _Mapping]]] = ..., cancelled_by: _Optional[str] = ..., cancel_reason: _Optional[str] = ..., task: _Optional[str] = ..., task_version: _Optional[str] = ..., task_sha256: _Optional[str] = ..., model_spec_json: _Optional[str] = ..., revoked: _Optional[_Iterable[_Union[CrlEntry, _Mapping]]] = ..., started_by: _Optional[str] = ..., refused_by: _Optional[str] = ..., refusal: _Optional[str] = ..., refused_by_policy: _Optional[bool] = ...) -> None: ...

class SiteLive(_message.Message):
    __slots__ = ("site", "state", "detail", "activity", "stage", "model", "models", "epoch", "epochs", "updated", "line", "age_seconds")
    SITE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    site: str
    state: str
    detail: str
    activity: str
    stage: str
    model: int
    models: int
    epoch: int
    epochs: int
    updated: float
    line: str
    age_seconds: float
    def __init__(self, site: _Optional[str] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ..., activity: _Optional[str] = ..., stage: _Optional[str] = ..., model: _Optional[int] = ..., models: _Optional[int] = ..., epoch: _Optional[int] = ..., epochs: _Optional[int] = ..., updated: _Optional[float] = ..., line: _Optional[str] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class MetricRow(_message.Message):
    __slots__ = ("site", "time", "stage", "model", "epoch", "epochs", "train_loss", "val_accuracy", "seconds")
    SITE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    VAL_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    site: str
    time: float
    stage: str
    model: int
    epoch: int
    epochs: int
    train_loss: float
    val_accuracy: float
    seconds: float
    def __init__(self, site: _Optional[str] = ..., time: _Optional[float] = ..., stage: _Optional[str] = ..., model: _Optional[int] = ..., epoch: _Optional[int] = ..., epochs: _Optional[int] = ..., train_loss: _Optional[float] = ..., val_accuracy: _Optional[float] = ..., seconds: _Optional[float] = ...) -> None: ...

class MetricsReply(_message.Message):
    __slots__ = ("run_id", "rows", "next_offset")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rows: _containers.RepeatedCompositeFieldContainer[MetricRow]
    next_offset: int
    def __init__(self, run_id: _Optional[str] = ..., rows: _Optional[_Iterable[_Union[MetricRow, _Mapping]]] = ..., next_offset: _Optional[int] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ForgetPeerRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ForgetPeerReply(_message.Message):
    __slots__ = ("name", "address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("after",)
    AFTER_FIELD_NUMBER: _ClassVar[int]
    after: str
    def __init__(self, after: _Optional[str] = ...) -> None: ...

class ListRunsReply(_message.Message):
    __slots__ = ("runs", "next_after")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunSummary]
    next_after: str
    def __init__(self, runs: _Optional[_Iterable[_Union[RunSummary, _Mapping]]] = ..., next_after: _Optional[str] = ...) -> None: ...

class ListPeersRequest(_message.Message):
    __slots__ = ("after",)
    AFTER_FIELD_NUMBER: _ClassVar[int]
    after: str
    def __init__(self, after: _Optional[str] = ...) -> None: ...

class PeerRecord(_message.Message):
    __slots__ = ("name", "address", "tasks", "device", "last_seen", "live", "age_seconds", "peer_timeout", "outbound_only", "connected", "classes_omitted", "revocation")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEER_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_ONLY_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    CLASSES_OMITTED_FIELD_NUMBER: _ClassVar[int]
    REVOCATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    tasks: _containers.RepeatedCompositeFieldContainer[TaskOffer]
    device: str
    last_seen: float
    live: bool
    age_seconds: float
    peer_timeout: float
    outbound_only: bool
    connected: bool
    classes_omitted: int
    revocation: CrlEntry
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., tasks: _Optional[_Iterable[_Union[TaskOffer, _Mapping]]] = ..., device: _Optional[str] = ..., last_seen: _Optional[float] = ..., live: _Optional[bool] = ..., age_seconds: _Optional[float] = ..., peer_timeout: _Optional[float] = ..., outbound_only: _Optional[bool] = ..., connected: _Optional[bool] = ..., classes_omitted: _Optional[int] = ..., revocation: _Optional[_Union[CrlEntry, _Mapping]] = ...) -> None: ...

class ListPeersReply(_message.Message):
    __slots__ = ("peers", "next_after")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[PeerRecord]
    next_after: str
    def __init__(self, peers: _Optional[_Iterable[_Union[PeerRecord, _Mapping]]] = ..., next_after: _Optional[str] = ...) -> None: ...

class RunSeal(_message.Message):
    __slots__ = ("run_id", "events", "last_seq", "head", "run_json", "plans", "sealed")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    RUN_JSON_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    events: int
    last_seq: int
    head: str
    run_json: str
    plans: _containers.RepeatedScalarFieldContainer[str]
    sealed: float
    def __init__(self, run_id: _Optional[str] = ..., events: _Optional[int] = ..., last_seq: _Optional[int] = ..., head: _Optional[str] = ..., run_json: _Optional[str] = ..., plans: _Optional[_Iterable[str]] = ..., sealed: _Optional[float] = ...) -> None: ...

class RelayGrantRequest(_message.Message):
    __slots__ = ("run_id", "purpose", "index", "receiver")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PURPOSE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    purpose: _common_pb2.Purpose
    index: int
    receiver: str
    def __init__(self, run_id: _Optional[str] = ..., purpose: _Optional[_Union[_common_pb2.Purpose, str]] = ..., index: _Optional[int] = ..., receiver: _Optional[str] = ...) -> None: ...

class CrlEntry(_message.Message):
    __slots__ = ("name", "serial", "revoked_at", "revoked_by", "reason", "reinstated")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_BY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REINSTATED_FIELD_NUMBER: _ClassVar[int]
    name: str
    serial: str
    revoked_at: float
    revoked_by: str
    reason: str
    reinstated: bool
    def __init__(self, name: _Optional[str] = ..., serial: _Optional[str] = ..., revoked_at: _Optional[float] = ..., revoked_by: _Optional[str] = ..., reason: _Optional[str] = ..., reinstated: _Optional[bool] = ...) -> None: ...

class RevocationRequest(_message.Message):
    __slots__ = ("name", "reason", "crl", "serials")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CRL_FIELD_NUMBER: _ClassVar[int]
    SERIALS_FIELD_NUMBER: _ClassVar[int]
    name: str
    reason: str
    crl: bytes
    serials: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., reason: _Optional[str] = ..., crl: _Optional[bytes] = ..., serials: _Optional[_Iterable[str]] = ...) -> None: ...

class RevocationReply(_message.Message):
    __slots__ = ("name", "revoked_by", "revoked_at", "runs", "crl_number")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REVOKED_BY_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    CRL_NUMBER_FIELD_NUMBER: _ClassVar[int]
    name: str
    revoked_by: str
    revoked_at: float
    runs: _containers.RepeatedScalarFieldContainer[str]
    crl_number: int
    def __init__(self, name: _Optional[str] = ..., revoked_by: _Optional[str] = ..., revoked_at: _Optional[float] = ..., runs: _Optional[_Iterable[str]] = ..., crl_number: _Optional[int] = ...) -> None: ...

class CrlRequest(_message.Message):
    __slots__ = ("have",)
    HAVE_FIELD_NUMBER: _ClassVar[int]
    have: int
    def __init__(self, have: _Optional[int] = ...) -> None: ...

class CrlReply(_message.Message):
    __slots__ = ("crl", "number", "entries")
    CRL_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    crl: bytes
    number: int
    entries: _containers.RepeatedCompositeFieldContainer[CrlEntry]
    def __init__(self, crl: _Optional[bytes] = ..., number: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[CrlEntry, _Mapping]]] = ...) -> None: ...
