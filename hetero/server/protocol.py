"""OpenAI request bodies (pydantic), with vLLM's extra sampling fields.

Unknown fields are rejected (400 naming the field) rather than silently ignored: a
misspelt sampling knob should not quietly change nothing. Fields OpenAI or vLLM define
that change nothing here (`store`, `metadata`, `service_tier`, ...) are accepted; fields
that would change the output and are not implemented are listed in `UNSUPPORTED` and get
a 400 saying so. Ranges are checked once, by `SamplingParams`; these models only check
types and shapes.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Content parts a text-only model cannot take (OpenAI's and vLLM's multimodal types).
MEDIA_PART_TYPES = ("image_url", "input_image", "image", "image_pil", "image_embeds", "input_audio",
                    "audio_url", "video_url", "video", "file", "input_file")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class ChatMessage(BaseModel):
    """One conversation turn; extra keys (name, tool_calls, tool_call_id, ...) go to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        if not isinstance(content, list):
            return content
        for part in content:
            kind = part.get("type")
            if kind in MEDIA_PART_TYPES:
                raise ValueError(f"{kind} content parts are not supported: the served model takes text only")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"a content part must be {{'type': 'text', 'text': ...}}, got type {kind!r}")
        return content

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text parts joined, no content as "" (an
        assistant turn that only called tools: templates read its content as a string), and
        earlier tool calls' JSON `arguments` as objects (Qwen2.5's and Llama 3's templates
        serialise them), as vLLM does."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part["text"] for part in self.content)
        message.setdefault("content", "")
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # not JSON: the template gets the text as it came
        return message


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` request field (StructuredOutputsParams)."""

    json_: Union[str, dict[str, Any], None] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = None  # no free whitespace is what this server does anyway
    disable_fallback: Optional[bool] = None
    disable_additional_properties: Optional[bool] = None  # what this server does anyway (`closed_schema`)


class SamplingRequest(_Strict):
    """The fields that become `SamplingParams`, shared by completions and chat."""

    model: Optional[str] = None
    n: int = 1
    best_of: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_repeat_ngram_size: int = 0
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None  # one engine here (llguidance): accepted, unused
    # Accepted and unused: they change nothing about the output (OpenAI's and vLLM's).
    user: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    request_id: Optional[str] = None
    priority: int = 0
    cache_salt: Optional[str] = None
    return_tokens_as_token_ids: Optional[bool] = None

    # Fields OpenAI or vLLM define that would change the output, and are not implemented:
    # a request that sets one (to anything but its neutral value) gets 400 "... is not supported".
    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "allowed_token_ids", "bad_words", "prompt_logprobs", "truncate_prompt_tokens", "use_beam_search",
        "length_penalty", "guided_whitespace_pattern", "structural_tag", "logits_processors", "vllm_xargs",
        "kv_transfer_params", "mm_processor_kwargs", "lora_request", "prediction", "audio", "web_search_options",
        "functions", "function_call", "thinking_token_budget",
    )

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_constraint(self):
        given = [name for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                   "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format.type == "text")]
        if len(given) > 1:
            raise ValueError(f"give at most one output constraint, got {', '.join(given)}")
        return self


PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    add_special_tokens: bool = True
    UNSUPPORTED: ClassVar[tuple[str, ...]] = SamplingRequest.UNSUPPORTED + ("suffix",)

    def prompts(self) -> list[Union[str, dict[str, list[int]]]]:
        """The prompt field as a list of engine prompts (text, or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [{"prompt_token_ids": list(prompt)}]
        return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: Optional[list[ChatTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[str] = None  # no reasoning mode here: accepted, unused
    include_reasoning: Optional[bool] = None
    verbosity: Optional[str] = None
    modalities: Optional[list[str]] = None
    UNSUPPORTED: ClassVar[tuple[str, ...]] = SamplingRequest.UNSUPPORTED + ("echo", "documents")

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not among tools")
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def output_limit(self) -> Optional[int]:
        """max_completion_tokens (OpenAI's current name) wins over the older max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


class TextConfig(_Strict):
    format: Optional[dict[str, Any]] = None
    verbosity: Optional[str] = None  # no verbosity control here: accepted, unused


class ResponsesRequest(_Strict):
    """The fields of OpenAI's response-create body this server reads; the ones that change
    nothing here are accepted (`store`, `metadata`, `reasoning`, ...), unknown ones are a 400."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    text: Optional[TextConfig] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = None
    background: Optional[bool] = None
    include: Optional[list[str]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    reasoning: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
