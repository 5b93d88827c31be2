"""The pieces request bodies are built from: strict JSON types (an integral float taken for an int, as OpenAI and
vLLM do), text checks, the drafting methods' own fields (generated from their Option declarations) and the
model's generation_config.json defaults."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, create_model

from specserve.config import GenerationConfig
from specserve.drafting.factory import all_options
from specserve.drafting.options import Option, spellings
from specserve.server.errors import APIError


LONE_SURROGATE = re.compile("[\ud800-\udfff]")    # what JSON's "\ud800" escape gives: text with no UTF-8 form


def check_text(text: str, param: str) -> str:
    """Text about to be tokenized; a lone surrogate (which the tokenizer cannot take) is the request's error."""
    if LONE_SURROGATE.search(text):
        raise APIError(400, f"{param} holds a lone UTF-16 surrogate (such as \\ud800), which is not valid Unicode",
                       param=param)
    return text


def integral(value: Any) -> Any:
    """An integral float as the int it names (5.0 -> 5); anything else unchanged, for strict int validation."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integral_ids(values: list[float]) -> list[int]:
    """Token ids sent as floats (1.0), checked and converted in one vectorised pass."""
    a = np.asarray(values, dtype=np.float64)
    if not (np.isfinite(a).all() and (a == np.rint(a)).all() and (np.abs(a) < 2.0 ** 63).all()):
        raise ValueError("token ids must be integers")
    return a.astype(np.int64).tolist()


Int = Annotated[int, BeforeValidator(integral)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(integral)]      # the bound first: it shows in the schema
NonNegativeInt = Annotated[int, Field(ge=0), BeforeValidator(integral)]
# a list of ints validates in pydantic's own code; only a list holding floats takes the second form
TokenIds = list[int] | Annotated[list[float], AfterValidator(integral_ids)]


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


@dataclass(slots=True)
class SamplingDefaults:
    """The model's generation_config.json values for unset request fields (then SamplingParams' own)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None

    @classmethod
    def of(cls, gen: GenerationConfig) -> SamplingDefaults:
        temperature = gen.get("temperature")
        if gen.get("do_sample") is False:    # transformers' meaning: greedy unless the request samples
            temperature = 0.0
        return cls(temperature, gen.get("top_p"), gen.get("top_k"), gen.get("max_new_tokens"))


def option_field(option: Option) -> tuple[Any, None]:
    """A request field checked by the option itself (its kind, bounds and "auto"), so that its error names it."""
    def check(value: Any) -> Any:
        return None if value is None else option.check(integral(value) if option.kind is int else value)

    number = {"type": "number" if option.kind is float else "integer", "minimum": option.minimum}
    if option.maximum is not None:
        number["maximum"] = option.maximum
    schema = {"anyOf": [number, {"const": "auto"}] if option.auto else [number], "description": option.help}
    return Annotated[Any, BeforeValidator(check), WithJsonSchema(schema)], None


# the drafting methods' request fields (drafting/options.py), each spelling its own field; the method validates
# their combination when the engine admits the request
DraftingFields = create_model("DraftingFields", __base__=OpenAIRequest,
                              **{name: option_field(o) for name, o in spellings(all_options()).items()})


class JsonSchemaFormat(OpenAIRequest):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionSpec(OpenAIRequest):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(OpenAIRequest):
    type: Literal["function"]
    function: FunctionSpec
