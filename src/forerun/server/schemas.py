"""The request bodies the server accepts: OpenAI's fields, strictly typed, and nothing else.

Every OpenAI field is named here, so each one is either honoured or refused with a 400 that names it
(`forerun.server.translate`), and a few of vLLM's that clients send (`top_k`, `min_p`, `repetition_penalty`,
`cache_salt`, `ignore_eos`, `stop_token_ids`); any other field is refused, as OpenAI itself refuses one it does not
define ("unrecognized request argument"). Numbers are strict: `true` is not 1, and `"5"` is not 5.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

Number = StrictInt | StrictFloat
MAX_MESSAGES = 2048


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[dict[str, Any]] | None = None
    """A string, or a list of parts: text parts are joined; image, audio and file parts are refused. Optional in
    the schema as in OpenAI's (an assistant's tool calls come without content), so a tool call is refused by name;
    a message left without content is a 400 naming it."""
    name: StrictStr | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: StrictStr | None = None
    function_call: Any | None = None
    refusal: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    """An assistant's thought, as this server (DeepSeek's and llama.cpp's name) sent it: a client that sends the
    message back as it came keeps it, and a reasoning model's template may show it (Qwen3's does)."""
    reasoning: StrictStr | None = None
    """The same thought under vLLM's name."""


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    n: StrictInt | None = None
    logit_bias: dict[str, Any] | None = None
    user: StrictStr | None = None
    cache_salt: StrictStr | None = None
    """vLLM's: the prompt shares prefix-cache entries only with requests carrying the same salt."""
    ignore_eos: StrictBool | None = None
    """vLLM's: the model's end-of-text tokens do not end the answer (it runs to max_tokens or a stop)."""
    stop_token_ids: list[StrictInt] | None = None
    """vLLM's: tokens that end the answer besides the model's end-of-text ones (the answer keeps the token)."""
    min_tokens: StrictInt | None = None
    """vLLM's: no end-of-text or stop token before this many tokens (transformers' `min_new_tokens`)."""
    response_format: dict[str, Any] | None = None
    """OpenAI's (vLLM takes it for completions too): {"type": "json_object"} or {"type": "json_schema", ...}."""
    forerun: dict[str, Any] | None = None
    """forerun's own: {"method": "auto", knob: value, ...}."""


NON_EMPTY_PROMPT = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {}}]}
"""The prompt's published schema: what `CompletionRequest.non_empty` enforces (a length constraint in the type
itself would make pydantic refuse lone surrogates with its own message, before `translate` names them)."""


class CompletionRequest(CommonRequest):
    prompt: StrictStr | list[Any] = Field(json_schema_extra=NON_EMPTY_PROMPT)

    @field_validator("prompt")
    @classmethod
    def non_empty(cls, prompt: str | list) -> str | list:
        if len(prompt) == 0:
            raise ValueError("prompt is empty")
        return prompt

    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None


class ChatRequest(CommonRequest):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    prediction: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    functions: list[Any] | None = None
    function_call: Any | None = None
    parallel_tool_calls: StrictBool | None = None
    audio: Any | None = None
    modalities: list[StrictStr] | None = None
    reasoning_effort: StrictStr | None = None
    web_search_options: Any | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's, SGLang's and llama.cpp's: variables the chat template reads (Qwen3's `enable_thinking`)."""
    continue_final_message: StrictBool | None = None
    """vLLM's: the last message, an assistant's, is continued (its text the answer's beginning)."""
    add_generation_prompt: StrictBool | None = None
    """vLLM's: false with `continue_final_message` (no new assistant turn); the answer is always the assistant's."""


class ResponsesRequest(BaseModel):
    """OpenAI's Responses API (`/v1/responses`), stateless: every OpenAI field is named, so each is honoured or
    refused by name (`forerun.server.responses_input`); a few of vLLM's besides, as in a chat request."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    input: StrictStr | list[Any] = Field(json_schema_extra=NON_EMPTY_PROMPT)
    """A user's text, or the conversation's items: messages, function calls and their outputs, reasoning."""
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_logprobs: StrictInt | None = None
    include: list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: StrictBool | None = None
    max_tool_calls: StrictInt | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    conversation: Any | None = None
    background: StrictBool | None = None
    prompt: Any | None = None
    truncation: StrictStr | None = None
    service_tier: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    logit_bias: dict[str, Any] | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: StrictInt | None = None
    cache_salt: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    forerun: dict[str, Any] | None = None

    @field_validator("input")
    @classmethod
    def non_empty(cls, given: str | list) -> str | list:
        if len(given) == 0:
            raise ValueError("input is empty")
        return given


class AnthropicRequest(BaseModel):
    """Anthropic's Messages API (`/v1/messages`, as Claude Code and the anthropic SDK send it): every field it
    defines is named, so each is honoured or refused by name (`forerun.server.anthropic_input`)."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    max_tokens: StrictInt
    messages: list[Any] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: StrictStr | list[Any] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    container: Any | None = None
    mcp_servers: Any | None = None
    context_management: Any | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    speed: StrictStr | None = None
    inference_geo: StrictStr | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: StrictStr | None = None
    workspace_id: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    forerun: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    """Anthropic's `/v1/messages/count_tokens`: the tokens a Messages request's prompt holds."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    messages: list[Any] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: StrictStr | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    context_management: Any | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    speed: StrictStr | None = None
    user_profile_id: StrictStr | None = None
    workspace_id: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a text prompt, or chat messages through the chat template (with its tools and
    variables), into the ids the model would read."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: StrictBool = True
    """A text prompt's: the tokenizer's own special tokens (a BOS) added, as a completion's prompt gets them."""
    add_generation_prompt: StrictBool = True
    """Messages': the assistant's turn opened after them, as a chat completion's prompt ends."""
    continue_final_message: StrictBool = False
    """Messages': the last one, an assistant's, left open, as a chat completion that continues it renders it."""
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """vLLM's `/detokenize`: token ids into text."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    tokens: list[StrictInt]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the server sends: OpenAI's shape."""

    error: ErrorBody
