"""OpenAI-compatible request bodies (the responses are in responses.py). The speculative fields sit at the top level of a request,
where the OpenAI SDK's `extra_body` puts them. Unknown fields are accepted and ignored, except those
we cannot honour (see UNSUPPORTED), which get a 400 rather than a silently different answer.

Validation is strict (JSON types as OpenAI documents them), except that an integral float (5.0) is
taken where an integer is expected, as OpenAI and vLLM do."""
from __future__ import annotations

import re
from typing import Annotated, Any, Callable, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from specserve.drafting.factory import all_options
from specserve.drafting.options import NUM_ASSISTANT_TOKENS, spellings
from specserve.engine.logprobs import MAX_TOP_LOGPROBS
from specserve.structured_output import StructuredOutput
from specserve.server.tools import call_grammar, chosen_tools
from specserve.sampling_params import (
    MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, SamplingParams,
)
from specserve.server.errors import APIError
from specserve.server.request_fields import (  # noqa: F401 (re-exported: the server imports them from here)
    LONE_SURROGATE, DraftingFields, Int, NonNegativeInt, OpenAIRequest, PositiveInt, SamplingDefaults, StreamOptions,
    FunctionSpec, JsonSchemaFormat, ResponseFormat, TokenIds, ToolSpec, check_text, integral, integral_ids,
)


MAX_CHOICES = 16                      # n: choices per request


# fields other OpenAI servers take that we cannot honour: name -> the values that are harmless
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "functions": lambda v: not v,
}

class GenerationRequest(DraftingFields):
    """Fields shared by chat and text completions."""
    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Annotated[int, Field(ge=-1), BeforeValidator(integral)] | None = None
    seed: Int | None = None               # any integer: the sampler takes it modulo 2**64
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES), BeforeValidator(integral)] = 1
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, le=10, allow_inf_nan=False)
    min_tokens: Annotated[int, Field(ge=0), BeforeValidator(integral)] | None = None
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    # structured output: OpenAI's response_format, and vLLM's guided_* fields
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        if any(LONE_SURROGATE.search(s) for s in stops):
            raise ValueError("a stop string holds a lone UTF-16 surrogate, which is not valid Unicode")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def check_stop_token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(ids)}")
        return ids

    def check_supported(self) -> None:
        for name, harmless in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if not harmless(value):
                raise APIError(400, f"{name}={value!r} is not supported by this server", param=name)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def structured_output(self) -> StructuredOutput | None:
        given = {name: value for name, value in (
            ("response_format", self.response_format if self.response_format and self.response_format.type != "text"
             else None), ("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
            ("guided_choice", self.guided_choice), ("guided_grammar", self.guided_grammar)) if value is not None}
        if len(given) > 1:
            raise APIError(400, f"give one structured output format, got {', '.join(given)}", param=next(iter(given)))
        if not given:
            return None
        (name, value), = given.items()
        if name == "response_format":
            if value.type == "json_object":
                return StructuredOutput(json_object=True)
            if value.json_schema is None or value.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
            return StructuredOutput(json=value.json_schema.schema_)
        return {"guided_json": lambda: StructuredOutput(json=value), "guided_regex": lambda: StructuredOutput(regex=value),
                "guided_choice": lambda: StructuredOutput(choice=tuple(value)),
                "guided_grammar": lambda: StructuredOutput(grammar=value)}[name]()

    def token_bias(self) -> dict[int, float]:
        """logit_bias keyed by token id (OpenAI sends the ids as JSON object keys: strings)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not re.fullmatch(r"-?[0-9]+", key):
                raise APIError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias")
            bias[int(key)] = value
        return bias

    def draft_options(self) -> dict[str, int]:
        """The drafting options the request sets, but num_assistant_tokens, by their spelling in the request."""
        return {name: value for name in spellings(all_options()) if name != NUM_ASSISTANT_TOKENS.name
                and (value := getattr(self, name)) is not None}

    @property
    def requested_logprobs(self) -> int | None:
        """How many top logprobs per token the request wants (0: only the chosen token's); None: none."""
        return None

    @property
    def requested_prompt_logprobs(self) -> int | None:
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def to_sampling_params(self, defaults: SamplingDefaults, num_prompt_tokens: int, max_len: int,
                           default_max_tokens: int | None) -> SamplingParams:
        """max_len: tokens a sequence may reach (the context, or the KV budget when smaller)."""
        room = max_len - num_prompt_tokens
        max_tokens = self.requested_max_tokens or defaults.max_tokens or default_max_tokens or room
        if num_prompt_tokens + max_tokens > max_len:
            if self.requested_max_tokens is None:
                max_tokens = room             # a default never makes a request fail
            else:
                raise APIError(400, f"this model's maximum context length is {max_len} tokens, but "
                                    f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the "
                                    f"prompt, {max_tokens} in the completion); reduce the prompt or max_tokens",
                               param="max_tokens")
        try:
            return SamplingParams(
                temperature=first_set(self.temperature, defaults.temperature, 1.0),
                top_p=first_set(self.top_p, defaults.top_p, 1.0),
                top_k=first_set(self.top_k, defaults.top_k, 0),
                seed=self.seed,
                max_tokens=max(1, max_tokens),
                stop=[s for s in ([self.stop] if isinstance(self.stop, str) else self.stop or []) if s],
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=self.requested_logprobs,
                prompt_logprobs=self.requested_prompt_logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=first_set(self.repetition_penalty, 1.0),
                min_tokens=self.min_tokens or 0,
                min_p=self.min_p or 0.0,
                logit_bias=self.token_bias(),
                structured=self.structured_output(),
                num_assistant_tokens=self.num_assistant_tokens,
                draft_options=self.draft_options(),
            )
        except ValueError as e:
            raise APIError(400, str(e)) from e


def first_set(*values):
    return next((v for v in values if v is not None), None)


ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(OpenAIRequest):
    """One message, in the shapes OpenAI accepts: content required, except in an assistant message
    that carries tool_calls; a tool message answers a call by its tool_call_id."""
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def check_shape(self) -> ChatMessage:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; a message's role is one of {', '.join(ROLES)}")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs `content` (null only in an assistant message with tool_calls)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the `tool_call_id` of the call it answers")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} ones")
        return self


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: PositiveInt | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(integral)] | None = None

    @model_validator(mode="after")
    def check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tools")
        return self

    def offered_tools(self) -> list[dict]:
        """The tools the model may call (tool_choice applied); [] when none."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        return chosen_tools(tools, self.tool_choice) if tools else []

    def structured_output(self) -> StructuredOutput | None:
        """tool_choice "required" or a named function: the reply is tool calls, by grammar."""
        own = super().structured_output()
        forced = self.tools and self.tool_choice not in (None, "none", "auto")
        if forced and own is not None:
            raise APIError(400, "tool_choice that forces a call cannot be combined with a response format",
                           param="tool_choice")
        return call_grammar(self.offered_tools(), self.parallel_tool_calls) if forced else own

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(integral)] | None = None
    echo: bool = False                    # the prompt leads the text, with its logprobs when logprobs is set
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(integral)] | None = None

    @property
    def requested_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs if self.prompt_logprobs is not None else \
            (self.logprobs if self.echo and self.logprobs is not None else None)

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"this server takes one prompt per request, got {len(prompt)}; "
                                    f"send them as separate (concurrent) requests", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        return prompt


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: TokenIds
