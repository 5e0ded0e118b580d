from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferFailureReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_FAILURE_REASON_UNSPECIFIED: _ClassVar[TransferFailureReason]
    TRANSFER_FAILURE_REASON_CHECKSUM_MISMATCH: _ClassVar[TransferFailureReason]
    TRANSFER_FAILURE_REASON_DEADLINE_EXCEEDED: _ClassVar[TransferFailureReason]
    TRANSFER_FAILURE_REASON_PEER_UNAVAILABLE: _ClassVar[TransferFailureReason]
    TRANSFER_FAILURE_REASON_RESERVATION_EXPIRED: _ClassVar[TransferFailureReason]
    TRANSFER_FAILURE_REASON_UNKNOWN_TRANSFER: _ClassVar[TransferFailureReason]
    TRANSFER_FAILURE_REASON_INCOMPATIBLE: _ClassVar[TransferFailureReason]
    TRANSFER_FAILURE_REASON_INCOMPLETE: _ClassVar[TransferFailureReason]
    TRANSFER_FAILURE_REASON_CANCELLED: _ClassVar[TransferFailureReason]
    TRANSFER_FAILURE_REASON_RESOURCE_EXHAUSTED: _ClassVar[TransferFailureReason]
    TRANSFER_FAILURE_REASON_UNAUTHENTICATED: _ClassVar[TransferFailureReason]
    TRANSFER_FAILURE_REASON_PROTOCOL_ERROR: _ClassVar[TransferFailureReason]
    TRANSFER_FAILURE_REASON_INTERNAL: _ClassVar[TransferFailureReason]

class DataPlane(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_PLANE_UNSPECIFIED: _ClassVar[DataPlane]
    DATA_PLANE_GRPC: _ClassVar[DataPlane]
    DATA_PLANE_SHM: _ClassVar[DataPlane]

class ChecksumAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_ALGORITHM_UNSPECIFIED: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_CRC32: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_XXH3_64: _ClassVar[ChecksumAlgorithm]
TRANSFER_FAILURE_REASON_UNSPECIFIED: TransferFailureReason
TRANSFER_FAILURE_REASON_CHECKSUM_MISMATCH: TransferFailureReason
TRANSFER_FAILURE_REASON_DEADLINE_EXCEEDED: TransferFailureReason
TRANSFER_FAILURE_REASON_PEER_UNAVAILABLE: TransferFailureReason
TRANSFER_FAILURE_REASON_RESERVATION_EXPIRED: TransferFailureReason
TRANSFER_FAILURE_REASON_UNKNOWN_TRANSFER: TransferFailureReason
TRANSFER_FAILURE_REASON_INCOMPATIBLE: TransferFailureReason
TRANSFER_FAILURE_REASON_INCOMPLETE: TransferFailureReason
TRANSFER_FAILURE_REASON_CANCELLED: TransferFailureReason
TRANSFER_FAILURE_REASON_RESOURCE_EXHAUSTED: TransferFailureReason
TRANSFER_FAILURE_REASON_UNAUTHENTICATED: TransferFailureReason
TRANSFER_FAILURE_REASON_PROTOCOL_ERROR: TransferFailureReason
TRANSFER_FAILURE_REASON_INTERNAL: TransferFailureReason
DATA_PLANE_UNSPECIFIED: DataPlane
DATA_PLANE_GRPC: DataPlane
DATA_PLANE_SHM: DataPlane
CHECKSUM_ALGORITHM_UNSPECIFIED: ChecksumAlgorithm
CHECKSUM_ALGORITHM_CRC32: ChecksumAlgorithm
CHECKSUM_ALGORITHM_XXH3_64: ChecksumAlgorithm

class KvLayoutSpec(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "dtype", "model_fingerprint", "layout_name")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_NAME_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str
    model_fingerprint: str
    layout_name: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tokens_per_block: _Optional[int] = ..., dtype: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., layout_name: _Optional[str] = ...) -> None: ...

class KvPrepareRequest(_message.Message):
    __slots__ = ("transfer_id", "request_id", "layout", "num_blocks", "num_streams", "max_chunk_bytes", "timeout_s", "checksum_algorithms", "shm_offer")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHMS_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFER_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    layout: KvLayoutSpec
    num_blocks: int
    num_streams: int
    max_chunk_bytes: int
    timeout_s: float
    checksum_algorithms: _containers.RepeatedScalarFieldContainer[ChecksumAlgorithm]
    shm_offer: KvShmOffer
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayoutSpec, _Mapping]] = ..., num_blocks: _Optional[int] = ..., num_streams: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., timeout_s: _Optional[float] = ..., checksum_algorithms: _Optional[_Iterable[_Union[ChecksumAlgorithm, str]]] = ..., shm_offer: _Optional[_Union[KvShmOffer, _Mapping]] = ...) -> None: ...

class KvShmOffer(_message.Message):
    __slots__ = ("segment", "probe_offset", "probe")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    PROBE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    segment: str
    probe_offset: int
    probe: bytes
    def __init__(self, segment: _Optional[str] = ..., probe_offset: _Optional[int] = ..., probe: _Optional[bytes] = ...) -> None: ...

class KvPrepareResponse(_message.Message):
    __slots__ = ("layout", "expected_num_blocks", "max_chunk_bytes", "max_streams", "timeout_s", "checksum_algorithm", "data_plane", "last_chunk_ends_stream")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    LAST_CHUNK_ENDS_STREAM_FIELD_NUMBER: _ClassVar[int]
    layout: KvLayoutSpec
    expected_num_blocks: int
    max_chunk_bytes: int
    max_streams: int
    timeout_s: float
    checksum_algorithm: ChecksumAlgorithm
    data_plane: DataPlane
    last_chunk_ends_stream: bool
    def __init__(self, layout: _Optional[_Union[KvLayoutSpec, _Mapping]] = ..., expected_num_blocks: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., max_streams: _Optional[int] = ..., timeout_s: _Optional[float] = ..., checksum_algorithm: _Optional[_Union[ChecksumAlgorithm, str]] = ..., data_plane: _Optional[_Union[DataPlane, str]] = ..., last_chunk_ends_stream: bool = ...) -> None: ...

class KvChunkHeader(_message.Message):
    __slots__ = ("transfer_id", "request_id", "sequence", "layer_start", "layer_end", "block_start", "block_end", "dtype", "shape", "byte_length", "checksum", "checksum_algorithm", "end_of_stream", "shm", "commit")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_END_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BYTE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    END_OF_STREAM_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    sequence: int
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    byte_length: int
    checksum: int
    checksum_algorithm: ChecksumAlgorithm
    end_of_stream: bool
    shm: KvShmRef
    commit: KvCommitRequest
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., sequence: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., block_start: _Optional[int] = ..., block_end: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., byte_length: _Optional[int] = ..., checksum: _Optional[int] = ..., checksum_algorithm: _Optional[_Union[ChecksumAlgorithm, str]] = ..., end_of_stream: bool = ..., shm: _Optional[_Union[KvShmRef, _Mapping]] = ..., commit: _Optional[_Union[KvCommitRequest, _Mapping]] = ...) -> None: ...

class KvShmRef(_message.Message):
    __slots__ = ("offset",)
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    offset: int
    def __init__(self, offset: _Optional[int] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: KvChunkHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[KvChunkHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class KvPushResponse(_message.Message):
    __slots__ = ("chunks_accepted", "chunks_duplicate", "bytes_accepted", "committed", "chunks_received", "bytes_received")
    CHUNKS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    chunks_accepted: int
    chunks_duplicate: int
    bytes_accepted: int
    committed: bool
    chunks_received: int
    bytes_received: int
    def __init__(self, chunks_accepted: _Optional[int] = ..., chunks_duplicate: _Optional[int] = ..., bytes_accepted: _Optional[int] = ..., committed: bool = ..., chunks_received: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class KvCommitRequest(_message.Message):
    __slots__ = ("transfer_id", "request_id", "chunks_sent", "bytes_sent", "output_token_ids")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    chunks_sent: int
    bytes_sent: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., chunks_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KvCommitResponse(_message.Message):
    __slots__ = ("chunks_received", "bytes_received")
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    chunks_received: int
    bytes_received: int
    def __init__(self, chunks_received: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class KvAbortRequest(_message.Message):
    __slots__ = ("transfer_id", "request_id", "reason", "detail")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    reason: TransferFailureReason
    detail: str
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., reason: _Optional[_Union[TransferFailureReason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class KvAbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: bool = ...) -> None: ...
