"""Turning a RequestStream into an HTTP answer: SSE frames, and aborting when the client goes away."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from specserve.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from specserve.engine.llm_engine import StepOutput
from specserve.server.errors import APIError
from specserve.sampling_params import SamplingParams
from specserve.server.responses import Usage

T = TypeVar("T")

# (step output or None for the closing usage chunk, usage) -> chunk
MakeChunk = Callable[[StepOutput | None, Usage | None], BaseModel]


def sse(data: BaseModel | dict | str) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump_json()
    elif isinstance(data, dict):
        data = json.dumps(data)
    return f"data: {data}\n\n"


def choice_sampling_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice: choice i is seeded seed + i (vLLM's rule; unseeded ones each get their own)."""
    out = [params]
    for i in range(1, n):
        copy = dataclasses.replace(params, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                                   draft_options=dict(params.draft_options), logit_bias=dict(params.logit_bias))
        if params.seed is not None:
            copy.seed = params.seed + i
        out.append(copy)
    return out


async def sse_events(streams: list[RequestStream], make_chunk: MakeChunk, include_usage: bool,
                     opening: BaseModel | None = None) -> AsyncIterator[str]:
    """The opening frame (a chat stream's role, per choice), one frame per engine step and choice (all the
    tokens a verify step accepted), the usage frame if asked, [DONE]; an error frame (OpenAI's error JSON) if a
    choice fails."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
            await queue.put((index, None))
        except BaseException as e:       # delivered to the reader, which stops everything
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    last: dict[int, StepOutput] = {}
    try:
        if opening is not None:
            for i in range(len(streams)):
                yield sse(with_index(opening, i))
        done = 0
        while done < len(streams):
            index, item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                last[index] = item
                yield sse(with_index(make_chunk(item, None), index))
        if include_usage and last:
            yield sse(make_chunk(None, Usage.from_seqs([last[i].seq for i in sorted(last)])))
    except (EngineDeadError, RequestFailedError) as e:
        yield sse(APIError(500, str(e)).body())
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()              # aborts the requests when the client disconnected mid-stream
    yield sse("[DONE]")


def with_index(chunk: BaseModel, index: int) -> BaseModel:
    for choice in chunk.choices:
        choice.index = index
    return chunk


async def last_outputs(streams: list[RequestStream]) -> list[StepOutput]:
    """Every stream's last output (the requests run together in the engine)."""
    async def last(stream: RequestStream) -> StepOutput:
        try:
            out = None
            async for out in stream:
                pass
            return out
        finally:
            stream.close()
    return list(await asyncio.gather(*(last(s) for s in streams)))


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await work; cancel it (which aborts its engine request) if the client disconnects first.
    Only for requests whose body has been read, so that receive() can only report the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise APIError(499, "the client disconnected")
    return task.result()
