"""The OpenAI-compatible HTTP server: a request becomes prompt ids and SamplingParams, enters the AsyncEngine,
and its StepOutputs come back as one response or as one SSE chunk per engine step."""
from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from specserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from specserve.engine.llm_engine import RequestError
from specserve.engine.sequence import Sequence
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import (
    APIError, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
    CompletionResponse, DetokenizeRequest, DetokenizeResponse, GenerationRequest, ModelCard, ModelList,
    SamplingDefaults, TokenizeRequest, TokenizeResponse,
)
from specserve.server.streaming import MakeChunk, error_json, last_output, sse_events, unless_disconnected
from specserve.tokenizer import flatten_content

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's and vLLM's default for /v1/completions


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    served_model_names: list[str]
    api_key: str | None
    metrics: ServerMetrics
    sampling_defaults: SamplingDefaults

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_len(self) -> int:
        """Tokens one sequence may reach: the context length, or the whole KV cache when that is smaller."""
        return min(self.engine.engine.max_model_len, self.engine.engine.max_num_tokens)

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.served_model_names:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"{', '.join(self.served_model_names)}", param="model")
        return self.served_model_names[0]

    def chat_prompt_ids(self, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        try:
            messages = [{**m.model_dump(exclude_none=True), "content": flatten_content(m.content)}
                        for m in body.messages]
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                        **(body.chat_template_kwargs or {}))
        except Exception as e:              # template errors (raise_exception, bad parts) are the request's
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
        return self.tokenizer.encode(prompt, add_special_tokens=False)


def error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(error_json(e), status_code=e.status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", None
    if not loc:
        return f"the request body must be a JSON object: {err['msg']}", None
    param = ".".join(loc)
    got = f" (got {err['input']!r})" if "input" in err and err.get("type") != "missing" else ""
    return f"{param}: {err['msg']}{got}", param


def build_app(engine: AsyncEngine, served_model_name: str | list[str], api_key: str | None = None) -> FastAPI:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    state = ServerState(engine, names, api_key, ServerMetrics(names[0], engine),
                        SamplingDefaults.from_model_dir(engine.engine.config.model))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="specserve", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError):
        return error_response(APIError(400, *validation_message(e)))

    @app.exception_handler(404)
    async def on_not_found(request: Request, e):
        return error_response(APIError(404, f"no route {request.method} {request.url.path}"))

    @app.exception_handler(405)
    async def on_method_not_allowed(request: Request, e):
        return error_response(APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                                       type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {e!r}"))

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "a valid API key is required: send `Authorization: Bearer <key>`",
                           type="authentication_error")

    open_routes = APIRouter()
    routes = APIRouter(dependencies=[Depends(check_api_key)])

    @open_routes.get("/health")
    async def health():
        if engine.dead is not None:
            raise APIError(503, str(engine.dead))
        return Response(status_code=200)

    @open_routes.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @routes.get("/v1/models")
    async def models():
        root = str(engine.engine.config.model)
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=engine.engine.max_model_len)
                               for name in names])

    @routes.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of `prompt` and `messages`", param="prompt")
        if body.messages is not None:
            ids = state.chat_prompt_ids(body)
        else:
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=engine.engine.max_model_len, tokens=ids)

    @routes.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        vocab = engine.engine.model_config.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise APIError(400, f"token ids out of the vocabulary (size {vocab}): {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))

    async def generate(request: Request, body: GenerationRequest, prompt_ids: list[int], request_id: str,
                       default_max_tokens: int | None, make_chunk: MakeChunk,
                       make_response: Callable[[Sequence], BaseModel]) -> Response:
        body.check_supported()
        params = body.to_sampling_params(state.sampling_defaults, len(prompt_ids), state.max_len, default_max_tokens)
        try:
            stream = await unless_disconnected(request, engine.add_request(prompt_ids, params, request_id))
        except RequestError as e:
            raise APIError(400, str(e)) from e
        except (EngineOverloadedError, EngineDeadError) as e:
            raise APIError(503, str(e)) from e
        if body.stream:
            # the background close() covers a client gone before the body iterator ever ran
            return StreamingResponse(sse_events(stream, make_chunk, body.include_usage),
                                     media_type="text/event-stream", background=BackgroundTask(stream.close))
        try:
            seq = (await unless_disconnected(request, last_output(stream))).seq
        except EngineDeadError as e:
            raise APIError(500, str(e)) from e
        elapsed = time.perf_counter() - seq.arrival_time
        rate = seq.num_output_tokens / elapsed if elapsed > 0 else 0.0
        return JSONResponse(make_response(seq).model_dump(), headers={"x-tokens-per-second": f"{rate:.2f}"})

    @routes.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model, request_id = state.check_model(body.model), f"chatcmpl-{uuid.uuid4().hex}"
        return await generate(request, body, state.chat_prompt_ids(body), request_id, None,
                              partial(ChatCompletionChunk.of, request_id, model),
                              partial(ChatCompletionResponse.of, request_id, model))

    @routes.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        model, request_id = state.check_model(body.model), f"cmpl-{uuid.uuid4().hex}"
        prompt = body.single_prompt()
        prompt_ids = state.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return await generate(request, body, prompt_ids, request_id, COMPLETIONS_DEFAULT_MAX_TOKENS,
                              partial(CompletionResponse.chunk, request_id, model),
                              partial(CompletionResponse.of, request_id, model))

    app.include_router(open_routes)
    app.include_router(routes)
    return app


def run_server(args: argparse.Namespace) -> None:
    """Build the engine from resolved `serve` arguments and serve until Ctrl-C."""
    import uvicorn

    from specserve.engine.llm_engine import LLMEngine
    from specserve.sampling_params import SamplingParams
    from specserve.cli_args import engine_config_from_args

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    try:
        config = engine_config_from_args(args)
        engine = LLMEngine(config)
        engine.resolve(SamplingParams())    # the server-wide speculative defaults must be servable
    except (ValueError, OSError) as e:
        print(f"specserve serve: cannot start: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    names = args.served_model_name or [str(args.model) if args.model is not None else "specserve-demo"]
    logger.info("serving %s as %s on http://%s:%d (speculative method: %s%s)", config.model, ", ".join(names),
                args.host, args.port, engine.spec_method,
                f", {engine.spec_defaults.num_assistant_tokens} draft tokens" if engine.spec_method != "none" else "")
    app = build_app(AsyncEngine(engine, args.max_queue_len), names, args.api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
