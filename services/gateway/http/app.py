"""The OpenAI-compatible HTTP API (aiohttp), relaying each request to the gateway over gRPC.

A handler only translates: OpenAI JSON -> proto (:mod:`.openai_request`), one gRPC call to the gateway
with the caller's ``Authorization`` header (and its W3C ``traceparent``/``tracestate`` when well formed),
proto -> JSON (:mod:`.openai_reply`) or server-sent events (:mod:`.streams`). Authentication,
validation, limits and errors are the gateway's; a gRPC status becomes OpenAI's error JSON with the
matching HTTP status (429 carries ``Retry-After`` in seconds, rounded up, and ``retry-after-ms``).

n choices (``n`` > 1): the gateway's frames carry their choice's index and each choice ends with its
own final frame; a whole answer lists the choices by index, a stream sends each choice's role chunk
first, then the choices' chunks as they come (each with its index) and each choice's finish chunk
when it ends; usage (and the ``include_usage`` chunk, after every choice ended) counts the prompt
once and sums the choices' completion tokens. A non-streamed completion of n > 1 choices is read
from the gateway's Generate stream (Complete returns one choice).

Streams: the first frame is awaited *before* the SSE headers go out, so an error the gateway reports
up front (401, 429, 400, 404, 503) still gets its real HTTP status; an error after that is sent as
``data: {"error": ...}``. A client that disconnects cancels the gRPC call (handler cancellation), which
cancels generation on the worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from services.common import metadata as md
from services.common import tracing
from services.common.errors import InvalidArgument, MeshError, NotFound, ResourceExhausted, Unavailable
from services.common.pb.meshserve.v1 import batch_pb2_grpc, inference_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.http import openai_reply, openai_request, streams
from services.gateway.http.batches import BatchRoutes, add_routes
from services.gateway.http.embeddings import EmbeddingRoutes
from services.gateway.http.metrics import metrics_middleware
from services.gateway.http.responses import ResponseRoutes
from services.store.responses import ResponseStore

log = structlog.get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_FORWARDED = (md.AUTHORIZATION, md.API_KEY)
MAX_CREDENTIAL_CHARS = 8192
"""Longest Authorization / x-api-key value forwarded to the gateway (real keys and JWTs are far shorter)."""
MAX_BODY_KEY = web.AppKey("max_body_bytes", int)
ENDPOINTS = (
    "POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings, POST /v1/responses,"
    " GET|DELETE /v1/responses/{id}, GET /v1/models, GET /v1/models/{id}, /v1/files and /v1/batches"
)


def _grpc_error(exc: grpc.aio.AioRpcError) -> MeshError:
    """The domain error for a gateway status (the gateway's messages are written for callers)."""
    code = exc.code().name
    message = exc.details() or "the request failed"
    sent = md.sent_retry_after_ms(exc.trailing_metadata())
    if code == "RESOURCE_EXHAUSTED":
        return ResourceExhausted(message, retry_after_ms=md.DEFAULT_RETRY_AFTER_MS if sent is None else sent)
    if code == "UNAVAILABLE" and sent:  # a model waking up (or whose wake failed): when to retry
        return Unavailable(message, retry_after_ms=sent)
    if code not in openai_reply.HTTP_STATUS:
        code = "INTERNAL"
    error = MeshError(message)
    error.code = code
    return error


def error_response(exc: MeshError) -> web.Response:
    status, body = openai_reply.error_body(exc.code, exc.message)
    headers = {}
    if isinstance(exc, ResourceExhausted) or (isinstance(exc, Unavailable) and exc.retry_after_ms > 0):
        headers = {
            "Retry-After": str(openai_reply.retry_after_s(exc.retry_after_ms)),
            "retry-after-ms": str(exc.retry_after_ms),
        }
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as OpenAI error JSON; never a traceback."""
    try:
        return await handler(request)
    except MeshError as exc:
        return error_response(exc)
    except grpc.aio.AioRpcError as exc:
        return error_response(_grpc_error(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(request, exc)
    except Exception:
        log.exception("http_internal_error", path=request.path)
        return error_response(MeshError("internal error in the HTTP adapter; the server log has the details"))


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own refusals (no route, wrong method, body too large) as OpenAI error JSON."""
    where = f"{request.method} {request.path}"
    headers = {}
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        headers["Allow"] = allowed
        message = f"{where} is not allowed; this endpoint takes {allowed}"
    elif isinstance(exc, web.HTTPRequestEntityTooLarge):
        limit = request.app[MAX_BODY_KEY]
        message = f"the request body is larger than {limit} bytes; send a shorter prompt"
    elif exc.status == 404:
        message = f"unknown endpoint {where}; this server serves {ENDPOINTS}"
    else:
        message = f"{exc.reason}: {where}"
    _, body = openai_reply.error_body("INVALID_ARGUMENT", message)
    return web.json_response(body, status=exc.status, headers=headers)


class OpenAIApp:
    """Route handlers bound to one gRPC channel to the gateway."""

    def __init__(self, gateway: inference_pb2_grpc.InferenceStub) -> None:
        self._gateway = gateway
        self._default_model: str | None = None

    async def _served_model(self, wanted: str, request: web.Request) -> str:
        """The id of the model that answers: the one named (the gateway refused any other with 404), or,
        when the request left ``model`` empty, the mesh's default, the first ListModels entry (asked
        once, with this caller's credentials, after the gateway accepted the request; then kept)."""
        if wanted:
            return wanted
        if self._default_model is None:
            reply = await self._gateway.ListModels(pb.ListModelsRequest(), metadata=self._metadata(request))
            if not reply.models:
                return wanted
            self._default_model = reply.models[0].id
        return self._default_model

    @staticmethod
    def _metadata(request: web.Request) -> tuple[tuple[str, str], ...]:
        forwarded = tuple((name, request.headers[name]) for name in _FORWARDED if name in request.headers)
        for name, value in forwarded:
            # gRPC refuses metadata over 16 KiB with RESOURCE_EXHAUSTED, which would read as a 429.
            if len(value) > MAX_CREDENTIAL_CHARS:
                raise InvalidArgument(
                    f"the {name} header is longer than {MAX_CREDENTIAL_CHARS} characters; send an API key or JWT"
                )
            # A non-ASCII metadata value fails inside grpc.aio, and a Chat call then never starts (hangs).
            if not (value.isascii() and value.isprintable()):
                raise InvalidArgument(f"the {name} header must be printable ASCII; send an API key or JWT")
        # W3C trace context joins the caller's trace (the gateway decides sampling; a bad one is dropped).
        return forwarded + tracing.caller_trace_headers(request.headers)

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json(loads=json.loads)
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: JSON nested too deep
            raise InvalidArgument("the request body must be a JSON object") from None
        except RequestPayloadError:  # e.g. a Content-Encoding that does not decode
            raise InvalidArgument("the request body could not be read; check its Content-Encoding") from None
        if not isinstance(body, dict):
            raise InvalidArgument("the request body must be a JSON object")
        field = openai_request.invalid_unicode_field(body)
        if field is not None:
            raise InvalidArgument(
                f"{field} is not valid Unicode (a lone or reversed UTF-16 surrogate escape such as"
                " \\ud800); send valid UTF-8 text"
            )
        return body

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        reply = await self._gateway.ListModels(pb.ListModelsRequest(), metadata=self._metadata(request))
        return web.json_response(openai_reply.models_list(reply))

    async def model(self, request: web.Request) -> web.Response:
        reply = await self._gateway.ListModels(pb.ListModelsRequest(), metadata=self._metadata(request))
        wanted = request.match_info["model"]
        found = next((m for m in reply.models if m.id == wanted), None)
        if found is None:
            raise _not_found(wanted)
        return web.json_response(openai_reply.model_entry(wanted, found))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        parsed, turn = openai_request.chat_request(await self._json(request))
        with_logprobs = turn.turn.sampling.logprobs
        call = self._gateway.Chat(metadata=self._metadata(request))
        try:
            await call.write(turn)
            await call.done_writing()
            frames = streams.chat_frames(call, parsed.n)
            first = await streams.first_frame(frames)
            request_id = await streams.request_id(call)
            model = await self._served_model(parsed.model, request)
            if not parsed.stream:
                texts, finals, calls, entries = await streams.collect(first, frames, parsed.n)
                body = openai_reply.chat_completion(
                    request_id, model, texts, finals, calls, entries if with_logprobs else None
                )
                return web.json_response(body, headers={md.REQUEST_ID: request_id})
            created = int(time.time())
            response = await streams.sse_start(request, request_id)
            usage = parsed.include_usage
            # OpenAI's first chunk of a choice has the role; with tools (then n is 1), it waits for the
            # first content or call, as a reply that starts with a call has "content": null and the call
            # in that first chunk.
            opening = {"role": "assistant", "content": ""}
            role: dict[str, Any] | None = opening
            if not parsed.tools:
                for index in range(parsed.n):
                    await streams.sse(
                        response, openai_reply.chat_chunk(request_id, model, opening, None, created, usage, index)
                    )
                role = None
            try:
                ends: list[pb.Final] = []
                async for text, last, deltas, index, logprobs in streams.prepend(first, frames):
                    lp = logprobs if with_logprobs else None
                    if role is not None and deltas and not text:
                        delta: dict[str, Any] = {
                            **role,
                            "content": None,
                            "tool_calls": openai_reply.tool_call_deltas(deltas),
                        }
                        await streams.sse(
                            response, openai_reply.chat_chunk(request_id, model, delta, None, created, usage, index, lp)
                        )
                        role, deltas, lp = None, (), None
                    if role is not None and (text or logprobs or last is not None):
                        await streams.sse(
                            response, openai_reply.chat_chunk(request_id, model, role, None, created, usage, index)
                        )
                        role = None
                    if text or lp:  # a token may come with no text yet (part of a character)
                        delta = {"content": text}
                        await streams.sse(
                            response, openai_reply.chat_chunk(request_id, model, delta, None, created, usage, index, lp)
                        )
                    if deltas:
                        delta = {"tool_calls": openai_reply.tool_call_deltas(deltas)}
                        await streams.sse(
                            response, openai_reply.chat_chunk(request_id, model, delta, None, created, usage, index)
                        )
                    if last is not None:
                        ends.append(last)
                        finish = openai_reply.finish_reason(last)
                        await streams.sse(
                            response, openai_reply.chat_chunk(request_id, model, {}, finish, created, usage, index)
                        )
                if ends and parsed.include_usage:
                    chunk = openai_reply.usage_chunk("chat.completion.chunk", request_id, model, ends, created)
                    await streams.sse(response, chunk)
            except (MeshError, grpc.aio.AioRpcError) as exc:
                return await _sse_error(response, exc)
            return await streams.sse_end(response)
        finally:
            call.cancel()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed, generate = openai_request.completion_request(await self._json(request))
        metadata = self._metadata(request)
        if not parsed.stream and parsed.n == 1:
            reply = await self._gateway.Complete(generate, metadata=metadata)
            model = await self._served_model(parsed.model, request)
            logprobs = openai_reply.completion_logprobs(reply.logprobs) if generate.sampling.logprobs else None
            body = openai_reply.completion(reply.request_id, model, reply.text, reply.final, logprobs=logprobs)
            return web.json_response(body, headers={md.REQUEST_ID: reply.request_id})
        call = self._gateway.Generate(generate, metadata=metadata)
        try:
            ids: list[str] = []  # the gateway sends x-request-id in every frame (and its trailers)
            frames = streams.generate_frames(call, ids)
            first = await streams.first_frame(frames)
            request_id = ids[0] if ids else await streams.request_id(call)
            model = await self._served_model(parsed.model, request)
            if not parsed.stream:  # n > 1 choices: Complete returns one
                texts, finals, _, per_choice = await streams.collect(first, frames, parsed.n)
                wanted = generate.sampling.logprobs
                body = openai_reply.completions(request_id, model, texts, finals, list(per_choice) if wanted else None)
                return web.json_response(body, headers={md.REQUEST_ID: request_id})
            created = int(time.time())
            response = await streams.sse_start(request, request_id)
            try:
                ends: list[pb.Final] = []
                offsets = [0] * parsed.n  # per choice: characters of token text sent so far (text_offset)
                async for text, final, _, index, entries in streams.prepend(first, frames):
                    if text or entries or final is not None:
                        logprobs = None
                        if generate.sampling.logprobs:
                            logprobs = openai_reply.completion_logprobs(entries, offsets[index])
                            offsets[index] += sum(len(e.token) for e in entries)
                        chunk = openai_reply.completion(
                            request_id, model, text, final, created, False, parsed.include_usage, logprobs, index
                        )
                        await streams.sse(response, chunk)
                    if final is not None:
                        ends.append(final)
                if ends and parsed.include_usage:
                    usage = openai_reply.usage_chunk("text_completion", request_id, model, ends, created)
                    await streams.sse(response, usage)
            except (MeshError, grpc.aio.AioRpcError) as exc:
                return await _sse_error(response, exc)
            return await streams.sse_end(response)
        finally:
            call.cancel()


def _not_found(model: str) -> NotFound:
    return NotFound(f"the model {model!r} does not exist; GET /v1/models lists the served models")


async def _sse_error(response: web.StreamResponse, exc: MeshError | grpc.aio.AioRpcError) -> web.StreamResponse:
    """An error after the stream started: OpenAI's in-stream error event, then the end of the body."""
    error = exc if isinstance(exc, MeshError) else _grpc_error(exc)
    await streams.sse(response, openai_reply.error_body(error.code, error.message)[1])
    await response.write_eof()
    return response


def build_app(
    gateway: inference_pb2_grpc.InferenceStub,
    max_body_bytes: int = 4 * 1024 * 1024,
    responses: ResponseStore | None = None,
    batches: batch_pb2_grpc.BatchesStub | None = None,
    max_file_bytes: int = 8 * 1024 * 1024,
) -> web.Application:
    """The aiohttp application: routes of the OpenAI API plus ``/healthz``; ``responses`` keeps the
    stored responses of ``/v1/responses`` (None: none kept); given the gateway's Batches stub,
    ``/v1/files`` and ``/v1/batches`` (services/gateway/http/batches.py)."""
    handlers = OpenAIApp(gateway)
    app = web.Application(client_max_size=max_body_bytes, middlewares=[metrics_middleware, errors_middleware])
    app[MAX_BODY_KEY] = max_body_bytes
    app.router.add_get("/healthz", handlers.healthz)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/v1/models/{model:.+}", handlers.model)  # ids such as "org/name" hold a slash
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    EmbeddingRoutes(handlers).add_to(app)
    ResponseRoutes(handlers, responses).add_to(app)
    if responses is not None:
        store = responses

        async def close_store(_app: web.Application) -> None:
            await store.close()

        app.on_cleanup.append(close_store)
    if batches is not None:
        add_routes(app, BatchRoutes(batches, handlers._metadata, handlers._json, max_file_bytes))
    return app
