"""Turning a RequestStream into an HTTP answer: SSE frames, and aborting when the client goes away."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from specserve.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from specserve.engine.llm_engine import StepOutput
from specserve.server.errors import APIError
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


async def sse_events(stream: RequestStream, make_chunk: MakeChunk, include_usage: bool,
                     opening: BaseModel | None = None) -> AsyncIterator[str]:
    """The opening frame (a chat stream's role), one frame per engine step (all the tokens a verify step
    accepted), the usage frame if asked, [DONE]; an error frame (OpenAI's error JSON) if the request fails."""
    try:
        if opening is not None:
            yield sse(opening)
        last = None
        async for out in stream:
            yield sse(make_chunk(out, None))
            last = out
        if include_usage and last is not None:
            yield sse(make_chunk(None, Usage.from_seq(last.seq)))
    except (EngineDeadError, RequestFailedError) as e:
        yield sse(APIError(500, str(e)).body())
    finally:
        stream.close()                  # aborts the request when the client disconnected mid-stream
    yield sse("[DONE]")


async def last_output(stream: RequestStream) -> StepOutput:
    try:
        last = None
        async for last in stream:
            pass
        return last
    finally:
        stream.close()


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
