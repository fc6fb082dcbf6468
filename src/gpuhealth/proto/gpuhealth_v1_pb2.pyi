from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_KIND_UNSPECIFIED: _ClassVar[RequestKind]
    DUMP_FLIGHT_RECORDER: _ClassVar[RequestKind]
    CAPTURE_STACKS: _ClassVar[RequestKind]
    RUN_DIAGNOSTIC: _ClassVar[RequestKind]
REQUEST_KIND_UNSPECIFIED: RequestKind
DUMP_FLIGHT_RECORDER: RequestKind
CAPTURE_STACKS: RequestKind
RUN_DIAGNOSTIC: RequestKind

class GpuInfo(_message.Message):
    __slots__ = ("index", "uuid", "pci_bus_id", "name", "vbios", "serial")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VBIOS_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    pci_bus_id: str
    name: str
    vbios: str
    serial: str
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., name: _Optional[str] = ..., vbios: _Optional[str] = ..., serial: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node_name", "incarnation", "agent_version", "versions", "gpus", "topology_json", "api_version")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_JSON_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    incarnation: str
    agent_version: str
    versions: _containers.ScalarMap[str, str]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    topology_json: str
    api_version: int
    def __init__(self, node_name: _Optional[str] = ..., incarnation: _Optional[str] = ..., agent_version: _Optional[str] = ..., versions: _Optional[_Mapping[str, str]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., topology_json: _Optional[str] = ..., api_version: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("session_id", "acked_seq", "api_version", "heartbeat_interval_s", "max_inflight")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    acked_seq: int
    api_version: int
    heartbeat_interval_s: float
    max_inflight: int
    def __init__(self, session_id: _Optional[str] = ..., acked_seq: _Optional[int] = ..., api_version: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., max_inflight: _Optional[int] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("record", "health", "result")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    record: Record
    health: HealthSummary
    result: RequestResult
    def __init__(self, record: _Optional[_Union[Record, _Mapping]] = ..., health: _Optional[_Union[HealthSummary, _Mapping]] = ..., result: _Optional[_Union[RequestResult, _Mapping]] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("seq", "created_at", "steps", "ranks", "findings", "sdc")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    SDC_FIELD_NUMBER: _ClassVar[int]
    seq: int
    created_at: float
    steps: StepBatch
    ranks: RankIdentities
    findings: FindingsSnapshot
    sdc: SdcDigests
    def __init__(self, seq: _Optional[int] = ..., created_at: _Optional[float] = ..., steps: _Optional[_Union[StepBatch, _Mapping]] = ..., ranks: _Optional[_Union[RankIdentities, _Mapping]] = ..., findings: _Optional[_Union[FindingsSnapshot, _Mapping]] = ..., sdc: _Optional[_Union[SdcDigests, _Mapping]] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("job_id", "rank", "step", "start_time", "wall_s", "compute_s", "comm_wait_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    COMM_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: _containers.RepeatedScalarFieldContainer[int]
    step: _containers.RepeatedScalarFieldContainer[int]
    start_time: _containers.RepeatedScalarFieldContainer[float]
    wall_s: _containers.RepeatedScalarFieldContainer[float]
    compute_s: _containers.RepeatedScalarFieldContainer[float]
    comm_wait_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[_Iterable[int]] = ..., step: _Optional[_Iterable[int]] = ..., start_time: _Optional[_Iterable[float]] = ..., wall_s: _Optional[_Iterable[float]] = ..., compute_s: _Optional[_Iterable[float]] = ..., comm_wait_s: _Optional[_Iterable[float]] = ...) -> None: ...

class RankIdentity(_message.Message):
    __slots__ = ("job_id", "rank", "world_size", "host", "pid", "local_rank", "gpu_uuid", "gpu_index")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    host: str
    pid: int
    local_rank: int
    gpu_uuid: str
    gpu_index: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., local_rank: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., gpu_index: _Optional[int] = ...) -> None: ...

class RankIdentities(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankIdentity]
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankIdentity, _Mapping]]] = ...) -> None: ...

class Finding(_message.Message):
    __slots__ = ("code", "severity", "entity_kind", "entity_id", "gpu_index", "message", "action", "evidence_json", "source")
    CODE_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    ENTITY_KIND_FIELD_NUMBER: _ClassVar[int]
    ENTITY_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_JSON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    code: str
    severity: str
    entity_kind: str
    entity_id: str
    gpu_index: int
    message: str
    action: str
    evidence_json: str
    source: str
    def __init__(self, code: _Optional[str] = ..., severity: _Optional[str] = ..., entity_kind: _Optional[str] = ..., entity_id: _Optional[str] = ..., gpu_index: _Optional[int] = ..., message: _Optional[str] = ..., action: _Optional[str] = ..., evidence_json: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class FindingsSnapshot(_message.Message):
    __slots__ = ("at", "findings")
    AT_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    at: float
    findings: _containers.RepeatedCompositeFieldContainer[Finding]
    def __init__(self, at: _Optional[float] = ..., findings: _Optional[_Iterable[_Union[Finding, _Mapping]]] = ...) -> None: ...

class SdcDigest(_message.Message):
    __slots__ = ("gpu_uuid", "key", "digest", "at")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    key: str
    digest: str
    at: float
    def __init__(self, gpu_uuid: _Optional[str] = ..., key: _Optional[str] = ..., digest: _Optional[str] = ..., at: _Optional[float] = ...) -> None: ...

class SdcDigests(_message.Message):
    __slots__ = ("digests",)
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    digests: _containers.RepeatedCompositeFieldContainer[SdcDigest]
    def __init__(self, digests: _Optional[_Iterable[_Union[SdcDigest, _Mapping]]] = ...) -> None: ...

class GpuHealth(_message.Message):
    __slots__ = ("index", "uuid", "health")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    health: str
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., health: _Optional[str] = ...) -> None: ...

class LiveRanks(_message.Message):
    __slots__ = ("job_id", "ranks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class HealthSummary(_message.Message):
    __slots__ = ("at", "health", "gpus", "spool_depth", "spool_dropped", "live")
    AT_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SPOOL_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SPOOL_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    at: float
    health: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuHealth]
    spool_depth: int
    spool_dropped: int
    live: _containers.RepeatedCompositeFieldContainer[LiveRanks]
    def __init__(self, at: _Optional[float] = ..., health: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuHealth, _Mapping]]] = ..., spool_depth: _Optional[int] = ..., spool_dropped: _Optional[int] = ..., live: _Optional[_Iterable[_Union[LiveRanks, _Mapping]]] = ...) -> None: ...

class AgentRequest(_message.Message):
    __slots__ = ("request_id", "kind", "job_id", "rank", "timeout_s", "diagnostic", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTIC_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    kind: RequestKind
    job_id: str
    rank: int
    timeout_s: float
    diagnostic: str
    params: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[int] = ..., kind: _Optional[_Union[RequestKind, str]] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., timeout_s: _Optional[float] = ..., diagnostic: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RequestResult(_message.Message):
    __slots__ = ("request_id", "rank", "ok", "error", "payload", "format", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    rank: int
    ok: bool
    error: str
    payload: bytes
    format: str
    final: bool
    def __init__(self, request_id: _Optional[int] = ..., rank: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., payload: _Optional[bytes] = ..., format: _Optional[str] = ..., final: _Optional[bool] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("up_to_seq",)
    UP_TO_SEQ_FIELD_NUMBER: _ClassVar[int]
    up_to_seq: int
    def __init__(self, up_to_seq: _Optional[int] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("ack", "request")
    ACK_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ack: Ack
    request: AgentRequest
    def __init__(self, ack: _Optional[_Union[Ack, _Mapping]] = ..., request: _Optional[_Union[AgentRequest, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("job_id", "include_finished")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_FINISHED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    include_finished: bool
    def __init__(self, job_id: _Optional[str] = ..., include_finished: _Optional[bool] = ...) -> None: ...

class FleetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LiveTriageRequest(_message.Message):
    __slots__ = ("job_id", "timeout_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    timeout_s: float
    def __init__(self, job_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RunDiagnosticRequest(_message.Message):
    __slots__ = ("nodes", "diagnostic", "params", "timeout_s")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODES_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTIC_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    diagnostic: str
    params: _containers.ScalarMap[str, str]
    timeout_s: float
    def __init__(self, nodes: _Optional[_Iterable[str]] = ..., diagnostic: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class JsonReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
