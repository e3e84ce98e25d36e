"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: the routes of OpenAI's Responses API
over one Chat turn. The request is parsed in :mod:`.responses_request` (``parse``, ``chat_turn``), the
answer built and streamed in :mod:`.responses_reply` (``Output``, ``answer``, ``response_object``,
``Events``); both were part of this module until the split.

Stored responses (``store``, default true) are kept in Redis per tenant for ``responses_ttl_s``
(services/store/responses.py). The adapter never knows the tenant: the gateway, which authenticates,
sends back its digest (``x-meshserve-tenant-scope``: the Chat call's response headers, or the
trailers of a ListModels call for GET and DELETE), and records live under it, so another tenant's id
is simply not found (404). Without a Redis URL nothing is stored and ``previous_response_id`` is
refused.
"""

from __future__ import annotations

import re
import time
from typing import Any

import grpc
from aiohttp import web

from services.common import metadata as md
from services.common.errors import InvalidArgument, MeshError, NotFound, PermissionDenied
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.status_errors import Upstream, from_rpc_error
from services.gateway.http import openai_request, responses_reply, responses_request, streams
from services.store.responses import ResponseStore

_ID = re.compile(r"^resp_[0-9a-f]{1,64}$")


def not_found(response_id: str) -> NotFound:
    return NotFound(
        f"no response with id {openai_request._show(response_id)} (never stored, expired, deleted, or another tenant's)"
    )


class ResponseRoutes:
    """The handlers, over the adapter's shared request plumbing (:class:`~.app.OpenAIApp`) and the store."""

    def __init__(self, app: Any, store: ResponseStore | None) -> None:
        self._app = app
        self._store = store

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)

    async def _scope(self, request: web.Request) -> str:
        """The caller's tenant digest, from the trailers of a ListModels call (it authenticates)."""
        call = self._app._gateway.ListModels(pb.ListModelsRequest(), metadata=self._app._metadata(request))
        await call
        scope = streams.header(await call.trailing_metadata(), md.TENANT_SCOPE)
        if scope is None:
            raise PermissionDenied("this credential may not use /v1/responses: it needs the inference scope")
        return scope

    def _require_store(self) -> ResponseStore:
        if self._store is None:
            raise InvalidArgument(
                "this server keeps no responses (the HTTP adapter has no Redis: MESHSERVE_GATEWAY_HTTP_REDIS_URL);"
                " send the whole conversation in 'input' instead of previous_response_id"
            )
        return self._store

    async def retrieve(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        store = self._require_store()
        scope = await self._scope(request)
        record = await store.get(scope, response_id) if _ID.match(response_id) else None
        if record is None:
            raise not_found(response_id)
        return web.json_response(record["response"])

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        store = self._require_store()
        scope = await self._scope(request)
        if not (_ID.match(response_id) and await store.delete(scope, response_id)):
            raise not_found(response_id)
        return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        parsed = responses_request.parse(await self._app._json(request))
        if parsed.previous_response_id is not None:
            self._require_store()
        call = self._app._gateway.Chat(metadata=self._app._metadata(request))
        try:
            headers = await call.initial_metadata()
            scope = streams.header(headers, md.TENANT_SCOPE)
            if scope is None:  # the gateway refused the call: its status says why
                await call.read()
                raise MeshError("the gateway sent no tenant for this call; retry, and report it if it persists")
            request_id = streams.header(headers, md.REQUEST_ID) or ""
            history: list[dict[str, Any]] = []
            if parsed.previous_response_id is not None:
                assert self._store is not None
                previous = None
                if _ID.match(parsed.previous_response_id):
                    previous = await self._store.get(scope, parsed.previous_response_id)
                if previous is None:
                    raise not_found(parsed.previous_response_id)
                history = list(previous["conversation"])
            conversation = [*history, *parsed.messages]
            await call.write(pb.ChatRequest(turn=responses_request.chat_turn(parsed, conversation)))
            await call.done_writing()
            frames = streams.chat_frames(call)
            first = await anext(frames, None)
            model = await self._app._served_model(parsed.model, request)
            response_id = "resp_" + request_id
            created = int(time.time())
            with_logprobs = parsed.sampling.logprobs
            if not parsed.stream:
                out = responses_reply.Output(response_id, None, with_logprobs)
                final = await responses_reply.answer(first, frames, out)
                body = responses_reply.response_object(
                    parsed, response_id, model, created, output=out.items, final=final
                )
                await self._keep(parsed, scope, response_id, body, [*conversation, *out.conversation()])
                return web.json_response(body, headers={md.REQUEST_ID: request_id})
            events = responses_reply.Events(await streams.sse_start(request, request_id))
            try:
                pending = responses_reply.response_object(parsed, response_id, model, created)
                await events.send("response.created", response=pending)
                await events.send("response.in_progress", response=pending)
                out = responses_reply.Output(response_id, events, with_logprobs)
                end = await responses_reply.answer(first, frames, out)
                body = responses_reply.response_object(parsed, response_id, model, created, output=out.items, final=end)
                await self._keep(parsed, scope, response_id, body, [*conversation, *out.conversation()])
                await events.send(f"response.{body['status']}", response=body)
            except (MeshError, grpc.aio.AioRpcError) as exc:
                error = exc if isinstance(exc, MeshError) else from_rpc_error(exc, Upstream.ROUTER)
                await events.send("error", code=error.code.lower(), message=error.message, param=None)
            await events.response.write_eof()
            return events.response
        finally:
            call.cancel()

    async def _keep(
        self,
        parsed: responses_request.ResponsesRequest,
        scope: str,
        response_id: str,
        body: dict[str, Any],
        conversation: list[dict[str, Any]],
    ) -> None:
        if parsed.store and self._store is not None:
            await self._store.put(scope, response_id, {"response": body, "conversation": conversation})
