from batchline.protocol import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QueueEntry(_message.Message):
    __slots__ = ("request_id", "gateway_id", "model_version", "rows", "deadline_us", "enqueued_us", "priority", "traceparent", "tracestate", "length", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_US_FIELD_NUMBER: _ClassVar[int]
    ENQUEUED_US_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    gateway_id: str
    model_version: str
    rows: int
    deadline_us: int
    enqueued_us: int
    priority: int
    traceparent: str
    tracestate: str
    length: int
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., gateway_id: _Optional[str] = ..., model_version: _Optional[str] = ..., rows: _Optional[int] = ..., deadline_us: _Optional[int] = ..., enqueued_us: _Optional[int] = ..., priority: _Optional[int] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ..., length: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("batch_id", "model_name", "model_version", "members", "executor_id", "dispatched_us", "reason", "attempt", "traceparent")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_US_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    model_name: str
    model_version: str
    members: _containers.RepeatedCompositeFieldContainer[QueueEntry]
    executor_id: str
    dispatched_us: int
    reason: str
    attempt: int
    traceparent: str
    def __init__(self, batch_id: _Optional[str] = ..., model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., members: _Optional[_Iterable[_Union[QueueEntry, _Mapping]]] = ..., executor_id: _Optional[str] = ..., dispatched_us: _Optional[int] = ..., reason: _Optional[str] = ..., attempt: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("request_id", "code", "message", "response", "ran_until_us", "partial", "index", "region_unreadable")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RAN_UNTIL_US_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REGION_UNREADABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    response: _inference_pb2.ModelInferResponse
    ran_until_us: int
    partial: bool
    index: int
    region_unreadable: bool
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., response: _Optional[_Union[_inference_pb2.ModelInferResponse, _Mapping]] = ..., ran_until_us: _Optional[int] = ..., partial: _Optional[bool] = ..., index: _Optional[int] = ..., region_unreadable: _Optional[bool] = ...) -> None: ...

class ExecutionReport(_message.Message):
    __slots__ = ("executor_id", "batch_id", "model_name", "model_version", "rows", "requests", "compute_input_ns", "compute_infer_ns", "compute_output_ns", "failed", "warmup", "ran_until_us", "units")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INPUT_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INFER_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_OUTPUT_NS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    RAN_UNTIL_US_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    batch_id: str
    model_name: str
    model_version: str
    rows: int
    requests: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int
    failed: int
    warmup: bool
    ran_until_us: int
    units: int
    def __init__(self, executor_id: _Optional[str] = ..., batch_id: _Optional[str] = ..., model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., rows: _Optional[int] = ..., requests: _Optional[int] = ..., compute_input_ns: _Optional[int] = ..., compute_infer_ns: _Optional[int] = ..., compute_output_ns: _Optional[int] = ..., failed: _Optional[int] = ..., warmup: _Optional[bool] = ..., ran_until_us: _Optional[int] = ..., units: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "datatype", "shape", "format", "label_filename", "labels")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FILENAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    format: str
    label_filename: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., format: _Optional[str] = ..., label_filename: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "version", "platform", "max_batch_size", "max_queue_delay_ms", "default_timeout_ms", "default_priority", "priority_levels", "preferred_batch_sizes", "inputs", "outputs", "providers", "padded_inputs", "max_queue_size", "unloading", "text", "sequence", "decoupled", "generation", "generation_slots", "generation_running", "generation_waiting", "prefill_token_s", "decode_step_s", "ttft_ms", "tpot_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_LEVELS_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    PADDED_INPUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    UNLOADING_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DECOUPLED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_SLOTS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_RUNNING_FIELD_NUMBER: _ClassVar[int]
    GENERATION_WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    platform: str
    max_batch_size: int
    max_queue_delay_ms: float
    default_timeout_ms: float
    default_priority: int
    priority_levels: int
    preferred_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    providers: _containers.RepeatedScalarFieldContainer[str]
    padded_inputs: _containers.RepeatedScalarFieldContainer[str]
    max_queue_size: int
    unloading: bool
    text: TextInput
    sequence: SequenceBatching
    decoupled: bool
    generation: bool
    generation_slots: int
    generation_running: int
    generation_waiting: int
    prefill_token_s: float
    decode_step_s: float
    ttft_ms: float
    tpot_ms: float
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., platform: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., max_queue_delay_ms: _Optional[float] = ..., default_timeout_ms: _Optional[float] = ..., default_priority: _Optional[int] = ..., priority_levels: _Optional[int] = ..., preferred_batch_sizes: _Optional[_Iterable[int]] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., providers: _Optional[_Iterable[str]] = ..., padded_inputs: _Optional[_Iterable[str]] = ..., max_queue_size: _Optional[int] = ..., unloading: _Optional[bool] = ..., text: _Optional[_Union[TextInput, _Mapping]] = ..., sequence: _Optional[_Union[SequenceBatching, _Mapping]] = ..., decoupled: _Optional[bool] = ..., generation: _Optional[bool] = ..., generation_slots: _Optional[int] = ..., generation_running: _Optional[int] = ..., generation_waiting: _Optional[int] = ..., prefill_token_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ...) -> None: ...

class SequenceBatching(_message.Message):
    __slots__ = ("controls", "states", "max_idle_us", "strategy")
    class Control(_message.Message):
        __slots__ = ("name", "kind", "datatype")
        NAME_FIELD_NUMBER: _ClassVar[int]
        KIND_FIELD_NUMBER: _ClassVar[int]
        DATATYPE_FIELD_NUMBER: _ClassVar[int]
        name: str
        kind: str
        datatype: str
        def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., datatype: _Optional[str] = ...) -> None: ...
    class State(_message.Message):
        __slots__ = ("input", "output", "datatype", "shape")
        INPUT_FIELD_NUMBER: _ClassVar[int]
        OUTPUT_FIELD_NUMBER: _ClassVar[int]
        DATATYPE_FIELD_NUMBER: _ClassVar[int]
        SHAPE_FIELD_NUMBER: _ClassVar[int]
        input: str
        output: str
        datatype: str
        shape: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, input: _Optional[str] = ..., output: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...
    CONTROLS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    MAX_IDLE_US_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    controls: _containers.RepeatedCompositeFieldContainer[SequenceBatching.Control]
    states: _containers.RepeatedCompositeFieldContainer[SequenceBatching.State]
    max_idle_us: int
    strategy: str
    def __init__(self, controls: _Optional[_Iterable[_Union[SequenceBatching.Control, _Mapping]]] = ..., states: _Optional[_Iterable[_Union[SequenceBatching.State, _Mapping]]] = ..., max_idle_us: _Optional[int] = ..., strategy: _Optional[str] = ...) -> None: ...

class SequenceState(_message.Message):
    __slots__ = ("request_id", "before", "after", "ended", "steps", "earlier")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EARLIER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    before: _containers.RepeatedScalarFieldContainer[bytes]
    after: _containers.RepeatedScalarFieldContainer[bytes]
    ended: bool
    steps: int
    earlier: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., before: _Optional[_Iterable[bytes]] = ..., after: _Optional[_Iterable[bytes]] = ..., ended: _Optional[bool] = ..., steps: _Optional[int] = ..., earlier: _Optional[_Iterable[str]] = ...) -> None: ...

class TextInput(_message.Message):
    __slots__ = ("name", "max_length", "truncate", "ids_input", "mask_input", "type_ids_input", "tokenizer_sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    IDS_INPUT_FIELD_NUMBER: _ClassVar[int]
    MASK_INPUT_FIELD_NUMBER: _ClassVar[int]
    TYPE_IDS_INPUT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_length: int
    truncate: bool
    ids_input: str
    mask_input: str
    type_ids_input: str
    tokenizer_sha256: str
    def __init__(self, name: _Optional[str] = ..., max_length: _Optional[int] = ..., truncate: _Optional[bool] = ..., ids_input: _Optional[str] = ..., mask_input: _Optional[str] = ..., type_ids_input: _Optional[str] = ..., tokenizer_sha256: _Optional[str] = ...) -> None: ...

class ModelOverride(_message.Message):
    __slots__ = ("seq", "config_json", "files")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    config_json: str
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, seq: _Optional[int] = ..., config_json: _Optional[str] = ..., files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class RepositoryEntry(_message.Message):
    __slots__ = ("name", "version", "state", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    state: str
    reason: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ExecutorInfo(_message.Message):
    __slots__ = ("executor_id", "address", "models", "started_us", "heartbeat_us", "busy_batches", "executed_batches", "draining", "busy_share", "repository", "model_control_mode", "control_applied", "start_s", "host")
    class ControlAppliedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    STARTED_US_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_US_FIELD_NUMBER: _ClassVar[int]
    BUSY_BATCHES_FIELD_NUMBER: _ClassVar[int]
    EXECUTED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BUSY_SHARE_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONTROL_MODE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_APPLIED_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    address: str
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    started_us: int
    heartbeat_us: int
    busy_batches: int
    executed_batches: int
    draining: bool
    busy_share: float
    repository: _containers.RepeatedCompositeFieldContainer[RepositoryEntry]
    model_control_mode: str
    control_applied: _containers.ScalarMap[str, int]
    start_s: float
    host: str
    def __init__(self, executor_id: _Optional[str] = ..., address: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., started_us: _Optional[int] = ..., heartbeat_us: _Optional[int] = ..., busy_batches: _Optional[int] = ..., executed_batches: _Optional[int] = ..., draining: _Optional[bool] = ..., busy_share: _Optional[float] = ..., repository: _Optional[_Iterable[_Union[RepositoryEntry, _Mapping]]] = ..., model_control_mode: _Optional[str] = ..., control_applied: _Optional[_Mapping[str, int]] = ..., start_s: _Optional[float] = ..., host: _Optional[str] = ...) -> None: ...

class QueueTail(_message.Message):
    __slots__ = ("free_s", "level", "items")
    class Item(_message.Message):
        __slots__ = ("rows", "length", "deadline_s", "priority")
        ROWS_FIELD_NUMBER: _ClassVar[int]
        LENGTH_FIELD_NUMBER: _ClassVar[int]
        DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
        PRIORITY_FIELD_NUMBER: _ClassVar[int]
        rows: int
        length: int
        deadline_s: float
        priority: int
        def __init__(self, rows: _Optional[int] = ..., length: _Optional[int] = ..., deadline_s: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...
    FREE_S_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    free_s: _containers.RepeatedScalarFieldContainer[float]
    level: int
    items: _containers.RepeatedCompositeFieldContainer[QueueTail.Item]
    def __init__(self, free_s: _Optional[_Iterable[float]] = ..., level: _Optional[int] = ..., items: _Optional[_Iterable[_Union[QueueTail.Item, _Mapping]]] = ...) -> None: ...

class ModelLoad(_message.Message):
    __slots__ = ("cost_per_unit_s", "cost_fixed_s", "cost_margin_s", "overhead_s", "executors", "backlog_s", "queued_rows", "policy", "updated_us", "tails", "seen_us", "margin_by_size_s", "over_share_rows", "length_aware", "even_lanes")
    class SeenUsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COST_PER_UNIT_S_FIELD_NUMBER: _ClassVar[int]
    COST_FIXED_S_FIELD_NUMBER: _ClassVar[int]
    COST_MARGIN_S_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_ROWS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    UPDATED_US_FIELD_NUMBER: _ClassVar[int]
    TAILS_FIELD_NUMBER: _ClassVar[int]
    SEEN_US_FIELD_NUMBER: _ClassVar[int]
    MARGIN_BY_SIZE_S_FIELD_NUMBER: _ClassVar[int]
    OVER_SHARE_ROWS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_AWARE_FIELD_NUMBER: _ClassVar[int]
    EVEN_LANES_FIELD_NUMBER: _ClassVar[int]
    cost_per_unit_s: float
    cost_fixed_s: float
    cost_margin_s: float
    overhead_s: float
    executors: int
    backlog_s: float
    queued_rows: _containers.RepeatedScalarFieldContainer[int]
    policy: str
    updated_us: int
    tails: _containers.RepeatedCompositeFieldContainer[QueueTail]
    seen_us: _containers.ScalarMap[str, int]
    margin_by_size_s: _containers.RepeatedScalarFieldContainer[float]
    over_share_rows: int
    length_aware: bool
    even_lanes: bool
    def __init__(self, cost_per_unit_s: _Optional[float] = ..., cost_fixed_s: _Optional[float] = ..., cost_margin_s: _Optional[float] = ..., overhead_s: _Optional[float] = ..., executors: _Optional[int] = ..., backlog_s: _Optional[float] = ..., queued_rows: _Optional[_Iterable[int]] = ..., policy: _Optional[str] = ..., updated_us: _Optional[int] = ..., tails: _Optional[_Iterable[_Union[QueueTail, _Mapping]]] = ..., seen_us: _Optional[_Mapping[str, int]] = ..., margin_by_size_s: _Optional[_Iterable[float]] = ..., over_share_rows: _Optional[int] = ..., length_aware: _Optional[bool] = ..., even_lanes: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStatus(_message.Message):
    __slots__ = ("scheduler_id", "queues", "executors", "dispatched_batches", "dispatched_requests", "shed_requests", "leader", "redispatched_requests")
    class ModelQueue(_message.Message):
        __slots__ = ("model_name", "depth")
        MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
        DEPTH_FIELD_NUMBER: _ClassVar[int]
        model_name: str
        depth: int
        def __init__(self, model_name: _Optional[str] = ..., depth: _Optional[int] = ...) -> None: ...
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    REDISPATCHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    queues: _containers.RepeatedCompositeFieldContainer[SchedulerStatus.ModelQueue]
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorInfo]
    dispatched_batches: int
    dispatched_requests: int
    shed_requests: int
    leader: bool
    redispatched_requests: int
    def __init__(self, scheduler_id: _Optional[str] = ..., queues: _Optional[_Iterable[_Union[SchedulerStatus.ModelQueue, _Mapping]]] = ..., executors: _Optional[_Iterable[_Union[ExecutorInfo, _Mapping]]] = ..., dispatched_batches: _Optional[int] = ..., dispatched_requests: _Optional[int] = ..., shed_requests: _Optional[int] = ..., leader: _Optional[bool] = ..., redispatched_requests: _Optional[int] = ...) -> None: ...

class MeshDemand(_message.Message):
    __slots__ = ("executors_wanted", "horizon_s", "executor_start_s", "models", "updated_us", "scheduler_id")
    class Model(_message.Message):
        __slots__ = ("name", "version", "arrival_rate", "forecast_rate", "capacity", "budget_s", "backlog", "by_forecast", "by_backlog", "queued_rate")
        NAME_FIELD_NUMBER: _ClassVar[int]
        VERSION_FIELD_NUMBER: _ClassVar[int]
        ARRIVAL_RATE_FIELD_NUMBER: _ClassVar[int]
        FORECAST_RATE_FIELD_NUMBER: _ClassVar[int]
        CAPACITY_FIELD_NUMBER: _ClassVar[int]
        BUDGET_S_FIELD_NUMBER: _ClassVar[int]
        BACKLOG_FIELD_NUMBER: _ClassVar[int]
        BY_FORECAST_FIELD_NUMBER: _ClassVar[int]
        BY_BACKLOG_FIELD_NUMBER: _ClassVar[int]
        QUEUED_RATE_FIELD_NUMBER: _ClassVar[int]
        name: str
        version: str
        arrival_rate: float
        forecast_rate: float
        capacity: float
        budget_s: float
        backlog: int
        by_forecast: float
        by_backlog: float
        queued_rate: float
        def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., arrival_rate: _Optional[float] = ..., forecast_rate: _Optional[float] = ..., capacity: _Optional[float] = ..., budget_s: _Optional[float] = ..., backlog: _Optional[int] = ..., by_forecast: _Optional[float] = ..., by_backlog: _Optional[float] = ..., queued_rate: _Optional[float] = ...) -> None: ...
    EXECUTORS_WANTED_FIELD_NUMBER: _ClassVar[int]
    HORIZON_S_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_START_S_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_US_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    executors_wanted: int
    horizon_s: float
    executor_start_s: float
    models: _containers.RepeatedCompositeFieldContainer[MeshDemand.Model]
    updated_us: int
    scheduler_id: str
    def __init__(self, executors_wanted: _Optional[int] = ..., horizon_s: _Optional[float] = ..., executor_start_s: _Optional[float] = ..., models: _Optional[_Iterable[_Union[MeshDemand.Model, _Mapping]]] = ..., updated_us: _Optional[int] = ..., scheduler_id: _Optional[str] = ...) -> None: ...
