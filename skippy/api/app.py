"""The OpenAI-compatible HTTP API on stage 0: app factory, routes, error mapping.

    GET  /v1/models                model list (one model)
    POST /v1/chat/completions      chat, streaming (SSE) or not
    POST /v1/completions           text completion, streaming (SSE) or not
    POST /v1/responses             OpenAI's Responses API over the chat path (responses.py)
    GET  /v1/responses/{id}        a kept response
    GET  /v1/stages                each stage: id, layer range, endpoint, state, sessions, restarts
    GET  /health                   liveness: the process answers
    GET  /readyz                   readiness: every stage reachable (503 names the one that is not)
    GET  /metrics                  Prometheus
    GET  /                         the live chain page (page.py); GET /v1/chain: what it polls

Every error leaves as the OpenAI envelope, through errors.to_api_error (in HttpEdge).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hmac
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException

from ..driver.backend import GenerationBackend
from ..model.tokenizer import Tokenizer
from .admission import Admission
from .cache_metrics import PrefixCacheCollector
from .stage_metrics import StageMetricsCollector
from .completion import complete, prepare_chat, prepare_text, stream
from .errors import ApiError, to_api_error
from .generation import ServeContext, finish, start_generation
from .metrics import Metrics
from .page import add_chain_page
from .responses import ResponseRun, ResponsesRequest, ResponseStore, events, respond_once
from .schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, StageInfo, StageList

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_DRAINED_BODY_BYTES = 64 * 1024 * 1024  # past this, an oversized body is not read to answer 413 politely


@dataclass(frozen=True, slots=True)
class ApiSettings:
    model_id: str  # what /v1/models lists first and the ready line names
    aliases: tuple[str, ...] = ()  # other names a request's `model` may use (--served-model-name)
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API; () = none
    concurrency: int | None = None  # generation lanes; default: the backend's
    queue_size: int | None = None  # default: clamp(8 x lanes, 16, 256)
    admission_timeout_s: float = 60.0  # 0 = wait until the client gives up
    backend_timeout_s: float = 600.0  # longest silence from the backend; 0 = none
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    auth_token: str | None = None  # when set, /v1/* needs `Authorization: Bearer <token>`


class EventStreamResponse(StreamingResponse):
    """An SSE response that always closes its generator, so its lane and session are freed
    promptly however the response ends (starlette may otherwise leave that to the GC)."""

    def __init__(self, content, headers=None):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def create_app(backend: GenerationBackend, tokenizer: Tokenizer, settings: ApiSettings) -> FastAPI:
    concurrency = settings.concurrency or backend.num_lanes
    if concurrency > backend.num_lanes:
        raise ValueError(f"Expected --concurrency <= the backend's {backend.num_lanes} lanes, got {concurrency}")
    metrics = Metrics()
    admission = Admission(concurrency, settings.queue_size, settings.admission_timeout_s)
    metrics.queue_depth.set_function(lambda: admission.num_waiting)
    metrics.active_generations.set_function(lambda: admission.num_active)
    metrics.registry.register(PrefixCacheCollector(backend.cache_stats))  # per stage
    stage_metrics = StageMetricsCollector()  # every stage's own series, from its status answer
    metrics.registry.register(stage_metrics)
    ctx = ServeContext(backend, tokenizer, (settings.model_id, *settings.aliases), admission, metrics,
                       settings.backend_timeout_s)
    created = int(time.time())

    app = FastAPI(title="skippy", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.add_middleware(HttpEdge, settings=settings, metrics=metrics)
    if settings.allowed_origins:  # outside HttpEdge: a preflight needs no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])

    async def error_response(request: Request, exc: Exception) -> JSONResponse:
        error = to_api_error(exc)
        return JSONResponse(error.envelope(), status_code=error.status, headers=error.headers)

    # starlette's own 404/405 as envelopes; every other failure propagates to HttpEdge, which
    # answers it (a handler for Exception would run in starlette's outermost middleware, which
    # re-raises after answering and so drops the connection)
    app.add_exception_handler(HTTPException, error_response)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        readiness = await backend.ready()
        if not readiness.is_ready:
            message = f"Stage {readiness.failed_stage} is not ready: {readiness.detail}"
            raise ApiError(503, message, code="stage_unavailable")
        return {"status": "ready"}

    @app.get("/metrics")
    async def prometheus():
        statuses = await backend.status()
        stage_metrics.latest = [(s.stage_id, s.metrics) for s in statuses if s.metrics is not None]
        for stage in statuses:
            metrics.stage_sessions.labels(stage.stage_id).set(stage.active_sessions)
            metrics.stage_up.labels(stage.stage_id).set(stage.state == "ready")
            metrics.stage_restarts.labels(stage.stage_id).set(stage.restarts)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models():
        num_stages = len(await backend.status())
        return ModelList(data=[_model_card(ctx, name, created, num_stages) for name in ctx.model_names])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id not in ctx.model_names:
            raise ApiError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")
        return _model_card(ctx, model_id, created, len(await backend.status()))

    @app.get("/v1/stages")
    async def stages():
        statuses = await backend.status()
        advise = getattr(backend, "split_advice", None)
        advice = None if advise is None else await advise(statuses)
        infos = []
        for status in statuses:  # raw series are /metrics' business
            fields = dataclasses.asdict(dataclasses.replace(status, metrics=None, probe=None))
            del fields["metrics"], fields["probe"]
            measured = {} if status.probe is None else status.probe.figures()
            infos.append(StageInfo(id=fields.pop("stage_id"), measured=measured, **fields))
        return StageList(data=infos, split_advice=advice)

    def completion_route(schema, prepare):
        async def generate(request: Request):
            received_at = time.perf_counter()
            body = schema.model_validate_json(await request.body())
            return await _respond(ctx, await prepare(ctx, body, request.state.request_id, received_at), request)

        return generate

    app.post("/v1/chat/completions")(completion_route(ChatCompletionRequest, prepare_chat))
    app.post("/v1/completions")(completion_route(CompletionRequest, prepare_text))
    add_chain_page(app, ctx)

    kept = ResponseStore()

    @app.post("/v1/responses")
    async def responses(request: Request):
        received_at = time.perf_counter()
        body = ResponsesRequest.model_validate_json(await request.body())
        conversation = body.conversation(kept)
        job = await prepare_chat(ctx, body.to_chat(conversation), request.state.request_id, received_at)
        run = ResponseRun(body, job, conversation, kept, lambda text: len(tokenizer.encode(text, False)))
        return await _respond(ctx, job, request, lambda _, generation: respond_once(run, generation),
                              lambda _, generation, lease: _then_finish(events(run, generation), generation, lease))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        found = kept.get(response_id)
        if found is None:
            raise ApiError(404, f"Response with id {response_id!r} not found", param="response_id",
                           code="response_not_found")
        return found["response"]

    return app


async def _respond(ctx: ServeContext, job, request: Request, complete=complete, stream=stream) -> Response:
    """Run `job`: `stream`'s SSE bytes, or `complete`'s object as JSON (a pydantic model or a dict)."""
    generation, lease = await start_generation(ctx, job)
    if job.is_stream:
        return EventStreamResponse(stream(job, generation, lease))
    try:
        work = asyncio.ensure_future(complete(job, generation))
        hang_up = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({work, hang_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hang_up.cancel()
        if not work.done():  # nobody is left to answer: stop generating (finish stops every stage)
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        result = work.result()
        return JSONResponse(result if isinstance(result, dict) else result.model_dump(mode="json"))
    finally:
        await finish(generation, lease)


async def _then_finish(events, generation, lease):
    """`events`, then the generation's session and lane freed however the stream ends."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    finally:
        await finish(generation, lease)


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned; never sent


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the body is already read, so the next ASGI
    message can only be the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _model_card(ctx: ServeContext, name: str, created: int, num_stages: int) -> ModelCard:
    return ModelCard(id=name, created=created, context_length=ctx.backend.ctx_size, num_stages=num_stages)


class HttpEdge:
    """Pure ASGI middleware (streams pass through untouched): request id, auth, body limit, request
    metrics, and the error envelope of whatever a route raises, on a connection that stays open."""

    def __init__(self, app, settings: ApiSettings, metrics: Metrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        request_id = _request_id(headers.get("x-request-id"))
        scope.setdefault("state", {})["request_id"] = request_id
        status, started = 500, False

        async def send_with_id(message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                MutableHeaders(scope=message).append("x-request-id", request_id)
            await send(message)

        try:
            error = self._refusal(scope, headers)
            if error is None:
                try:
                    return await self.app(scope, self._limited(receive), send_with_id)
                except Exception as exc:
                    if started:  # a response is under way: nothing else can be sent
                        raise
                    error = to_api_error(exc)  # an unknown one is logged with its traceback
            else:
                await _drain(receive, int(headers.get("content-length") or 0))
            response = JSONResponse(error.envelope(), status_code=error.status, headers=error.headers)
            await response(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status)).inc()

    def _refusal(self, scope, headers: Headers) -> ApiError | None:
        token, path = self.settings.auth_token, scope["path"]
        if token and (path.startswith("/v1/") or path == "/"):
            if not hmac.compare_digest(_credential(headers.get("authorization", "")), token.encode()):
                # a browser opening the page gets a Basic challenge: any user name, the token as password
                challenge = {"WWW-Authenticate": 'Basic realm="skippy"'} if path == "/" else None
                return ApiError(401, "Missing or wrong API key: send Authorization: Bearer <token>",
                                code="invalid_api_key", headers=challenge)  # fmt: skip
        length = headers.get("content-length")
        if length and length.isdigit() and int(length) > self.settings.max_body_bytes:
            return _too_large(self.settings.max_body_bytes)
        return None

    def _limited(self, receive):
        limit, num_bytes = self.settings.max_body_bytes, 0

        async def receive_limited():
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > limit:
                    raise _too_large(limit)
            return message

        return receive_limited


def _credential(authorization: str) -> bytes:
    """The token a request carries: `Bearer <token>` (API clients), or the password of
    `Basic base64(user:token)` (a browser on the chain page, which resends it to /v1/chain)."""
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return b""
    return value.strip().encode()


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is over the limit of {limit} bytes", code="request_too_large")


async def _drain(receive, content_length: int) -> None:
    """Read and drop a refused body, so the client sees our answer rather than a reset connection."""
    if content_length > MAX_DRAINED_BODY_BYTES:
        return
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _request_id(given: str | None) -> str:
    """The client's x-request-id when it is a UUID (spec §8), else a fresh one."""
    if given:
        try:
            return str(uuid.UUID(given))
        except ValueError:
            pass
    return str(uuid.uuid4())
