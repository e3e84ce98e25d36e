"""``POST /v1/embeddings``: OpenAI's embeddings request as one gRPC ``Embed`` call to the gateway.

``input`` takes OpenAI's four shapes: a string, a list of strings, a list of token ids (one input),
a list of token id lists. ``encoding_format`` ``float`` (default) or ``base64`` (the vector's
little-endian float32 bytes, base64-encoded, as OpenAI sends them; the official client asks for
base64 unless told otherwise and decodes it). ``dimensions`` keeps the first components of the
pooled vector and L2-normalises them again (``meshserve.v1.EmbedRequest.dimensions``). ``user`` is
accepted and ignored. Bounds (inputs, characters, tokens) are the gateway's and router's, answered
as 400s that name the field.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from aiohttp import web

from services.common import metadata as md
from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.http.openai_request import UINT32_MAX, _show

ENCODINGS = ("float", "base64")


def embed_request(body: dict[str, Any]) -> tuple[str, str, pb.EmbedRequest]:
    """(model, encoding_format, the EmbedRequest) of an OpenAI embeddings body; InvalidArgument otherwise."""
    model = body.get("model", "")
    if not isinstance(model, str):
        raise InvalidArgument("'model' must be a string; GET /v1/models lists the served models")
    encoding = body.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise InvalidArgument(f"'encoding_format' must be 'float' or 'base64' (got {_show(encoding)})")
    request = pb.EmbedRequest(model=model)
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= UINT32_MAX:
            raise InvalidArgument(f"'dimensions' must be a positive integer (got {_show(dimensions)})")
        request.dimensions = dimensions
    for item in _inputs(body.get("input")):
        if isinstance(item, str):
            request.inputs.add(text=item)
        else:
            request.inputs.add(token_ids=item)
    return model, encoding, request


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _inputs(value: object) -> list[str | list[int]]:
    shapes = "a string, a list of strings, a list of token ids or a list of token id lists"
    if isinstance(value, str):
        value = [value]
    elif _is_ids(value) and value:
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidArgument(f"'input' must be a non-empty {shapes}")
    out: list[str | list[int]] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise InvalidArgument(f"'input[{i}]' is an empty string; send some text to embed")
            out.append(item)
        elif _is_ids(item) and item:
            if not all(0 <= t <= UINT32_MAX for t in item):
                raise InvalidArgument(f"'input[{i}]' holds a negative or too large token id; token ids are 0 or more")
            out.append(item)
        else:
            raise InvalidArgument(f"'input[{i}]' must be a non-empty string or list of token ids ('input' is {shapes})")
    return out


def _encode(values: Any, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return list(values)


def embeddings_body(reply: pb.EmbedResponse, model: str, encoding: str) -> dict[str, Any]:
    """OpenAI's embeddings response (``object: list`` of ``embedding`` entries) for a gateway reply."""
    tokens = reply.usage.prompt_tokens
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode(e.values, encoding)}
            for i, e in enumerate(reply.embeddings)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


class EmbeddingRoutes:
    """The handler, over the adapter's shared request plumbing (:class:`~.app.OpenAIApp`)."""

    def __init__(self, app: Any) -> None:
        self._app = app

    async def embeddings(self, request: web.Request) -> web.Response:
        model, encoding, embed = embed_request(await self._app._json(request))
        reply = await self._app._gateway.Embed(embed, metadata=self._app._metadata(request))
        served = await self._app._served_model(model, request)
        return web.json_response(embeddings_body(reply, served, encoding), headers={md.REQUEST_ID: reply.request_id})

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.embeddings)
