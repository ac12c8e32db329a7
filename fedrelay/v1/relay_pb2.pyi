from fedrelay.v1 import common_pb2 as _common_pb2
from fedrelay.v1 import peer_pb2 as _peer_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RelayKey(_message.Message):
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

class RelayGetRequest(_message.Message):
    __slots__ = ("key", "offset")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    key: RelayKey
    offset: int
    def __init__(self, key: _Optional[_Union[RelayKey, _Mapping]] = ..., offset: _Optional[int] = ...) -> None: ...

class RelayReceipt(_message.Message):
    __slots__ = ("stored_bytes", "sha256", "duplicate")
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    stored_bytes: int
    sha256: str
    duplicate: bool
    def __init__(self, stored_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class RelayDiscardReply(_message.Message):
    __slots__ = ("removed_bytes",)
    REMOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    removed_bytes: int
    def __init__(self, removed_bytes: _Optional[int] = ...) -> None: ...
