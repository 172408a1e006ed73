from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolCallFunction(_message.Message):
    __slots__ = ("name", "arguments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: str
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "type", "function", "index")
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    function: ToolCallFunction
    index: int
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., function: _Optional[_Union[ToolCallFunction, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning", "images", "image_offsets")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    reasoning: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    image_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., reasoning: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., image_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "xtc_probability", "xtc_threshold", "repetition_penalty", "repetition_context_size", "presence_penalty", "frequency_penalty", "logit_bias", "stop", "logprobs", "top_logprobs", "num_draft_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    XTC_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    XTC_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_CONTEXT_SIZE_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    ignore_eos: bool
    xtc_probability: float
    xtc_threshold: float
    repetition_penalty: float
    repetition_context_size: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    top_logprobs: int
    num_draft_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., xtc_probability: _Optional[float] = ..., xtc_threshold: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., repetition_context_size: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "params", "tools_json", "tool_choice", "chat_template_kwargs_json", "request_id", "prompt_bytes", "response_format_json", "grammar", "cache_salt")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_JSON_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    params: SamplingParams
    tools_json: str
    tool_choice: str
    chat_template_kwargs_json: str
    request_id: str
    prompt_bytes: bytes
    response_format_json: str
    grammar: str
    cache_salt: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., tools_json: _Optional[str] = ..., tool_choice: _Optional[str] = ..., chat_template_kwargs_json: _Optional[str] = ..., request_id: _Optional[str] = ..., prompt_bytes: _Optional[bytes] = ..., response_format_json: _Optional[str] = ..., grammar: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token", "token_id", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: str
    token_id: int
    logprob: float
    def __init__(self, token: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "token_id", "logprob", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: str
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "total_tokens", "cached_tokens", "draft_tokens", "accepted_draft_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    total_tokens: int
    cached_tokens: int
    draft_tokens: int
    accepted_draft_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("time_to_first_token_s", "prompt_tokens_per_s", "decode_tokens_per_s", "total_s")
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token_s: float
    prompt_tokens_per_s: float
    decode_tokens_per_s: float
    total_s: float
    def __init__(self, time_to_first_token_s: _Optional[float] = ..., prompt_tokens_per_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "reasoning", "tool_calls", "logprobs", "finish_reason", "usage", "timings", "request_id", "malformed_tool_call", "unknown_tools", "stop_sequence")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MALFORMED_TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_TOOLS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    reasoning: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    usage: Usage
    timings: Timings
    request_id: str
    malformed_tool_call: bool
    unknown_tools: _containers.RepeatedScalarFieldContainer[str]
    stop_sequence: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., reasoning: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_id: _Optional[str] = ..., malformed_tool_call: _Optional[bool] = ..., unknown_tools: _Optional[_Iterable[str]] = ..., stop_sequence: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "reasoning", "tool_calls", "logprobs", "finish_reason", "usage", "timings", "request_id", "malformed_tool_call", "unknown_tools", "stop_sequence")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MALFORMED_TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_TOOLS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    reasoning: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    usage: Usage
    timings: Timings
    request_id: str
    malformed_tool_call: bool
    unknown_tools: _containers.RepeatedScalarFieldContainer[str]
    stop_sequence: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., reasoning: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_id: _Optional[str] = ..., malformed_tool_call: _Optional[bool] = ..., unknown_tools: _Optional[_Iterable[str]] = ..., stop_sequence: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "messages", "tools_json", "chat_template_kwargs_json", "add_generation_prompt", "tool_choice")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    chat_template_kwargs_json: str
    add_generation_prompt: bool
    tool_choice: str
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., chat_template_kwargs_json: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., tool_choice: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "prompt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "host", "pid", "layer_start", "layer_end", "active_memory_bytes", "peak_memory_bytes", "rss_bytes", "state", "last_seen_s", "free_memory_bytes", "staging", "versions")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    pid: int
    layer_start: int
    layer_end: int
    active_memory_bytes: int
    peak_memory_bytes: int
    rss_bytes: int
    state: str
    last_seen_s: float
    free_memory_bytes: int
    staging: RankStaging
    versions: _containers.ScalarMap[str, str]
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., active_memory_bytes: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., state: _Optional[str] = ..., last_seen_s: _Optional[float] = ..., free_memory_bytes: _Optional[int] = ..., staging: _Optional[_Union[RankStaging, _Mapping]] = ..., versions: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RankStaging(_message.Message):
    __slots__ = ("state", "total_bytes", "ready_bytes", "fetched_bytes", "reused_bytes", "source", "cache", "error", "seconds")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    READY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REUSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    state: str
    total_bytes: int
    ready_bytes: int
    fetched_bytes: int
    reused_bytes: int
    source: str
    cache: str
    error: str
    seconds: float
    def __init__(self, state: _Optional[str] = ..., total_bytes: _Optional[int] = ..., ready_bytes: _Optional[int] = ..., fetched_bytes: _Optional[int] = ..., reused_bytes: _Optional[int] = ..., source: _Optional[str] = ..., cache: _Optional[str] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("model", "model_path", "world_size", "num_layers", "ranks", "state", "active_requests", "queued_requests", "backend", "error", "cached_prompts", "cached_prompt_tokens", "requests", "speculation", "layout", "prompt_store", "prompt_cache_tiers", "prompt_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_STORE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_TIERS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_path: str
    world_size: int
    num_layers: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    state: str
    active_requests: int
    queued_requests: int
    backend: str
    error: str
    cached_prompts: int
    cached_prompt_tokens: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestStatus]
    speculation: SpeculationStatus
    layout: LayoutStatus
    prompt_store: PromptStoreStatus
    prompt_cache_tiers: _containers.RepeatedCompositeFieldContainer[PromptCacheTier]
    prompt_tokens: int
    def __init__(self, model: _Optional[str] = ..., model_path: _Optional[str] = ..., world_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., state: _Optional[str] = ..., active_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., backend: _Optional[str] = ..., error: _Optional[str] = ..., cached_prompts: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestStatus, _Mapping]]] = ..., speculation: _Optional[_Union[SpeculationStatus, _Mapping]] = ..., layout: _Optional[_Union[LayoutStatus, _Mapping]] = ..., prompt_store: _Optional[_Union[PromptStoreStatus, _Mapping]] = ..., prompt_cache_tiers: _Optional[_Iterable[_Union[PromptCacheTier, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class PromptCacheTier(_message.Message):
    __slots__ = ("tier", "entries", "tokens", "bytes", "budget_bytes", "hit_tokens", "hit_rate")
    TIER_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    tier: str
    entries: int
    tokens: int
    bytes: int
    budget_bytes: int
    hit_tokens: int
    hit_rate: float
    def __init__(self, tier: _Optional[str] = ..., entries: _Optional[int] = ..., tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., hit_rate: _Optional[float] = ...) -> None: ...

class PromptStoreStatus(_message.Message):
    __slots__ = ("dir", "off_reason", "blocks", "bytes", "budget_bytes", "restores", "restored_tokens", "failed_restores", "stored_blocks")
    DIR_FIELD_NUMBER: _ClassVar[int]
    OFF_REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    RESTORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FAILED_RESTORES_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    dir: str
    off_reason: str
    blocks: int
    bytes: int
    budget_bytes: int
    restores: int
    restored_tokens: int
    failed_restores: int
    stored_blocks: int
    def __init__(self, dir: _Optional[str] = ..., off_reason: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., restores: _Optional[int] = ..., restored_tokens: _Optional[int] = ..., failed_restores: _Optional[int] = ..., stored_blocks: _Optional[int] = ...) -> None: ...

class LayoutStatus(_message.Message):
    __slots__ = ("stages", "tensor_parallel", "tensor_backend", "note", "chosen_at_load", "all_sum_seconds", "layer_seconds", "pipeline_token_seconds", "tensor_token_seconds", "pair_all_sum_seconds", "grid_token_seconds")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    TENSOR_BACKEND_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_AT_LOAD_FIELD_NUMBER: _ClassVar[int]
    ALL_SUM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAIR_ALL_SUM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRID_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    stages: int
    tensor_parallel: int
    tensor_backend: str
    note: str
    chosen_at_load: bool
    all_sum_seconds: float
    layer_seconds: float
    pipeline_token_seconds: float
    tensor_token_seconds: float
    pair_all_sum_seconds: float
    grid_token_seconds: float
    def __init__(self, stages: _Optional[int] = ..., tensor_parallel: _Optional[int] = ..., tensor_backend: _Optional[str] = ..., note: _Optional[str] = ..., chosen_at_load: _Optional[bool] = ..., all_sum_seconds: _Optional[float] = ..., layer_seconds: _Optional[float] = ..., pipeline_token_seconds: _Optional[float] = ..., tensor_token_seconds: _Optional[float] = ..., pair_all_sum_seconds: _Optional[float] = ..., grid_token_seconds: _Optional[float] = ...) -> None: ...

class SpeculationStatus(_message.Message):
    __slots__ = ("source", "num_draft_tokens", "adaptive", "off_reason", "rounds", "draft_tokens", "accepted_draft_tokens", "acceptance_rate", "tokens_per_round")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    OFF_REASON_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    source: str
    num_draft_tokens: int
    adaptive: bool
    off_reason: str
    rounds: int
    draft_tokens: int
    accepted_draft_tokens: int
    acceptance_rate: float
    tokens_per_round: float
    def __init__(self, source: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., adaptive: _Optional[bool] = ..., off_reason: _Optional[str] = ..., rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., tokens_per_round: _Optional[float] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("request_id", "phase", "prompt_tokens", "prefilled_tokens", "cached_tokens", "generated_tokens", "age_s", "time_to_first_token_s", "decode_tokens_per_s", "draft_tokens", "accepted_draft_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    phase: str
    prompt_tokens: int
    prefilled_tokens: int
    cached_tokens: int
    generated_tokens: int
    age_s: float
    time_to_first_token_s: float
    decode_tokens_per_s: float
    draft_tokens: int
    accepted_draft_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., phase: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., age_s: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("model", "layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    layers: str
    def __init__(self, model: _Optional[str] = ..., layers: _Optional[str] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: StatusResponse
    def __init__(self, status: _Optional[_Union[StatusResponse, _Mapping]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("shutdown",)
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    shutdown: bool
    def __init__(self, shutdown: _Optional[bool] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...
