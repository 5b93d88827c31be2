"""OpenAI-compatible response bodies, whole and streamed, each built from a request's snapshot or StepOutput;
`usage` carries this request's speculative-decoding statistics beside OpenAI's counts."""
from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field

from specserve.engine.llm_engine import StepOutput
from specserve.runtime.sequence import SeqSnapshot, SpecStats
from specserve.server.token_text import TokenText
from specserve.server.tools import parse_calls, safe_prefix


class Usage(BaseModel):
    """OpenAI's usage plus this request's speculative-decoding statistics."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = Field(default_factory=list)
    num_target_forwards: int = 0
    mean_acceptance_length: float = 1.0
    draft_lengths: list[int] = Field(default_factory=list)    # per decode step, the draft length chosen

    @classmethod
    def from_seq(cls, seq: SeqSnapshot) -> Usage:
        return cls.from_seqs([seq])

    @classmethod
    def from_seqs(cls, seqs: list[SeqSnapshot]) -> Usage:
        """One request's usage over its choices (n > 1): the prompt once, the completions and statistics summed."""
        spec = SpecStats()
        for seq in seqs:
            spec.merge(seq.spec)
        spec.draft_lengths = [k for seq in seqs for k in seq.spec.draft_lengths]
        n_in, n_out = seqs[0].num_prompt_tokens, sum(seq.num_output_tokens for seq in seqs)
        return cls(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out, **spec.to_dict())


def now() -> int:
    return int(time.time())


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None
    tool_calls: list[dict] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None

    @classmethod
    def of(cls, logprobs, text_of: TokenText) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> dict:
            text, raw = text_of.of(token_id)
            return {"token": text, "logprob": logprob, "bytes": raw}
        return cls(content=[ChatTokenLogprob(**entry(lp.token_id, lp.logprob),
                                             top_logprobs=[TopLogprob(**entry(t, v)) for t, v in lp.top])
                            for lp in logprobs])


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, top_logprobs as {token text: logprob}."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]

    @classmethod
    def of(cls, logprobs, text_of: TokenText, offset: int = 0, echo: SeqSnapshot | None = None) -> CompletionLogprobs:
        """echo: the request's prompt goes first (its first token has no logprob: None, as OpenAI reports it)."""
        first = [] if echo is None else [echo.prompt_token_ids[0]]
        entries = ([] if echo is None else list(echo.prompt_logprobs)) + list(logprobs)
        texts = [text_of.of(t)[0] for t in first] + [text_of.of(lp.token_id)[0] for lp in entries]
        offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        top = [{text_of.of(t)[0]: v for t, v in lp.top} for lp in entries] if any(lp.top for lp in entries) else None
        return cls(tokens=texts, token_logprobs=[None] * len(first) + [lp.logprob for lp in entries],
                   top_logprobs=None if top is None else [None] * len(first) + top, text_offset=offsets)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage

    @classmethod
    def of(cls, request_id: str, model: str, seqs: list[SeqSnapshot], text_of: TokenText | None = None,
           logprobs: bool = False, tools: bool = False) -> ChatCompletionResponse:
        """tools: tools were offered, so <tool_call> blocks in the reply become tool_calls."""
        choices = []
        for i, seq in enumerate(seqs):
            content, calls = parse_calls(seq.output_text) if tools else (seq.output_text, [])
            choices.append(ChatChoice(index=i, message=ChatMessageOut(content=content, tool_calls=calls or None),
                                      finish_reason="tool_calls" if calls else seq.finish_reason,
                                      stop_reason=seq.stop_reason,
                                      logprobs=ChatLogprobs.of(seq.logprobs, text_of) if logprobs else None))
        return cls(id=request_id, model=model, choices=choices, usage=Usage.from_seqs(seqs))


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: dict[str, Any]                 # {"role": "assistant", "content": ""} first, then {"content": ...}
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None

    @classmethod
    def of(cls, request_id: str, model: str, out: StepOutput | None, usage: Usage | None = None,
           text_of: TokenText | None = None, logprobs: bool = False, tools: bool = False):
        """The chunk of one engine step's output, or (out None) the closing usage chunk. With tools offered the
        text of <tool_call> blocks is held back; each block is sent, parsed, as a tool_calls delta once it closes."""
        choices = []
        if out is not None:
            lp = ChatLogprobs.of(out.new_logprobs, text_of) if logprobs else None
            delta, finish = {"content": out.new_text}, finish_fields(out)
            if tools:
                text = out.seq.output_text
                before = text[:len(text) - len(out.new_text)]
                delta = {"content": text[safe_prefix(before):safe_prefix(text)]}
                done, calls = len(parse_calls(before)[1]), parse_calls(text)[1]
                if len(calls) > done:          # each call as soon as its block closes
                    delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls) if i >= done]
                if out.finished and calls:
                    finish["finish_reason"] = "tool_calls"
            choices = [ChatStreamChoice(delta=delta, logprobs=lp, **finish)]
        return cls(id=request_id, model=model, choices=choices, usage=usage)

    @classmethod
    def role(cls, request_id: str, model: str) -> ChatCompletionChunk:
        """The first chunk of a chat stream, before any text, as OpenAI sends it."""
        return cls(id=request_id, model=model, choices=[ChatStreamChoice(delta={"role": "assistant", "content": ""})])


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    """A text completion, and (with object unchanged, as OpenAI does) each streamed chunk of one."""
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None

    @classmethod
    def of(cls, request_id: str, model: str, seqs: list[SeqSnapshot], text_of: TokenText | None = None,
           logprobs: bool = False, echo: str | None = None) -> CompletionResponse:
        """echo: the prompt's text, which then leads each choice's text (and its logprobs)."""
        choices = [CompletionChoice(index=i, text=(echo or "") + seq.output_text, finish_reason=seq.finish_reason,
                                    stop_reason=seq.stop_reason,
                                    logprobs=CompletionLogprobs.of(seq.logprobs, text_of,
                                                                   echo=seq if echo is not None else None)
                                    if logprobs else None)
                   for i, seq in enumerate(seqs)]
        return cls(id=request_id, model=model, choices=choices, usage=Usage.from_seqs(seqs))

    @classmethod
    def chunk(cls, request_id: str, model: str, out: StepOutput | None, usage: Usage | None = None,
              text_of: TokenText | None = None, logprobs: bool = False, echo: str | None = None):
        choices = []
        if out is not None:
            first = out.seq.num_output_tokens == len(out.new_token_ids)     # echo the prompt with the first tokens
            lead = echo if echo is not None and first else ""
            offset = len(out.seq.output_text) - len(out.new_text) + (len(echo) if echo and not first else 0)
            lp = CompletionLogprobs.of(out.new_logprobs, text_of, offset,
                                       echo=out.seq if echo is not None and first else None) if logprobs else None
            choices = [CompletionChoice(text=lead + out.new_text, logprobs=lp, **finish_fields(out))]
        return cls(id=request_id, model=model, choices=choices, usage=usage)


def finish_fields(out: StepOutput) -> dict:
    if not out.finished:
        return {"finish_reason": None, "stop_reason": None}
    return {"finish_reason": out.seq.finish_reason, "stop_reason": out.seq.stop_reason}


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "specserve"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
