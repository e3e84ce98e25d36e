"""Embed requests on the router: bounds in tokens, one cloud replica, one unary Worker.Embed call.

Embeddings come from the cloud tier only (services/gpu_worker/embed.py says why the edge engine has
none). The replica: the least loaded healthy cloud replica (ties: round robin), a simpler choice than
generation's prefix-aware one because an embedding keeps no KV to reuse; a replica that fails
(UNAVAILABLE, or its call breaks) is marked down and the next one tried, up to ``retries`` more.
The inputs are sent as token ids in one call, which the worker runs as padded batches.
A worker's INVALID_ARGUMENT reaches the caller with its text (unlike a generation's: the router has
checked the tokens already, so only ``dimensions`` above the model's hidden size, which the router
does not know, gets there, and Worker.Embed's messages name just the field and the model's limit).
Like the registry's health probes, this is a plain gRPC call beside the stream transport: a unary
request-response has nothing to stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc

from services.common import errors
from services.common.interceptors import outbound_metadata
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.common.status_errors import Upstream, from_rpc_error
from services.router.balancer.policies.base import Candidate
from services.router.balancer.policies.round_robin import RoundRobin
from services.router.balancer.registry import Registry, Replica
from services.router.balancer.tiers import TierName
from services.router.types import Embeddings, Route

MAX_EMBED_TOKENS = 65_536
"""Default bound on the tokens of one Embed request, all inputs together."""


def check_tokens(inputs: Sequence[Sequence[int]], *, context_length: int, vocab_size: int, max_total: int) -> int:
    """The inputs' total tokens; InvalidArgument naming the first input (or the total) out of bounds."""
    total = 0
    for i, ids in enumerate(inputs):
        if not ids:
            raise errors.InvalidArgument(f"input[{i}] has no tokens; send at least one token per input")
        if len(ids) > context_length:
            raise errors.InvalidArgument(
                f"input[{i}] is {len(ids)} tokens, above the model's context length of {context_length}; shorten it"
            )
        top = max(ids)
        if top >= vocab_size:
            raise errors.InvalidArgument(
                f"input[{i}] holds token id {top}, outside the model's vocabulary of {vocab_size} tokens"
            )
        total += len(ids)
    if total > max_total:
        raise errors.InvalidArgument(
            f"the inputs are {total} tokens together, above the limit of {max_total} per request; split them"
        )
    return total


class EmbedRoute:
    """Sends token id lists to a cloud replica's Worker.Embed (see the module docstring)."""

    def __init__(self, registry: Registry, internal_token: str, *, retries: int = 2) -> None:
        self._registry = registry
        self._token = internal_token
        self._retries = retries
        self._rr = RoundRobin()

    def _pick(self, tried: Sequence[Replica], pool: Callable[[TierName], list[Replica]] | None) -> Replica:
        healthy = (pool or self._registry.healthy)(TierName.CLOUD)
        replicas = [r for r in healthy if r not in tried]
        if not replicas:
            raise errors.Unavailable(
                "no healthy cloud worker can serve embeddings right now (edge workers have none);"
                " retry in a few seconds"
            )
        least = min(r.load for r in replicas)
        tied = [r for r in replicas if r.load == least]
        name = self._rr.select([Candidate(r.address, r.load) for r in tied], (), group="embed").name
        return next(r for r in tied if r.address == name)

    async def embed(
        self,
        inputs: Sequence[Sequence[int]],
        *,
        dimensions: int,
        request_id: str,
        time_left: float | None,
        pool: Callable[[TierName], list[Replica]] | None = None,
    ) -> Embeddings:
        """``pool``: the healthy replicas of a tier that serve the model version asked for (None: all)."""
        request = worker_pb2.WorkerEmbedRequest(
            inputs=[worker_pb2.EmbedTokens(token_ids=ids) for ids in inputs],
            dimensions=dimensions,
            request_id=request_id,
        )
        tried: list[Replica] = []
        while True:
            replica = self._pick(tried, pool)
            tried.append(replica)
            try:
                reply = await replica.stub.Embed(request, metadata=outbound_metadata(self._token), timeout=time_left)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # written for callers: see the docstring
                    raise errors.InvalidArgument(" ".join((exc.details() or "").split())[:300]) from None
                error = from_rpc_error(exc, Upstream.WORKER)
                if not isinstance(error, errors.Unavailable) or len(tried) > self._retries:
                    raise error from None
                self._registry.mark_down(replica, "call_failed")
                continue
            route = Route(TierName.CLOUD, replica.name, False, "embeddings")
            return Embeddings([list(e.values) for e in reply.embeddings], reply.prompt_tokens, route)
