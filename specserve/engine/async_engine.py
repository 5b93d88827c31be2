"""LLMEngine behind asyncio: one engine thread steps every in-flight request (continuous batching).

The engine is not thread-safe, so only the engine thread touches it. Event-loop code hands it
new requests and aborts through a command queue, read between steps; the thread sleeps on an
Event while there is nothing to do. Outputs travel back through one asyncio.Queue per request.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from specserve.config import GenerationConfig
from specserve.distributed.group import WorkerLostError
from specserve.engine.llm_engine import LLMEngine, StepOutput
from specserve.runtime.sequence import SeqSnapshot
from specserve.engine.request_stream import (  # noqa: F401 (re-exported)
    AbortRequest, AddRequest, EngineDeadError, EngineLoad, EngineOverloadedError, EngineUnavailableError,
    RequestFailedError, RequestStream, Shutdown,
)
from specserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue_len: int = 256):
        self.engine = engine
        self.max_num_in_flight = engine.config.max_num_seqs + max_queue_len
        self.num_in_flight = 0                      # admitted and not yet left the engine
        self.load = EngineLoad()
        self.dead: EngineDeadError | None = None
        # run in the engine thread when an error stops it (not on shutdown): the server exits non-zero then
        self.on_crash: Callable[[], None] | None = None
        self.finish_listeners: list[Callable[[SeqSnapshot], None]] = []   # run in the engine thread
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue[AddRequest | AbortRequest | Shutdown] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}                  # engine thread only
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)

    # ---- what the server reads of the engine: fixed once it is built, so safe from any thread ------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_path(self):
        return self.engine.config.model

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def generation_config(self) -> GenerationConfig:
        return self.engine.generation_config

    @property
    def max_len(self) -> int:
        """Tokens one sequence may reach: the context length, or the whole KV cache when that is smaller."""
        return min(self.engine.max_model_len, self.engine.max_num_tokens)

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    # ---- event-loop side ----------------------------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; unfinished requests end with EngineDeadError."""
        if self._thread.is_alive():
            self._commands.put(Shutdown())
            self._wake.set()
            self._thread.join(timeout)

    def add_finish_listener(self, listener: Callable[[SeqSnapshot], None]) -> None:
        """listener(snapshot) runs in the engine thread when a request leaves the engine (finished or aborted),
        before its last output reaches the caller."""
        self.finish_listeners.append(listener)

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                          after: str | None = None) -> RequestStream:
        """Admit a request (after: another request whose computed prompt it reuses, see LLMEngine.add_request);
        raises EngineOverloadedError, EngineDeadError, or the engine's RequestError."""
        if self.dead is not None:
            raise self.dead
        with self._lock:
            if self.num_in_flight >= self.max_num_in_flight:
                raise EngineOverloadedError(
                    f"the server is at capacity ({self.num_in_flight} requests running or queued; "
                    f"max_num_seqs {self.engine.config.max_num_seqs} plus a queue of "
                    f"{self.max_num_in_flight - self.engine.config.max_num_seqs}); retry later")
            self.num_in_flight += 1
        stream = RequestStream(self, request_id)
        self._commands.put(AddRequest(list(prompt_token_ids), params, stream, after))
        self._wake.set()
        if self.dead is not None:            # the thread stopped after our first check: nobody reads the queue
            stream.admit(self.dead)
        try:
            await stream.admitted
        except asyncio.CancelledError:
            stream.close()
            raise
        return stream

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[StepOutput]:
        """One StepOutput per engine step that produced tokens; cancelling the iteration aborts the request."""
        stream = await self.add_request(prompt_token_ids, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))
        self._wake.set()

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()           # cleared before reading commands, so no wake-up is lost
                if not self._process_commands():
                    break
                self._publish_load()
                if not self.engine.has_unfinished():
                    self._wake.wait()
                    continue
                for out in self.engine.step():
                    self._dispatch(out)
            self._fail_all(EngineDeadError("the server is shutting down"))
        except BaseException as e:          # a step's own failure is isolated in LLMEngine.step; this is not
            logger.exception("the engine thread failed; the engine is stopped")
            self._fail_all(EngineUnavailableError(str(e)) if isinstance(e, WorkerLostError) else
                           EngineDeadError(f"the engine stopped after an internal error: {e!r}"))
            if self.on_crash is not None:
                self.on_crash()

    def _process_commands(self) -> bool:
        """Apply queued adds and aborts; False once asked to shut down."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if isinstance(command, Shutdown):
                return False
            if isinstance(command, AbortRequest):
                self._abort(command.request_id)
                continue
            stream = command.stream
            try:
                seq = self.engine.add_request(command.prompt_token_ids, command.params, stream.request_id,
                                              command.after)
            except Exception as e:           # RequestError and anything else: the caller's error, not ours
                self._release()
                stream.admit(e)
                continue
            self._streams[stream.request_id] = stream
            if not stream.admit(seq.snapshot()):
                self._abort(stream.request_id)

    def _abort(self, request_id: str) -> None:
        seq = self.engine.requests.get(request_id)
        self.engine.abort(request_id)
        if seq is not None and seq.is_finished:
            self._left_engine(seq.snapshot())

    def _dispatch(self, out: StepOutput) -> None:
        stream = self._streams.get(out.request_id)
        if out.finished:
            self._left_engine(out.seq)
        if stream is not None and not stream.put(out) and not out.finished:
            self._abort(out.request_id)

    def _left_engine(self, seq: SeqSnapshot) -> None:
        self._streams.pop(seq.request_id, None)
        self._release()
        for listener in self.finish_listeners:
            try:
                listener(seq)
            except Exception:
                logger.exception("finish listener failed")

    def _release(self) -> None:
        with self._lock:
            self.num_in_flight -= 1

    def _publish_load(self) -> None:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        gauges = self.engine.draft_gauges
        self.load = EngineLoad(len(scheduler.running), len(scheduler.waiting),
                               1.0 - blocks.num_free_blocks / blocks.num_blocks, gauges.mean_draft_length,
                               gauges.drafting_fraction)

    def _fail_all(self, error: EngineDeadError) -> None:
        self.dead = error
        try:
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id)
        except Exception:                   # the engine may be inconsistent after a failed step
            logger.exception("could not abort the engine's requests")
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        while True:                         # requests that arrived after the last step
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, AddRequest):
                command.stream.admit(error)
        self._publish_load()
