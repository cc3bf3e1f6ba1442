"""The HTTP front door: FastAPI inside a Serve deployment, calling the engine replicas through a handle.

Every request is validated, authenticated and started (first record in hand) before a status line is sent,
so that bad input, a full queue or a missing replica come back as proper HTTP errors and a stream's first
SSE chunk leaves as soon as the first token exists.
"""
# No `from __future__ import annotations` here: FastAPI must see real types in the Serve class-based view.

import asyncio
import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle

from conveyor.router.deadline import timeout_error, with_deadline
from conveyor.router.errors import ApiError, install_handlers
from conveyor.router.formatting import ChatFormat, ChoiceState, CompletionFormat
from conveyor.router.handle_records import make_request
from conveyor.router.parse_pool import DEFAULT_PARSE_TIMEOUT_S, ParsePool, parse_body
from conveyor.router.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, new_id
from conveyor.router.sse_stream import ReplicaStreamingResponse, sse_body
from conveyor.router.streams import StartedStream, read_whole, start_stream

logger = logging.getLogger("ray.serve")  # Serve routes this logger into its replica log files


class IngressSettings(BaseModel):
    model_name: str
    model_aliases: list[str] = []
    api_key: str | None = None
    api_key_file: str | None = None  # read by the ingress at start where api_key is unset (a mounted Secret)
    max_body_bytes: int = 1 << 20
    replica_wait_timeout_s: float = 30.0
    ready_timeout_s: float = 2.0
    # Streamed records from each engine replica come in one message per engine step for all of this ingress's
    # streams there (conveyor/router/mux.py), not one message per token per stream.
    stream_mux: bool = True
    # Parsing and validating a body runs on worker threads, never the event loop; past this it is a 413.
    parse_timeout_s: float = DEFAULT_PARSE_TIMEOUT_S
    request_timeout_s: float | None = None  # queue + generation, from arrival; None: no limit (deadline.py)


# serve.ingress pickles the app and this class when the decorator runs, with the module globals that exist
# at that point: helpers the methods call must live in other modules (imported above), not below the class.
app = FastAPI(title="Conveyor", docs_url=None, redoc_url=None, openapi_url=None)
install_handlers(app)


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI `requestBody` for an endpoint that parses its body itself (so FastAPI cannot infer it).

    The model's `$defs` are inlined: schema-driven clients (schemathesis, codegen) then need no resolver.
    Called only while the routes below are declared, so it may live in this module (see the note above).
    """
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


@serve.deployment(name="Ingress", max_ongoing_requests=1000, num_replicas=1)
@serve.ingress(app)
class Ingress:
    def __init__(self, engine: DeploymentHandle | None, settings: IngressSettings,
                 engine_here: dict[str, Any] | None = None) -> None:
        # engine_here: EngineReplica's arguments, to run its engine in this process instead of behind the handle
        # (local_engine.py: one fixed replica, one Ray worker fewer on every token's path).
        self._local_replica = None
        if engine_here is not None:
            from conveyor.router.local_engine import LocalEngineHandle
            from conveyor.router.replica import EngineReplica

            self._local_replica = EngineReplica.func_or_class(**engine_here)
            engine = LocalEngineHandle(self._local_replica)
        self.engine = engine
        if settings.api_key is None and settings.api_key_file:  # read here: the key is in no Serve config
            from conveyor.router.api_key import read_api_key_file

            settings = settings.model_copy(update={"api_key": read_api_key_file(settings.api_key_file)})
        self.settings = settings
        # Metrics: this process' registry on its own port, plus the fleet's replica-count gauges; the list of
        # every replica's endpoint is served below for Prometheus service discovery.
        from conveyor.router.metrics_registry import FleetGauges, start_replica_endpoint

        self._app_name = serve.get_replica_context().app_name
        # With the engine here, its endpoint serves this process's registry already: a second would count twice.
        self._metrics_endpoint = (start_replica_endpoint("ingress", settings.model_name)
                                  if self._local_replica is None else None)
        self._fleet_gauges = FleetGauges(settings.model_name, self._app_name)
        from conveyor.router.errors import count_rejections_with
        from conveyor.serving.metrics import REQUESTS_CUT, REQUESTS_HANDED_BACK, REQUESTS_REJECTED

        rejected = REQUESTS_REJECTED.labels  # replica label "ingress-<id>": refusals that never reached an engine
        ingress_label = "ingress-" + serve.get_replica_context().replica_id.unique_id
        count_rejections_with(lambda reason: rejected(settings.model_name, ingress_label, reason).inc())
        self._count_cut = REQUESTS_CUT.labels(settings.model_name, ingress_label).inc
        self._count_hand_back = REQUESTS_HANDED_BACK.labels(settings.model_name, ingress_label).inc
        from conveyor.router.demux import Demux

        # In process a record costs no message: nothing to multiplex.
        self._demux = Demux(engine, ingress_label) if settings.stream_mux and self._local_replica is None else None
        self._parser = ParsePool(timeout_s=settings.parse_timeout_s)
        from conveyor.router.serve_headers import ignore_client_overrides

        ignore_client_overrides()  # a client cannot switch off Serve's request timeout or disconnect handling

    async def check_health(self) -> None:
        """Serve's health check: with the engine in this process, a dead or wedged engine fails it (Serve then
        replaces this replica, as it would an engine replica)."""
        if self._local_replica is not None:
            await self._local_replica.check_health()

    def __del__(self) -> None:
        if getattr(self, "_local_replica", None) is not None:
            self._local_replica.close()  # the engine process and its metrics endpoint stop now, not at GC

    # ---- endpoints ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        """Liveness: this ingress answers. Readiness (an engine can serve) is /ready."""
        return Response(status_code=200)

    @app.get("/ready")
    async def ready(self) -> JSONResponse:
        """Readiness: 200 only while an engine replica with its model loaded answers (and is not wedged), so a
        load balancer sends no traffic before the model is up; 503 otherwise."""
        try:
            info = await asyncio.wait_for(self.engine.ready.remote(), self.settings.ready_timeout_s)
        except Exception as exc:  # noqa: BLE001 - no replica yet, all wedged, or gone: not ready, whatever the cause
            reason = "no engine replica answered in time" if isinstance(exc, asyncio.TimeoutError) else str(exc)
            return JSONResponse({"ready": False, "reason": reason[:500]}, status_code=503)
        return JSONResponse({"ready": True, **info})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics/targets")
    async def metrics_targets(self) -> JSONResponse:
        """Prometheus HTTP service discovery: every live replica's metrics endpoint (metrics_registry.py)."""
        from conveyor.router.metrics_registry import live_targets

        return JSONResponse(await asyncio.to_thread(live_targets, self._app_name))  # GCS calls block

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> JSONResponse:
        """The API schema (for schemathesis and client generators); behind the API key when one is set."""
        self._authorize(request)
        return JSONResponse(request.app.openapi())

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse(ModelList(data=[ModelCard(id=self.settings.model_name)]).model_dump())

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        deadline = self._deadline()
        req = await self._parse(request, CompletionRequest)
        model = self._check_model(req.model)
        n = req.n
        # Choice k of prompt j is index j * n + k; its prompt tokens count once in usage, not n times.
        choices = [(ChoiceState(j * n + k, counts_prompt=k == 0),
                    make_request(p, req.to_sampling_params(k), new_id("cmpl"), stream=req.stream,
                                 unset=req.unset_sampling_fields()))
                   for j, p in enumerate(req.prompts()) for k in range(n)]
        fmt = CompletionFormat(new_id("cmpl"), model)
        return await self._serve(choices, fmt, req.stream, req.include_usage, deadline)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        deadline = self._deadline()
        req = await self._parse(request, ChatCompletionRequest)
        model = self._check_model(req.model)
        messages = req.conversation()
        choices = [(ChoiceState(k, counts_prompt=k == 0),
                    make_request(None, req.to_sampling_params(k), new_id("chatcmpl"), messages=messages,
                                 stream=req.stream, unset=req.unset_sampling_fields()))
                   for k in range(req.n)]
        fmt = ChatFormat(new_id("chatcmpl"), model, req.tool_mode,
                         tuple(t.function.name for t in req.tools or ()), req.named_tool)
        return await self._serve(choices, fmt, req.stream, req.include_usage, deadline)

    # ---- request checks ----------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")

    async def _parse(self, request: Request, model: type[BaseModel]) -> Any:
        body = await self._read_body(request)
        # JSON, pydantic, grammar and tool validation: CPU work that must not hold the streams this loop relays.
        return await self._parser.run(parse_body, body, model)

    def _deadline(self) -> float | None:
        timeout_s = self.settings.request_timeout_s
        return None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        too_big = ApiError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():  # a chunked body has no Content-Length: count as it comes
            body += chunk
            if len(body) > limit:
                raise too_big
        return bytes(body)

    def _check_model(self, model: str | None) -> str:
        name = self.settings.model_name
        if model is None or model == name or model in self.settings.model_aliases:
            return name
        raise ApiError(400, f"model {model!r} is not served here; available: {name!r}", param="model",
                       code="model_not_found")

    # ---- generation --------------------------------------------------------------------------------
    async def _serve(self, choices: list[tuple[ChoiceState, dict]], fmt: ChatFormat | CompletionFormat,
                     stream: bool, include_usage: bool, deadline: float | None = None) -> Response:
        """Start every choice (errors still become statuses), then stream SSE or answer with one body; past the
        deadline (request_timeout_s) the engine work is cancelled and the answer is a 408 or an SSE error."""
        timeout_s = self.settings.request_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                started = await self._start_all([request for _, request in choices])
        except TimeoutError:  # still queued (or prefilling): _start_all cancelled what it had started
            raise timeout_error(timeout_s) from None
        fmt.fingerprint = started[0].first.get("replica")
        states = [state for state, _ in choices]
        if stream:
            body = sse_body(started, states, fmt, include_usage, on_cut=self._count_cut)
            body = with_deadline(body, deadline, timeout_s, [s.cancel for s in started])
            return ReplicaStreamingResponse(body, started)
        try:
            async with asyncio.timeout_at(deadline):
                await self._read_all(started, [request for _, request in choices], states)
        except TimeoutError:
            raise timeout_error(timeout_s) from None
        except ApiError:
            raise
        except Exception as exc:
            logger.warning("request failed mid-generation: %r", exc)
            self._count_cut()
            raise ApiError.server("a replica failed while generating; retry the request").already_counted() from None
        finally:
            for s in started:
                s.cancel()
        fmt.fingerprint = started[0].first.get("replica")  # the replica that answered, if the first one failed
        return JSONResponse(fmt.body(states))

    async def _read_all(self, started: list[StartedStream], requests: list[dict], states: list[ChoiceState]) -> None:
        """Read every choice of a request that is not streamed into its state; a choice whose replica fails before
        its last record starts over elsewhere (read_whole), and `started` keeps its new stream for the caller to
        cancel."""
        wait_s = self.settings.replica_wait_timeout_s

        async def read(i: int) -> None:
            async def restart() -> StartedStream:
                started[i] = await start_stream(self.engine, requests[i], wait_s, self._count_hand_back, self._demux)
                return started[i]

            records = await read_whole(started[i], restart, self._count_hand_back)
            for record in records:
                states[i].update(record)

        tasks = [asyncio.ensure_future(read(i)) for i in range(len(started))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _start_all(self, requests: list[dict]) -> list[StartedStream]:
        """Start every choice; if any fails, cancel the others and raise its error."""
        wait_s = self.settings.replica_wait_timeout_s
        tasks = [asyncio.ensure_future(start_stream(self.engine, r, wait_s, self._count_hand_back, self._demux))
                 for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is None:
                    t.result().cancel()
                else:
                    t.cancel()
            raise
