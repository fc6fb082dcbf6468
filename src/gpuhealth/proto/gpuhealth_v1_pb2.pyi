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

class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_UNSPECIFIED: _ClassVar[Verdict]
    VERDICT_HANG: _ClassVar[Verdict]
    VERDICT_MISMATCH: _ClassVar[Verdict]
    VERDICT_STRAGGLER: _ClassVar[Verdict]
    VERDICT_HEALTHY: _ClassVar[Verdict]
    VERDICT_INCOMPLETE: _ClassVar[Verdict]

class RootKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROOT_KIND_UNSPECIFIED: _ClassVar[RootKind]
    ROOT_HOST_STUCK: _ClassVar[RootKind]
    ROOT_SKIPPED: _ClassVar[RootKind]
    ROOT_TIMED_OUT: _ClassVar[RootKind]
    ROOT_BEHIND: _ClassVar[RootKind]
    ROOT_P2P_UNMATCHED: _ClassVar[RootKind]
    ROOT_GPU_STALL: _ClassVar[RootKind]
    ROOT_MISMATCH: _ClassVar[RootKind]
    ROOT_CIRCULAR: _ClassVar[RootKind]
    ROOT_DUMP_MISSING: _ClassVar[RootKind]
    ROOT_DUMP_UNREADABLE: _ClassVar[RootKind]
    ROOT_STRAGGLER: _ClassVar[RootKind]
REQUEST_KIND_UNSPECIFIED: RequestKind
DUMP_FLIGHT_RECORDER: RequestKind
CAPTURE_STACKS: RequestKind
RUN_DIAGNOSTIC: RequestKind
VERDICT_UNSPECIFIED: Verdict
VERDICT_HANG: Verdict
VERDICT_MISMATCH: Verdict
VERDICT_STRAGGLER: Verdict
VERDICT_HEALTHY: Verdict
VERDICT_INCOMPLETE: Verdict
ROOT_KIND_UNSPECIFIED: RootKind
ROOT_HOST_STUCK: RootKind
ROOT_SKIPPED: RootKind
ROOT_TIMED_OUT: RootKind
ROOT_BEHIND: RootKind
ROOT_P2P_UNMATCHED: RootKind
ROOT_GPU_STALL: RootKind
ROOT_MISMATCH: RootKind
ROOT_CIRCULAR: RootKind
ROOT_DUMP_MISSING: RootKind
ROOT_DUMP_UNREADABLE: RootKind
ROOT_STRAGGLER: RootKind

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
    __slots__ = ("node_name", "incarnation", "agent_version", "versions", "gpus", "topology_json", "api_version", "simulated", "backend")
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
    SIMULATED_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    incarnation: str
    agent_version: str
    versions: _containers.ScalarMap[str, str]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    topology_json: str
    api_version: int
    simulated: bool
    backend: str
    def __init__(self, node_name: _Optional[str] = ..., incarnation: _Optional[str] = ..., agent_version: _Optional[str] = ..., versions: _Optional[_Mapping[str, str]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., topology_json: _Optional[str] = ..., api_version: _Optional[int] = ..., simulated: _Optional[bool] = ..., backend: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("seq", "created_at", "steps", "ranks", "findings", "sdc", "screens")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    SDC_FIELD_NUMBER: _ClassVar[int]
    SCREENS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    created_at: float
    steps: StepBatch
    ranks: RankIdentities
    findings: FindingsSnapshot
    sdc: SdcDigests
    screens: ScreenResults
    def __init__(self, seq: _Optional[int] = ..., created_at: _Optional[float] = ..., steps: _Optional[_Union[StepBatch, _Mapping]] = ..., ranks: _Optional[_Union[RankIdentities, _Mapping]] = ..., findings: _Optional[_Union[FindingsSnapshot, _Mapping]] = ..., sdc: _Optional[_Union[SdcDigests, _Mapping]] = ..., screens: _Optional[_Union[ScreenResults, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("job_id", "rank", "world_size", "host", "pid", "local_rank", "gpu_uuid", "gpu_index", "found_by", "verified")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    FOUND_BY_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    host: str
    pid: int
    local_rank: int
    gpu_uuid: str
    gpu_index: int
    found_by: str
    verified: bool
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., local_rank: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., gpu_index: _Optional[int] = ..., found_by: _Optional[str] = ..., verified: _Optional[bool] = ...) -> None: ...

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

class ScreenResult(_message.Message):
    __slots__ = ("gpu_uuid", "gpu_index", "started_at", "finished_at", "level", "result", "reason", "digests", "trigger")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    gpu_index: int
    started_at: float
    finished_at: float
    level: str
    result: str
    reason: str
    digests: _containers.RepeatedCompositeFieldContainer[SdcDigest]
    trigger: str
    def __init__(self, gpu_uuid: _Optional[str] = ..., gpu_index: _Optional[int] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., level: _Optional[str] = ..., result: _Optional[str] = ..., reason: _Optional[str] = ..., digests: _Optional[_Iterable[_Union[SdcDigest, _Mapping]]] = ..., trigger: _Optional[str] = ...) -> None: ...

class ScreenResults(_message.Message):
    __slots__ = ("screens",)
    SCREENS_FIELD_NUMBER: _ClassVar[int]
    screens: _containers.RepeatedCompositeFieldContainer[ScreenResult]
    def __init__(self, screens: _Optional[_Iterable[_Union[ScreenResult, _Mapping]]] = ...) -> None: ...

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

class ScreenTurn(_message.Message):
    __slots__ = ("not_before", "valid_for_s")
    NOT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    VALID_FOR_S_FIELD_NUMBER: _ClassVar[int]
    not_before: float
    valid_for_s: float
    def __init__(self, not_before: _Optional[float] = ..., valid_for_s: _Optional[float] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("ack", "request", "screen_turn")
    ACK_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SCREEN_TURN_FIELD_NUMBER: _ClassVar[int]
    ack: Ack
    request: AgentRequest
    screen_turn: ScreenTurn
    def __init__(self, ack: _Optional[_Union[Ack, _Mapping]] = ..., request: _Optional[_Union[AgentRequest, _Mapping]] = ..., screen_turn: _Optional[_Union[ScreenTurn, _Mapping]] = ...) -> None: ...

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

class Blocked(_message.Message):
    __slots__ = ("what", "group", "seq", "waiting_ranks")
    WHAT_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WAITING_RANKS_FIELD_NUMBER: _ClassVar[int]
    what: str
    group: str
    seq: int
    waiting_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, what: _Optional[str] = ..., group: _Optional[str] = ..., seq: _Optional[int] = ..., waiting_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class RootCause(_message.Message):
    __slots__ = ("kind", "ranks", "why", "group", "seq", "op", "mismatch", "waiting_ranks", "affected_ranks", "consequences", "followed_by", "decided_by", "completed", "created_ns", "what", "blocks", "idle_s", "timeout_s")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FIELD_NUMBER: _ClassVar[int]
    WAITING_RANKS_FIELD_NUMBER: _ClassVar[int]
    AFFECTED_RANKS_FIELD_NUMBER: _ClassVar[int]
    CONSEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FOLLOWED_BY_FIELD_NUMBER: _ClassVar[int]
    DECIDED_BY_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    CREATED_NS_FIELD_NUMBER: _ClassVar[int]
    WHAT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    kind: RootKind
    ranks: _containers.RepeatedScalarFieldContainer[int]
    why: str
    group: str
    seq: int
    op: str
    mismatch: str
    waiting_ranks: _containers.RepeatedScalarFieldContainer[int]
    affected_ranks: _containers.RepeatedScalarFieldContainer[int]
    consequences: _containers.RepeatedScalarFieldContainer[str]
    followed_by: _containers.RepeatedCompositeFieldContainer[RootCause]
    decided_by: str
    completed: bool
    created_ns: int
    what: str
    blocks: _containers.RepeatedCompositeFieldContainer[Blocked]
    idle_s: float
    timeout_s: float
    def __init__(self, kind: _Optional[_Union[RootKind, str]] = ..., ranks: _Optional[_Iterable[int]] = ..., why: _Optional[str] = ..., group: _Optional[str] = ..., seq: _Optional[int] = ..., op: _Optional[str] = ..., mismatch: _Optional[str] = ..., waiting_ranks: _Optional[_Iterable[int]] = ..., affected_ranks: _Optional[_Iterable[int]] = ..., consequences: _Optional[_Iterable[str]] = ..., followed_by: _Optional[_Iterable[_Union[RootCause, _Mapping]]] = ..., decided_by: _Optional[str] = ..., completed: _Optional[bool] = ..., created_ns: _Optional[int] = ..., what: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[Blocked, _Mapping]]] = ..., idle_s: _Optional[float] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class DumpProblem(_message.Message):
    __slots__ = ("path", "message", "rank", "severity")
    PATH_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    path: str
    message: str
    rank: int
    severity: str
    def __init__(self, path: _Optional[str] = ..., message: _Optional[str] = ..., rank: _Optional[int] = ..., severity: _Optional[str] = ...) -> None: ...

class GroupState(_message.Message):
    __slots__ = ("name", "pg_name", "desc", "members", "membership_source", "ranks_dumped", "ranks_missing", "last_enqueued", "last_completed")
    class LastEnqueuedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class LastCompletedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PG_NAME_FIELD_NUMBER: _ClassVar[int]
    DESC_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RANKS_DUMPED_FIELD_NUMBER: _ClassVar[int]
    RANKS_MISSING_FIELD_NUMBER: _ClassVar[int]
    LAST_ENQUEUED_FIELD_NUMBER: _ClassVar[int]
    LAST_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    name: str
    pg_name: str
    desc: str
    members: _containers.RepeatedScalarFieldContainer[int]
    membership_source: str
    ranks_dumped: _containers.RepeatedScalarFieldContainer[int]
    ranks_missing: _containers.RepeatedScalarFieldContainer[int]
    last_enqueued: _containers.ScalarMap[int, int]
    last_completed: _containers.ScalarMap[int, int]
    def __init__(self, name: _Optional[str] = ..., pg_name: _Optional[str] = ..., desc: _Optional[str] = ..., members: _Optional[_Iterable[int]] = ..., membership_source: _Optional[str] = ..., ranks_dumped: _Optional[_Iterable[int]] = ..., ranks_missing: _Optional[_Iterable[int]] = ..., last_enqueued: _Optional[_Mapping[int, int]] = ..., last_completed: _Optional[_Mapping[int, int]] = ...) -> None: ...

class TriageReport(_message.Message):
    __slots__ = ("verdict", "summary", "roots", "findings", "ranks_seen", "ranks_missing", "ranks_unreadable", "groups", "problems", "notes", "rank_identity")
    class RankIdentityEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    ROOTS_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    RANKS_SEEN_FIELD_NUMBER: _ClassVar[int]
    RANKS_MISSING_FIELD_NUMBER: _ClassVar[int]
    RANKS_UNREADABLE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    RANK_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    verdict: Verdict
    summary: str
    roots: _containers.RepeatedCompositeFieldContainer[RootCause]
    findings: _containers.RepeatedCompositeFieldContainer[Finding]
    ranks_seen: _containers.RepeatedScalarFieldContainer[int]
    ranks_missing: _containers.RepeatedScalarFieldContainer[int]
    ranks_unreadable: _containers.RepeatedScalarFieldContainer[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupState]
    problems: _containers.RepeatedCompositeFieldContainer[DumpProblem]
    notes: _containers.RepeatedScalarFieldContainer[str]
    rank_identity: _containers.ScalarMap[int, str]
    def __init__(self, verdict: _Optional[_Union[Verdict, str]] = ..., summary: _Optional[str] = ..., roots: _Optional[_Iterable[_Union[RootCause, _Mapping]]] = ..., findings: _Optional[_Iterable[_Union[Finding, _Mapping]]] = ..., ranks_seen: _Optional[_Iterable[int]] = ..., ranks_missing: _Optional[_Iterable[int]] = ..., ranks_unreadable: _Optional[_Iterable[int]] = ..., groups: _Optional[_Iterable[_Union[GroupState, _Mapping]]] = ..., problems: _Optional[_Iterable[_Union[DumpProblem, _Mapping]]] = ..., notes: _Optional[_Iterable[str]] = ..., rank_identity: _Optional[_Mapping[int, str]] = ...) -> None: ...

class Culprit(_message.Message):
    __slots__ = ("rank", "node", "gpu_index", "gpu_uuid", "gpu_inferred", "line", "gpu_findings", "gpu_health", "host", "pid", "local_rank")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_INFERRED_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    GPU_FINDINGS_FIELD_NUMBER: _ClassVar[int]
    GPU_HEALTH_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    gpu_index: int
    gpu_uuid: str
    gpu_inferred: bool
    line: str
    gpu_findings: _containers.RepeatedCompositeFieldContainer[Finding]
    gpu_health: str
    host: str
    pid: int
    local_rank: int
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., gpu_index: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., gpu_inferred: _Optional[bool] = ..., line: _Optional[str] = ..., gpu_findings: _Optional[_Iterable[_Union[Finding, _Mapping]]] = ..., gpu_health: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., local_rank: _Optional[int] = ...) -> None: ...

class TriageEvidence(_message.Message):
    __slots__ = ("dir", "fr_dumps", "stacks_ranks", "fr_missing_ranks", "errors", "collect_seconds", "agents_asked")
    class FrDumpsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DIR_FIELD_NUMBER: _ClassVar[int]
    FR_DUMPS_FIELD_NUMBER: _ClassVar[int]
    STACKS_RANKS_FIELD_NUMBER: _ClassVar[int]
    FR_MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    COLLECT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AGENTS_ASKED_FIELD_NUMBER: _ClassVar[int]
    dir: str
    fr_dumps: _containers.ScalarMap[int, str]
    stacks_ranks: _containers.RepeatedScalarFieldContainer[int]
    fr_missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    errors: _containers.ScalarMap[str, str]
    collect_seconds: float
    agents_asked: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, dir: _Optional[str] = ..., fr_dumps: _Optional[_Mapping[int, str]] = ..., stacks_ranks: _Optional[_Iterable[int]] = ..., fr_missing_ranks: _Optional[_Iterable[int]] = ..., errors: _Optional[_Mapping[str, str]] = ..., collect_seconds: _Optional[float] = ..., agents_asked: _Optional[_Iterable[str]] = ...) -> None: ...

class HangCheck(_message.Message):
    __slots__ = ("stalled_s", "threshold_s", "typical_step_s", "last_step")
    STALLED_S_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_S_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_STEP_S_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    stalled_s: float
    threshold_s: float
    typical_step_s: float
    last_step: int
    def __init__(self, stalled_s: _Optional[float] = ..., threshold_s: _Optional[float] = ..., typical_step_s: _Optional[float] = ..., last_step: _Optional[int] = ...) -> None: ...

class TriageReply(_message.Message):
    __slots__ = ("report", "job_id", "reason", "summary", "culprits", "culprit_details", "evidence", "hang", "created_at", "error", "stacks_json")
    class StacksJsonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    REPORT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    CULPRITS_FIELD_NUMBER: _ClassVar[int]
    CULPRIT_DETAILS_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    HANG_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STACKS_JSON_FIELD_NUMBER: _ClassVar[int]
    report: TriageReport
    job_id: str
    reason: str
    summary: str
    culprits: _containers.RepeatedScalarFieldContainer[int]
    culprit_details: _containers.RepeatedCompositeFieldContainer[Culprit]
    evidence: TriageEvidence
    hang: HangCheck
    created_at: float
    error: str
    stacks_json: _containers.ScalarMap[int, str]
    def __init__(self, report: _Optional[_Union[TriageReport, _Mapping]] = ..., job_id: _Optional[str] = ..., reason: _Optional[str] = ..., summary: _Optional[str] = ..., culprits: _Optional[_Iterable[int]] = ..., culprit_details: _Optional[_Iterable[_Union[Culprit, _Mapping]]] = ..., evidence: _Optional[_Union[TriageEvidence, _Mapping]] = ..., hang: _Optional[_Union[HangCheck, _Mapping]] = ..., created_at: _Optional[float] = ..., error: _Optional[str] = ..., stacks_json: _Optional[_Mapping[int, str]] = ...) -> None: ...
