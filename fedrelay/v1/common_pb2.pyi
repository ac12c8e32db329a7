from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Purpose(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PURPOSE_UNSPECIFIED: _ClassVar[Purpose]
    CHAIN_HOP: _ClassVar[Purpose]
    FINAL_MODEL: _ClassVar[Purpose]
    UPLOAD: _ClassVar[Purpose]
PURPOSE_UNSPECIFIED: Purpose
CHAIN_HOP: Purpose
FINAL_MODEL: Purpose
UPLOAD: Purpose

class ModelSpec(_message.Message):
    __slots__ = ("model", "num_classes", "task", "task_version", "task_sha256", "input_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_VERSION_FIELD_NUMBER: _ClassVar[int]
    TASK_SHA256_FIELD_NUMBER: _ClassVar[int]
    INPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_classes: int
    task: str
    task_version: str
    task_sha256: str
    input_json: str
    def __init__(self, model: _Optional[str] = ..., num_classes: _Optional[int] = ..., task: _Optional[str] = ..., task_version: _Optional[str] = ..., task_sha256: _Optional[str] = ..., input_json: _Optional[str] = ...) -> None: ...

class TrainingParams(_message.Message):
    __slots__ = ("strategy", "models_per_site", "local_epochs", "warmup_epochs", "alpha", "beta", "lr", "batch_size", "weight_decay", "selection", "init", "init_sha256", "weighting", "maecho_tau", "maecho_eta", "maecho_alpha", "ofasd_mode", "ofasd_epochs", "ofasd_lr", "upload_timeout", "dp_noise_multiplier", "dp_epsilon", "dp_max_grad_norm", "dp_delta", "method_options")
    class MethodOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    MODELS_PER_SITE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    SELECTION_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    INIT_SHA256_FIELD_NUMBER: _ClassVar[int]
    WEIGHTING_FIELD_NUMBER: _ClassVar[int]
    MAECHO_TAU_FIELD_NUMBER: _ClassVar[int]
    MAECHO_ETA_FIELD_NUMBER: _ClassVar[int]
    MAECHO_ALPHA_FIELD_NUMBER: _ClassVar[int]
    OFASD_MODE_FIELD_NUMBER: _ClassVar[int]
    OFASD_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    OFASD_LR_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    DP_NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    DP_EPSILON_FIELD_NUMBER: _ClassVar[int]
    DP_MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    DP_DELTA_FIELD_NUMBER: _ClassVar[int]
    METHOD_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    models_per_site: int
    local_epochs: int
    warmup_epochs: int
    alpha: float
    beta: float
    lr: float
    batch_size: int
    weight_decay: float
    selection: str
    init: str
    init_sha256: str
    weighting: str
    maecho_tau: int
    maecho_eta: float
    maecho_alpha: str
    ofasd_mode: str
    ofasd_epochs: int
    ofasd_lr: float
    upload_timeout: float
    dp_noise_multiplier: float
    dp_epsilon: float
    dp_max_grad_norm: float
    dp_delta: float
    method_options: _containers.ScalarMap[str, str]
    def __init__(self, strategy: _Optional[str] = ..., models_per_site: _Optional[int] = ..., local_epochs: _Optional[int] = ..., warmup_epochs: _Optional[int] = ..., alpha: _Optional[float] = ..., beta: _Optional[float] = ..., lr: _Optional[float] = ..., batch_size: _Optional[int] = ..., weight_decay: _Optional[float] = ..., selection: _Optional[str] = ..., init: _Optional[str] = ..., init_sha256: _Optional[str] = ..., weighting: _Optional[str] = ..., maecho_tau: _Optional[int] = ..., maecho_eta: _Optional[float] = ..., maecho_alpha: _Optional[str] = ..., ofasd_mode: _Optional[str] = ..., ofasd_epochs: _Optional[int] = ..., ofasd_lr: _Optional[float] = ..., upload_timeout: _Optional[float] = ..., dp_noise_multiplier: _Optional[float] = ..., dp_epsilon: _Optional[float] = ..., dp_max_grad_norm: _Optional[float] = ..., dp_delta: _Optional[float] = ..., method_options: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SiteRef(_message.Message):
    __slots__ = ("name", "address", "certificate")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    certificate: bytes
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., certificate: _Optional[bytes] = ...) -> None: ...

class PlannedTransfer(_message.Message):
    __slots__ = ("purpose", "index", "round", "sender", "receiver")
    PURPOSE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    purpose: Purpose
    index: int
    round: int
    sender: str
    receiver: str
    def __init__(self, purpose: _Optional[_Union[Purpose, str]] = ..., index: _Optional[int] = ..., round: _Optional[int] = ..., sender: _Optional[str] = ..., receiver: _Optional[str] = ...) -> None: ...

class TransferHeader(_message.Message):
    __slots__ = ("run_id", "hop", "sender", "total_bytes", "sha256", "purpose", "offset", "receiver", "relay_grant")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PURPOSE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    RELAY_GRANT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    hop: int
    sender: str
    total_bytes: int
    sha256: str
    purpose: Purpose
    offset: int
    receiver: str
    relay_grant: RelayGrant
    def __init__(self, run_id: _Optional[str] = ..., hop: _Optional[int] = ..., sender: _Optional[str] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., purpose: _Optional[_Union[Purpose, str]] = ..., offset: _Optional[int] = ..., receiver: _Optional[str] = ..., relay_grant: _Optional[_Union[RelayGrant, _Mapping]] = ...) -> None: ...

class RelayGrant(_message.Message):
    __slots__ = ("body", "signature")
    BODY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    body: bytes
    signature: bytes
    def __init__(self, body: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ModelChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
