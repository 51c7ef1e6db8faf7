"""Request and response models of the OpenAI-compatible server (pydantic).

Requests take OpenAI's fields, vLLM's extras and ``deterministic``. Models are strict: a wrong
JSON type is a 400 naming the field (no silent coercion of ``"1"`` to ``1``), NaN and infinity
are rejected, and an unknown field is rejected rather than ignored (it could be one that would
change the output, which a deterministic request must never silently lose). A few OpenAI/vLLM
fields the engine cannot honour are accepted only at their neutral value (``best_of`` equal to
``n``, ...) and rejected otherwise, naming the field.

Constraints (``response_format``, vLLM's ``structured_outputs`` and ``guided_*``) and tools have
their shapes here; ``structured`` and ``tools`` turn them into engine parameters.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Token ids are u32 in the engine; the vocabulary bound is checked against the model.
TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]
ReasoningEffort = Literal["minimal", "low", "medium", "high"]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# --------------------------------------------------------------------------- constraints

# OpenAI's rule for function and json_schema names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class JsonSchemaFormat(OpenAIBaseModel):
    """``response_format.json_schema``."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` extra (``detspec.StructuredOutputsParams``): one of the
    fields."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(default=None, description="served model name (optional)")
    n: int = Field(default=1, ge=1, le=256)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # A slow (Python) tokenizer's option; the fast tokenizers detspec runs (as vLLM's
    # default ones) put no spaces between special tokens either way.
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = Field(default=None, ge=0)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = Field(
        default=False, description="logprob tokens as 'token_id:N' (distinct even when texts clash)"
    )
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        description="prefix-cache pages are shared only among requests with the same salt "
        "(multi-tenant isolation); outputs do not change",
    )
    # detspec
    deterministic: bool | None = Field(
        default=None,
        description="bitwise-reproducible output (decode-verify-rollback); needs `seed` "
        "when temperature > 0 (unless the server sets a default seed). Unset: the server's "
        "default (false unless it runs with --deterministic-by-default)",
    )
    # OpenAI: token id (as a string) -> bias in [-100, 100] added to the logit (checked in
    # ``structured.logit_bias``, so that every error names ``logit_bias``).
    logit_bias: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's constraint extras (the current one, then the older guided_* fields)
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    # vLLM's: keep only the prompt's last N tokens (-1: the model's context length).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    # vLLM's: the response's id is built on it (``chatcmpl-<request_id>``).
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    # Accepted only at its neutral value: the engine cannot honour anything else.
    best_of: int | None = Field(default=None, ge=1, le=256)
    priority: Literal[0] = Field(
        default=0, description="vLLM's; only 0 (no priority scheduling here)"
    )
    use_beam_search: Literal[False] = False
    length_penalty: float = Field(default=1.0, ge=1.0, le=1.0)
    # OpenAI fields that do not change the output (bookkeeping and routing on OpenAI's side):
    # accepted and ignored, as vLLM does.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # 0 only with echo=true: score the prompt without generating (vLLM's convention).
    max_tokens: int | None = Field(default=16, ge=0, le=2**31 - 1)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = Field(
        default=False,
        description="return the prompt before the completion; with `logprobs`, the prompt "
        "tokens' logprobs too (the first one null)",
    )
    suffix: str | None = None
    # vLLM's: whether a text prompt's encoding adds the tokenizer's special tokens (a BOS);
    # false for text already rendered with them (a chat template applied by the client).
    add_special_tokens: bool = True


class ChatContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An earlier answer's reasoning, sent back (vLLM's current name and its older one,
    # SGLang's); the chat template reads it as ``reasoning_content``.
    reasoning: str | None = None
    reasoning_content: str | None = None
    # What the openai client's message objects carry when an answer is sent back as history:
    # accepted where they hold nothing (this server never refuses, cites, speaks or makes
    # legacy function calls).
    refusal: None = None
    annotations: list[Any] | None = Field(default=None, max_length=0)
    audio: None = None
    function_call: None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    """``tool_choice`` naming one function: the output is its arguments."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    # vLLM's: the model continues the last message (needs add_generation_prompt=false)
    continue_final_message: bool = False
    # vLLM's: an answer to a conversation that ends with an assistant message begins with
    # that message's content (with continue_final_message: the whole message, not only its end)
    echo: bool = False
    # vLLM's: the tokenizer's special tokens (a BOS) added on top of the rendered template,
    # which usually writes its own
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: a Jinja chat template for this request (needs --trust-request-chat-template)
    chat_template: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # With --reasoning-parser: return the reasoning (vLLM), split it off at all (SGLang).
    include_reasoning: bool = True
    separate_reasoning: bool = True
    # OpenAI's; as vLLM, it reaches the chat template as `reasoning_effort` (templates that
    # read it set how long the model thinks; the others ignore it).
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: retrieval documents for the chat template (``documents``, as transformers'
    # ``apply_chat_template(documents=...)``; templates without RAG support ignore them).
    documents: list[dict[str, str]] | None = None
    modalities: list[Literal["text"]] | None = None


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


# --------------------------------------------------------------------------- responses
# Responses are built as plain dicts (floats go out exactly as the engine produced them);
# these models document their shape in the OpenAPI schema.


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's: prompt tokens read from the prefix cache instead of computed.
    prompt_tokens_details: PromptTokensDetails | None = None
    # OpenAI's: completion tokens inside thinking blocks (with --reasoning-parser).
    completion_tokens_details: CompletionTokensDetails | None = None


class DvrMetrics(BaseModel):
    """detspec extension, per choice: the decode-verify-rollback work behind it (for ``n > 1``
    the counts are those of the engine request the choice belongs to, shared by its siblings)."""

    deterministic: bool
    num_verify_passes: int
    num_rollbacks: int
    num_rolled_back_tokens: int
    # rows of its verify windows that carried no token (W less the window's rows, each pass)
    num_padded_rows: int
    num_preemptions: int


class _Choice(BaseModel):
    """What every choice has, streamed or not."""

    index: int
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    dvr_metrics: DvrMetrics | None = None


class CompletionChoice(_Choice):
    """A completion's choice; streamed, ``text`` is what is new (the prompt fields ride on
    a choice's first chunk)."""

    text: str
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class ChatChoice(_Choice):
    message: dict[str, Any]


class ChatStreamChoice(_Choice):
    delta: dict[str, Any]


class _Response(BaseModel):
    """What every response body and stream chunk has."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    usage: UsageInfo | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionChunk(CompletionResponse):
    """One SSE event of a streamed completion."""


class _ChatPrompt(_Response):
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class ChatCompletionResponse(_ChatPrompt):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_ChatPrompt):
    """One SSE event of a streamed chat completion (the prompt fields on the first)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    # A LoRA adapter's base model (vLLM's field); None for the base model itself.
    parent: str | None = None
    max_model_len: int
    # The engine's determinism fingerprint: replicas that report the same one return the
    # same bits for a deterministic request (detspec.ray.check_replicas compares them).
    fingerprint: str
    # --deterministic-by-default: requests that do not say `deterministic` are; sampled ones
    # without a seed get `default_seed`.
    deterministic_by_default: bool = False
    default_seed: int | None = None
    weight_version: int = 0


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
    fingerprint: str


class ModelInfoResponse(BaseModel):
    """SGLang's ``/get_model_info`` (its field names), with the served names, the context
    length and the fingerprint."""

    model_path: str
    tokenizer_path: str | None
    is_generation: bool = True
    preferred_sampling_params: str | None = None
    weight_version: str
    has_image_understanding: bool = False
    has_audio_understanding: bool = False
    model_type: str | None = None
    architectures: list[str] | None = None
    served_model_name: str
    served_model_names: list[str]
    max_model_len: int
    fingerprint: str


class ServerInfoResponse(BaseModel):
    """SGLang's ``/get_server_info``: the settings a client may see (never the API key), under
    SGLang's names where it has the setting, then detspec's own."""

    model_path: str
    tokenizer_path: str | None
    served_model_name: str
    served_model_names: list[str]
    context_length: int
    max_model_len: int
    vocab_size: int
    dtype: str | None
    kv_cache_dtype: str | None
    # --max-num-seqs; --max-waiting-requests (waiting sequences, None: no limit).
    max_running_requests: int
    max_queued_requests: int | None
    max_request_bytes: int
    enable_lora: bool
    lora_paths: dict[str, str]
    tool_call_parser: str | None
    enable_auto_tool_choice: bool
    reasoning_parser: str | None
    # The engine's mode (dvr, batch_invariant, off); SGLang's enable_deterministic_inference
    # (every request batch-invariant) is detspec's --deterministic-by-default.
    determinism: str
    enable_deterministic_inference: bool
    deterministic_by_default: bool
    default_seed: int
    fingerprint: str
    weight_version: str
    num_weight_updates: int
    is_paused: bool
    version: str
