"""The OpenAI-compatible HTTP server: a request becomes prompt ids and SamplingParams, enters the AsyncEngine,
and its StepOutputs come back as one response or as one SSE chunk per engine step."""
from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from specserve.distributed.runner import ParallelTarget
from specserve.distributed.worker import run_torchrun_worker
from specserve.engine.async_engine import (AsyncEngine, EngineDeadError, EngineOverloadedError, EngineUnavailableError,
                                          RequestFailedError, RequestStream)
from specserve.engine.llm_engine import RequestError
from specserve.runtime.sequence import SeqSnapshot
from specserve.server.limits import DEFAULT_MAX_REQUEST_BYTES, LimitRequestBytes
from specserve.server.state import ServerState
from specserve.server.metrics import ServerMetrics
from specserve.server.errors import APIError
from specserve.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerationRequest, SamplingDefaults, TokenizeRequest,
)
from specserve.server.responses import (
    ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, DetokenizeResponse, ModelCard, ModelList,
    TokenizeResponse,
)
from specserve.server.streaming import MakeChunk, choice_sampling_params, last_outputs, sse_events, unless_disconnected
from specserve.server.token_text import TokenText

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's and vLLM's default for /v1/completions


def validation_message(exc: RequestValidationError, content_type: str) -> tuple[str, str | None]:
    """The first error names the parameter; a union's other alternatives follow it."""
    errors = exc.errors()
    err = errors[0]
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", None
    if not loc and "json" not in content_type.lower():      # FastAPI reads only a body declared as JSON
        return f"send the body as JSON, with `Content-Type: application/json` (got {content_type or 'none'!r})", None
    if not loc:
        return f"the request body must be a JSON object: {err['msg']}", None
    param = ".".join(loc)
    got = f" (got {shorten(repr(err['input']))})" if "input" in err and err.get("type") != "missing" else ""
    others = [f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in errors[1:3] if e.get("loc", ())[1:2] == (loc[0],)]
    return f"{param}: {err['msg']}{got}" + "".join(f"; or {o}" for o in others), param


def shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def bearer_token(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; the scheme is case-insensitive (RFC 9110)."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def build_app(engine: AsyncEngine, served_model_name: str | list[str], api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    state = ServerState(engine, names, api_key, ServerMetrics(names[0], engine),
                        SamplingDefaults.of(engine.generation_config), TokenText(engine.tokenizer))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.add_middleware(LimitRequestBytes, max_bytes=max_request_bytes)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError):
        return APIError(400, *validation_message(e, request.headers.get("content-type", ""))).response()

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException):
        """Routing errors (404, 405 with its Allow header) and bodies FastAPI cannot parse (400)."""
        where = f"{request.method} {request.url.path}"
        message = {404: f"no route {where}",
                   405: f"method {request.method} is not allowed on {request.url.path}; allowed: "
                        f"{(e.headers or {}).get('Allow', 'none')}",
                   400: f"cannot parse the request body: {e.detail} (it must be a JSON object in UTF-8)"}
        return APIError(e.status_code, message.get(e.status_code, str(e.detail))).response(e.headers)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {e!r}").response()

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        token = bearer_token(request.headers.get("authorization", ""))
        if token is None or not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "a valid API key is required: send `Authorization: Bearer <key>`",
                           type="authentication_error")

    open_routes = APIRouter()
    routes = APIRouter(dependencies=[Depends(check_api_key)])

    @open_routes.get("/health")
    async def health():
        if engine.dead is not None:
            raise APIError(503, str(engine.dead))
        return {"status": "ok"}

    @open_routes.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @routes.get("/v1/models")
    async def models():
        root = str(engine.model_path)
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=engine.max_model_len)
                               for name in names])

    @routes.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of `prompt` and `messages`", param="prompt")
        if body.messages is not None:
            ids = await asyncio.to_thread(state.chat_prompt_ids, body)
        else:
            ids = await asyncio.to_thread(state.prompt_ids, body.prompt, body.add_special_tokens)
        # a JSONResponse of the dump: FastAPI's own encoding of a returned model walks its 200k ids in Python on
        # the event loop (0.25 s for a 1 MB prompt)
        response = TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)
        return JSONResponse(response.model_dump())

    @routes.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        vocab = engine.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise APIError(400, f"token ids out of the vocabulary (size {vocab}): {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(state.tokenizer.decode, body.tokens))

    async def generate(request: Request, body: GenerationRequest, prompt_ids: list[int], request_id: str,
                       default_max_tokens: int | None, make_chunk: MakeChunk,
                       make_response: Callable[[list[SeqSnapshot]], BaseModel], opening: BaseModel | None = None
                       ) -> Response:
        params = body.to_sampling_params(state.sampling_defaults, len(prompt_ids), state.max_len, default_max_tokens)
        streams: list[RequestStream] = []
        try:   # n > 1: one sequence per choice, seeded seed + i (vLLM's rule), sharing the prompt's KV blocks
            for i, choice_params in enumerate(choice_sampling_params(params, body.n)):
                streams.append(await unless_disconnected(request, engine.add_request(
                    prompt_ids, choice_params, request_id if body.n == 1 else f"{request_id}-{i}",
                    after=streams[0].request_id if streams else None)))
        except (RequestError, EngineOverloadedError, EngineDeadError, APIError) as e:
            for stream in streams:
                stream.close()
            if isinstance(e, APIError):
                raise
            raise APIError(400 if isinstance(e, RequestError) else 503, str(e)) from e
        if body.stream:
            # the background close() covers a client gone before the body iterator ever ran
            return StreamingResponse(sse_events(streams, make_chunk, body.include_usage, opening),
                                     media_type="text/event-stream",
                                     background=BackgroundTask(lambda: [s.close() for s in streams]))
        try:
            seqs = [out.seq for out in await unless_disconnected(request, last_outputs(streams))]
        except EngineUnavailableError as e:
            raise APIError(503, str(e)) from e
        except (EngineDeadError, RequestFailedError) as e:
            raise APIError(500, str(e)) from e
        elapsed = time.perf_counter() - seqs[0].arrival_time
        rate = sum(seq.num_output_tokens for seq in seqs) / elapsed if elapsed > 0 else 0.0
        return JSONResponse(make_response(seqs).model_dump(), headers={"x-tokens-per-second": f"{rate:.2f}"})

    @routes.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model, request_id = state.check_model(body.model), f"chatcmpl-{uuid.uuid4().hex}"
        body.check_supported()
        tools = body.offered_tools()
        prompt_ids = await asyncio.to_thread(state.chat_prompt_ids, body, tools)
        shown = dict(text_of=state.token_text, logprobs=body.logprobs, tools=bool(tools))
        return await generate(request, body, prompt_ids, request_id, None,
                              partial(ChatCompletionChunk.of, request_id, model, **shown),
                              partial(ChatCompletionResponse.of, request_id, model, **shown),
                              ChatCompletionChunk.role(request_id, model))

    @routes.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        model, request_id = state.check_model(body.model), f"cmpl-{uuid.uuid4().hex}"
        body.check_supported()
        prompt = body.single_prompt()
        prompt_ids = await asyncio.to_thread(state.prompt_ids, prompt) if isinstance(prompt, str) else prompt
        echo = None
        if body.echo:
            echo = prompt if isinstance(prompt, str) else await asyncio.to_thread(state.tokenizer.decode, prompt)
        shown = dict(text_of=state.token_text, logprobs=body.logprobs is not None, echo=echo)
        return await generate(request, body, prompt_ids, request_id, COMPLETIONS_DEFAULT_MAX_TOKENS,
                              partial(CompletionResponse.chunk, request_id, model, **shown),
                              partial(CompletionResponse.of, request_id, model, **shown))

    app.include_router(open_routes)
    app.include_router(routes)
    return app


def check_dtype_supported(dtype: str, device: str) -> None:
    """--dtype bfloat16 on a CPU whose oneDNN has no bf16 kernels is refused before anything loads: such a CPU
    either fails in the first packed product or emulates every bf16 product, far slower than float32."""
    import torch

    from specserve.engine.llm_engine import resolve_device
    if dtype != "bfloat16" or resolve_device(device).type != "cpu":
        return
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        raise ValueError("--dtype bfloat16 needs bfloat16 CPU kernels, which this CPU lacks (oneDNN reports no "
                         "bf16 support); use --dtype float32, or auto (which picks float32 here)")


def run_server(args: argparse.Namespace) -> None:
    """Build the engine from resolved `serve` arguments and serve until Ctrl-C. Exits with status 1 when
    the engine thread dies (see AsyncEngine.on_crash), so that a supervisor restarts the server."""
    import uvicorn

    from specserve.engine.llm_engine import LLMEngine
    from specserve.sampling_params import SamplingParams
    from specserve.cli_args import engine_config_from_args

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    try:
        config = engine_config_from_args(args)
        config.reserved_cpu_cores = 1     # uvicorn's event loop and the streams' detokenizing need a core
        check_dtype_supported(config.dtype, config.device)
        if run_torchrun_worker(config):     # torchrun's ranks above 0 serve rank 0's calls; HTTP runs on rank 0 only
            return
        engine = LLMEngine(config)
        engine.resolve(SamplingParams())    # the server-wide speculative defaults must be servable
    except (ValueError, OSError) as e:
        print(f"specserve serve: cannot start: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    names = args.served_model_name or [str(args.model) if args.model is not None else "specserve-demo"]
    logger.info("serving %s as %s on http://%s:%d (speculative method: %s%s)", config.model, ", ".join(names),
                args.host, args.port, engine.spec_method,
                f", {engine.draft_defaults['num_assistant_tokens']} draft tokens" if engine.spec_method != "none" else "")
    async_engine = AsyncEngine(engine, args.max_queue_len)
    app = build_app(async_engine, names, args.api_key, args.max_request_bytes)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    crashed = threading.Event()

    def on_crash() -> None:
        crashed.set()
        server.should_exit = True          # uvicorn's main loop polls it: in-flight requests get their errors first

    async_engine.on_crash = on_crash

    def on_worker_lost(message: str) -> None:    # seen by the monitor while idle: a 503 until the server has exited
        async_engine.dead = EngineUnavailableError(message)
        on_crash()

    if isinstance(engine.model, ParallelTarget):
        engine.model.group.on_lost.append(on_worker_lost)
    try:
        server.run()
    except KeyboardInterrupt:               # uvicorn re-raises Ctrl-C once it has shut down, as uvicorn.run does
        pass
    if crashed.is_set():
        logger.critical("the engine thread died; exiting with status 1 so that a supervisor restarts the server")
        raise SystemExit(1)
