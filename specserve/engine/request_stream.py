"""What passes between the server's event loop and the engine thread: commands in, each request's outputs out
(a RequestStream), the load the engine publishes, and the errors a request can end with."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specserve.engine.llm_engine import StepOutput
from specserve.runtime.sequence import SeqSnapshot
from specserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specserve.engine.async_engine import AsyncEngine


class EngineOverloadedError(RuntimeError):
    """Every running slot and every place in the waiting queue is taken (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped: shut down, or failed outside the isolation of a step."""


class EngineUnavailableError(EngineDeadError):
    """The engine lost a process it runs on (a tensor-parallel worker): HTTP 503, and the server exits."""


class RequestFailedError(RuntimeError):
    """This request's engine step failed (an internal error); the engine serves the others on."""


@dataclass(slots=True)
class EngineLoad:
    """A snapshot the engine thread publishes after every step, for gauges."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    mean_draft_length: float = 0.0        # recent decode steps: draft length chosen per decoding sequence
    drafting_fraction: float = 0.0        # and the fraction of them drafting


@dataclass(slots=True)
class AddRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    after: str | None = None           # a sibling (n > 1) waits for this request's prompt, then shares its blocks


@dataclass(slots=True)
class AbortRequest:
    request_id: str


class Shutdown:
    pass


class RequestStream:
    """One request's outputs, in the order the engine produced them; close() aborts it if unfinished."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.admitted: asyncio.Future[SeqSnapshot] = self.loop.create_future()
        self.outputs: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.closed = False

    # called from the engine thread; False when the caller's event loop is gone (nobody will read)
    def admit(self, result: SeqSnapshot | BaseException) -> bool:
        def settle():
            if self.admitted.done():
                return
            if isinstance(result, BaseException):
                self.admitted.set_exception(result)
            else:
                self.admitted.set_result(result)
        return self._call(settle)

    def put(self, item: StepOutput | BaseException) -> bool:
        return self._call(self.outputs.put_nowait, item)

    def _call(self, fn, *args) -> bool:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:                 # the loop is closed
            return False

    # called from the event loop
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.outputs.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        if item.error is not None:
            raise RequestFailedError(item.error)
        return item

    def close(self) -> None:
        """Idempotent; aborts the request in the engine (freeing its KV blocks) unless it finished."""
        if not self.closed:
            self.closed = True
            if not self.finished:
                self.engine.abort(self.request_id)
