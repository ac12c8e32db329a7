from fedrelay.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RelayQuotaRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class RelayQuotaReply(_message.Message):
    __slots__ = ("payload_cap_bytes",)
    PAYLOAD_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    payload_cap_bytes: int
    def __init__(self, payload_cap_bytes: _Optional[int] = ...) -> None: ...

class PolicyVerdict(_message.Message):
    __slots__ = ("run_id", "has_policy")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_POLICY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    has_policy: bool
    def __init__(self, run_id: _Optional[str] = ..., has_policy: _Optional[bool] = ...) -> None: ...

class RelayNotice(_message.Message):
    __slots__ = ("run_id", "purpose", "index", "sender", "relay", "sealed_bytes", "sealed_sha256")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PURPOSE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    SEALED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEALED_SHA256_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    purpose: _common_pb2.Purpose
    index: int
    sender: str
    relay: str
    sealed_bytes: int
    sealed_sha256: str
    def __init__(self, run_id: _Optional[str] = ..., purpose: _Optional[_Union[_common_pb2.Purpose, str]] = ..., index: _Optional[int] = ..., sender: _Optional[str] = ..., relay: _Optional[str] = ..., sealed_bytes: _Optional[int] = ..., sealed_sha256: _Optional[str] = ...) -> None: ...

class RelayReadyReply(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("run_id", "sender")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    sender: str
    def __init__(self, run_id: _Optional[str] = ..., sender: _Optional[str] = ...) -> None: ...

class PrepareReply(_message.Message):
    __slots__ = ("started",)
    STARTED_FIELD_NUMBER: _ClassVar[int]
    started: bool
    def __init__(self, started: _Optional[bool] = ...) -> None: ...

class EndRunRequest(_message.Message):
    __slots__ = ("run_id", "status", "reason", "cancelled_by")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_BY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    status: str
    reason: str
    cancelled_by: str
    def __init__(self, run_id: _Optional[str] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ..., cancelled_by: _Optional[str] = ...) -> None: ...

class EndRunReply(_message.Message):
    __slots__ = ("run_id", "state", "removed_bytes")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: str
    removed_bytes: int
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[str] = ..., removed_bytes: _Optional[int] = ...) -> None: ...

class TransferOffsetReply(_message.Message):
    __slots__ = ("offset", "complete")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    complete: bool
    def __init__(self, offset: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("run_id", "position", "chain_length", "seed", "params", "model", "class_index", "site", "order", "route_version", "rounds", "transfers", "peers", "visits", "aggregator", "operator")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    CHAIN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CLASS_INDEX_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    ROUTE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    VISITS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    position: int
    chain_length: int
    seed: int
    params: _common_pb2.TrainingParams
    model: _common_pb2.ModelSpec
    class_index: _containers.RepeatedScalarFieldContainer[str]
    site: str
    order: _containers.RepeatedScalarFieldContainer[str]
    route_version: int
    rounds: int
    transfers: _containers.RepeatedCompositeFieldContainer[_common_pb2.PlannedTransfer]
    peers: _containers.RepeatedCompositeFieldContainer[_common_pb2.SiteRef]
    visits: _containers.RepeatedScalarFieldContainer[int]
    aggregator: str
    operator: str
    def __init__(self, run_id: _Optional[str] = ..., position: _Optional[int] = ..., chain_length: _Optional[int] = ..., seed: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.TrainingParams, _Mapping]] = ..., model: _Optional[_Union[_common_pb2.ModelSpec, _Mapping]] = ..., class_index: _Optional[_Iterable[str]] = ..., site: _Optional[str] = ..., order: _Optional[_Iterable[str]] = ..., route_version: _Optional[int] = ..., rounds: _Optional[int] = ..., transfers: _Optional[_Iterable[_Union[_common_pb2.PlannedTransfer, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[_common_pb2.SiteRef, _Mapping]]] = ..., visits: _Optional[_Iterable[int]] = ..., aggregator: _Optional[str] = ..., operator: _Optional[str] = ...) -> None: ...

class RerouteRequest(_message.Message):
    __slots__ = ("run_id", "skipped", "route_version", "transfers", "peers", "visits")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    ROUTE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    VISITS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    skipped: _containers.RepeatedScalarFieldContainer[str]
    route_version: int
    transfers: _containers.RepeatedCompositeFieldContainer[_common_pb2.PlannedTransfer]
    peers: _containers.RepeatedCompositeFieldContainer[_common_pb2.SiteRef]
    visits: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, run_id: _Optional[str] = ..., skipped: _Optional[_Iterable[str]] = ..., route_version: _Optional[int] = ..., transfers: _Optional[_Iterable[_Union[_common_pb2.PlannedTransfer, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[_common_pb2.SiteRef, _Mapping]]] = ..., visits: _Optional[_Iterable[int]] = ...) -> None: ...

class RerouteReply(_message.Message):
    __slots__ = ("run_id", "state")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class AssignReply(_message.Message):
    __slots__ = ("run_id", "state")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class HandoffReceipt(_message.Message):
    __slots__ = ("run_id", "hop", "receiver", "received_bytes", "sha256", "duplicate")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    hop: int
    receiver: str
    received_bytes: int
    sha256: str
    duplicate: bool
    def __init__(self, run_id: _Optional[str] = ..., hop: _Optional[int] = ..., receiver: _Optional[str] = ..., received_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "state", "detail")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: str
    detail: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("name", "address", "device", "version", "runs", "instance", "coordinator", "last_registered", "registration_error", "started")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    LAST_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ERROR_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    device: str
    version: str
    runs: _containers.RepeatedCompositeFieldContainer[RunStatus]
    instance: str
    coordinator: str
    last_registered: float
    registration_error: str
    started: float
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., version: _Optional[str] = ..., runs: _Optional[_Iterable[_Union[RunStatus, _Mapping]]] = ..., instance: _Optional[str] = ..., coordinator: _Optional[str] = ..., last_registered: _Optional[float] = ..., registration_error: _Optional[str] = ..., started: _Optional[float] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("run_id", "sha256")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    sha256: str
    def __init__(self, run_id: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class EvaluateReply(_message.Message):
    __slots__ = ("site", "correct", "test_samples", "accuracy", "seconds", "metrics", "stats_json", "signature", "certificate", "run_id", "sha256")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SITE_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    TEST_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    site: str
    correct: int
    test_samples: int
    accuracy: float
    seconds: float
    metrics: _containers.ScalarMap[str, float]
    stats_json: str
    signature: bytes
    certificate: bytes
    run_id: str
    sha256: str
    def __init__(self, site: _Optional[str] = ..., correct: _Optional[int] = ..., test_samples: _Optional[int] = ..., accuracy: _Optional[float] = ..., seconds: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., stats_json: _Optional[str] = ..., signature: _Optional[bytes] = ..., certificate: _Optional[bytes] = ..., run_id: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class FetchModelRequest(_message.Message):
    __slots__ = ("run_id", "sha256")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    sha256: str
    def __init__(self, run_id: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...
