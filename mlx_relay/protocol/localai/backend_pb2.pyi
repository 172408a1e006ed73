from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HealthMessage(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsResponse(_message.Message):
    __slots__ = ("slot_id", "prompt_json_for_slot", "tokens_per_second", "tokens_generated", "prompt_tokens_processed")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_JSON_FOR_SLOT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    prompt_json_for_slot: str
    tokens_per_second: float
    tokens_generated: int
    prompt_tokens_processed: int
    def __init__(self, slot_id: _Optional[int] = ..., prompt_json_for_slot: _Optional[str] = ..., tokens_per_second: _Optional[float] = ..., tokens_generated: _Optional[int] = ..., prompt_tokens_processed: _Optional[int] = ...) -> None: ...

class PredictOptions(_message.Message):
    __slots__ = ("Prompt", "Seed", "Threads", "Tokens", "TopK", "Repeat", "Batch", "NKeep", "Temperature", "Penalty", "F16KV", "DebugMode", "StopPrompts", "IgnoreEOS", "TailFreeSamplingZ", "TypicalP", "FrequencyPenalty", "PresencePenalty", "Mirostat", "MirostatETA", "MirostatTAU", "PenalizeNL", "LogitBias", "MLock", "MMap", "PromptCacheAll", "PromptCacheRO", "Grammar", "MainGPU", "TensorSplit", "TopP", "PromptCachePath", "Debug", "EmbeddingTokens", "Embeddings", "RopeFreqBase", "RopeFreqScale", "NegativePromptScale", "NegativePrompt", "NDraft", "Images", "UseTokenizerTemplate", "Messages", "Videos", "Audios", "CorrelationId", "Tools", "ToolChoice", "Logprobs", "TopLogprobs", "Metadata", "MinP", "ModelIdentity")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    REPEAT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    NKEEP_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    PENALTY_FIELD_NUMBER: _ClassVar[int]
    F16KV_FIELD_NUMBER: _ClassVar[int]
    DEBUGMODE_FIELD_NUMBER: _ClassVar[int]
    STOPPROMPTS_FIELD_NUMBER: _ClassVar[int]
    IGNOREEOS_FIELD_NUMBER: _ClassVar[int]
    TAILFREESAMPLINGZ_FIELD_NUMBER: _ClassVar[int]
    TYPICALP_FIELD_NUMBER: _ClassVar[int]
    FREQUENCYPENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCEPENALTY_FIELD_NUMBER: _ClassVar[int]
    MIROSTAT_FIELD_NUMBER: _ClassVar[int]
    MIROSTATETA_FIELD_NUMBER: _ClassVar[int]
    MIROSTATTAU_FIELD_NUMBER: _ClassVar[int]
    PENALIZENL_FIELD_NUMBER: _ClassVar[int]
    LOGITBIAS_FIELD_NUMBER: _ClassVar[int]
    MLOCK_FIELD_NUMBER: _ClassVar[int]
    MMAP_FIELD_NUMBER: _ClassVar[int]
    PROMPTCACHEALL_FIELD_NUMBER: _ClassVar[int]
    PROMPTCACHERO_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MAINGPU_FIELD_NUMBER: _ClassVar[int]
    TENSORSPLIT_FIELD_NUMBER: _ClassVar[int]
    TOPP_FIELD_NUMBER: _ClassVar[int]
    PROMPTCACHEPATH_FIELD_NUMBER: _ClassVar[int]
    DEBUG_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGTOKENS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    ROPEFREQBASE_FIELD_NUMBER: _ClassVar[int]
    ROPEFREQSCALE_FIELD_NUMBER: _ClassVar[int]
    NEGATIVEPROMPTSCALE_FIELD_NUMBER: _ClassVar[int]
    NEGATIVEPROMPT_FIELD_NUMBER: _ClassVar[int]
    NDRAFT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    USETOKENIZERTEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    AUDIOS_FIELD_NUMBER: _ClassVar[int]
    CORRELATIONID_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOLCHOICE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPLOGPROBS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    MINP_FIELD_NUMBER: _ClassVar[int]
    MODELIDENTITY_FIELD_NUMBER: _ClassVar[int]
    Prompt: str
    Seed: int
    Threads: int
    Tokens: int
    TopK: int
    Repeat: int
    Batch: int
    NKeep: int
    Temperature: float
    Penalty: float
    F16KV: bool
    DebugMode: bool
    StopPrompts: _containers.RepeatedScalarFieldContainer[str]
    IgnoreEOS: bool
    TailFreeSamplingZ: float
    TypicalP: float
    FrequencyPenalty: float
    PresencePenalty: float
    Mirostat: int
    MirostatETA: float
    MirostatTAU: float
    PenalizeNL: bool
    LogitBias: str
    MLock: bool
    MMap: bool
    PromptCacheAll: bool
    PromptCacheRO: bool
    Grammar: str
    MainGPU: str
    TensorSplit: str
    TopP: float
    PromptCachePath: str
    Debug: bool
    EmbeddingTokens: _containers.RepeatedScalarFieldContainer[int]
    Embeddings: str
    RopeFreqBase: float
    RopeFreqScale: float
    NegativePromptScale: float
    NegativePrompt: str
    NDraft: int
    Images: _containers.RepeatedScalarFieldContainer[str]
    UseTokenizerTemplate: bool
    Messages: _containers.RepeatedCompositeFieldContainer[Message]
    Videos: _containers.RepeatedScalarFieldContainer[str]
    Audios: _containers.RepeatedScalarFieldContainer[str]
    CorrelationId: str
    Tools: str
    ToolChoice: str
    Logprobs: int
    TopLogprobs: int
    Metadata: _containers.ScalarMap[str, str]
    MinP: float
    ModelIdentity: str
    def __init__(self, Prompt: _Optional[str] = ..., Seed: _Optional[int] = ..., Threads: _Optional[int] = ..., Tokens: _Optional[int] = ..., TopK: _Optional[int] = ..., Repeat: _Optional[int] = ..., Batch: _Optional[int] = ..., NKeep: _Optional[int] = ..., Temperature: _Optional[float] = ..., Penalty: _Optional[float] = ..., F16KV: _Optional[bool] = ..., DebugMode: _Optional[bool] = ..., StopPrompts: _Optional[_Iterable[str]] = ..., IgnoreEOS: _Optional[bool] = ..., TailFreeSamplingZ: _Optional[float] = ..., TypicalP: _Optional[float] = ..., FrequencyPenalty: _Optional[float] = ..., PresencePenalty: _Optional[float] = ..., Mirostat: _Optional[int] = ..., MirostatETA: _Optional[float] = ..., MirostatTAU: _Optional[float] = ..., PenalizeNL: _Optional[bool] = ..., LogitBias: _Optional[str] = ..., MLock: _Optional[bool] = ..., MMap: _Optional[bool] = ..., PromptCacheAll: _Optional[bool] = ..., PromptCacheRO: _Optional[bool] = ..., Grammar: _Optional[str] = ..., MainGPU: _Optional[str] = ..., TensorSplit: _Optional[str] = ..., TopP: _Optional[float] = ..., PromptCachePath: _Optional[str] = ..., Debug: _Optional[bool] = ..., EmbeddingTokens: _Optional[_Iterable[int]] = ..., Embeddings: _Optional[str] = ..., RopeFreqBase: _Optional[float] = ..., RopeFreqScale: _Optional[float] = ..., NegativePromptScale: _Optional[float] = ..., NegativePrompt: _Optional[str] = ..., NDraft: _Optional[int] = ..., Images: _Optional[_Iterable[str]] = ..., UseTokenizerTemplate: _Optional[bool] = ..., Messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., Videos: _Optional[_Iterable[str]] = ..., Audios: _Optional[_Iterable[str]] = ..., CorrelationId: _Optional[str] = ..., Tools: _Optional[str] = ..., ToolChoice: _Optional[str] = ..., Logprobs: _Optional[int] = ..., TopLogprobs: _Optional[int] = ..., Metadata: _Optional[_Mapping[str, str]] = ..., MinP: _Optional[float] = ..., ModelIdentity: _Optional[str] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatDelta(_message.Message):
    __slots__ = ("content", "reasoning_content", "tool_calls")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    content: str
    reasoning_content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    def __init__(self, content: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("message", "tokens", "prompt_tokens", "timing_prompt_processing", "timing_token_generation", "audio", "logprobs", "chat_deltas")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_PROMPT_PROCESSING_FIELD_NUMBER: _ClassVar[int]
    TIMING_TOKEN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHAT_DELTAS_FIELD_NUMBER: _ClassVar[int]
    message: bytes
    tokens: int
    prompt_tokens: int
    timing_prompt_processing: float
    timing_token_generation: float
    audio: bytes
    logprobs: bytes
    chat_deltas: _containers.RepeatedCompositeFieldContainer[ChatDelta]
    def __init__(self, message: _Optional[bytes] = ..., tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., timing_prompt_processing: _Optional[float] = ..., timing_token_generation: _Optional[float] = ..., audio: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., chat_deltas: _Optional[_Iterable[_Union[ChatDelta, _Mapping]]] = ...) -> None: ...

class ModelOptions(_message.Message):
    __slots__ = ("Model", "ContextSize", "Seed", "NBatch", "Threads", "ModelFile", "Tokenizer", "LoraBase", "LoraAdapter", "DraftModel", "MMProj", "Type", "ModelPath", "LoraAdapters", "Options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONTEXTSIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NBATCH_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    MODELFILE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    LORABASE_FIELD_NUMBER: _ClassVar[int]
    LORAADAPTER_FIELD_NUMBER: _ClassVar[int]
    DRAFTMODEL_FIELD_NUMBER: _ClassVar[int]
    MMPROJ_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MODELPATH_FIELD_NUMBER: _ClassVar[int]
    LORAADAPTERS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    Model: str
    ContextSize: int
    Seed: int
    NBatch: int
    Threads: int
    ModelFile: str
    Tokenizer: str
    LoraBase: str
    LoraAdapter: str
    DraftModel: str
    MMProj: str
    Type: str
    ModelPath: str
    LoraAdapters: _containers.RepeatedScalarFieldContainer[str]
    Options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, Model: _Optional[str] = ..., ContextSize: _Optional[int] = ..., Seed: _Optional[int] = ..., NBatch: _Optional[int] = ..., Threads: _Optional[int] = ..., ModelFile: _Optional[str] = ..., Tokenizer: _Optional[str] = ..., LoraBase: _Optional[str] = ..., LoraAdapter: _Optional[str] = ..., DraftModel: _Optional[str] = ..., MMProj: _Optional[str] = ..., Type: _Optional[str] = ..., ModelPath: _Optional[str] = ..., LoraAdapters: _Optional[_Iterable[str]] = ..., Options: _Optional[_Iterable[str]] = ...) -> None: ...

class Result(_message.Message):
    __slots__ = ("message", "success")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    message: str
    success: bool
    def __init__(self, message: _Optional[str] = ..., success: _Optional[bool] = ...) -> None: ...

class TokenizationResponse(_message.Message):
    __slots__ = ("length", "tokens")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    length: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, length: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("content",)
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    content: str
    def __init__(self, content: _Optional[str] = ...) -> None: ...

class MemoryUsageData(_message.Message):
    __slots__ = ("total", "breakdown")
    class BreakdownEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    total: int
    breakdown: _containers.ScalarMap[str, int]
    def __init__(self, total: _Optional[int] = ..., breakdown: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("state", "memory")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNINITIALIZED: _ClassVar[StatusResponse.State]
        BUSY: _ClassVar[StatusResponse.State]
        READY: _ClassVar[StatusResponse.State]
        ERROR: _ClassVar[StatusResponse.State]
    UNINITIALIZED: StatusResponse.State
    BUSY: StatusResponse.State
    READY: StatusResponse.State
    ERROR: StatusResponse.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    state: StatusResponse.State
    memory: MemoryUsageData
    def __init__(self, state: _Optional[_Union[StatusResponse.State, str]] = ..., memory: _Optional[_Union[MemoryUsageData, _Mapping]] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id", "reasoning_content", "tool_calls")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_call_id: str
    reasoning_content: str
    tool_calls: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., tool_calls: _Optional[str] = ...) -> None: ...

class ToolFormatMarkers(_message.Message):
    __slots__ = ("format_type", "section_start", "section_end", "reasoning_start", "reasoning_end")
    FORMAT_TYPE_FIELD_NUMBER: _ClassVar[int]
    SECTION_START_FIELD_NUMBER: _ClassVar[int]
    SECTION_END_FIELD_NUMBER: _ClassVar[int]
    REASONING_START_FIELD_NUMBER: _ClassVar[int]
    REASONING_END_FIELD_NUMBER: _ClassVar[int]
    format_type: str
    section_start: str
    section_end: str
    reasoning_start: str
    reasoning_end: str
    def __init__(self, format_type: _Optional[str] = ..., section_start: _Optional[str] = ..., section_end: _Optional[str] = ..., reasoning_start: _Optional[str] = ..., reasoning_end: _Optional[str] = ...) -> None: ...

class ModelMetadataResponse(_message.Message):
    __slots__ = ("supports_thinking", "rendered_template", "tool_format", "media_marker")
    SUPPORTS_THINKING_FIELD_NUMBER: _ClassVar[int]
    RENDERED_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_MARKER_FIELD_NUMBER: _ClassVar[int]
    supports_thinking: bool
    rendered_template: str
    tool_format: ToolFormatMarkers
    media_marker: str
    def __init__(self, supports_thinking: _Optional[bool] = ..., rendered_template: _Optional[str] = ..., tool_format: _Optional[_Union[ToolFormatMarkers, _Mapping]] = ..., media_marker: _Optional[str] = ...) -> None: ...
