"""``meshserve.v1.TokenLogprob`` <-> :class:`~services.common.logprobs.TokenLogprob`: the only module
that knows both (the worker's servicer and the router's and gateway's servicers build frames with
:func:`to_pb`; the router's worker transport and the gateway's router client read them with
:func:`from_pb`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.common.logprobs import TokenLogprob, TopLogprob
from services.common.pb.meshserve.v1 import inference_pb2


def to_pb(entries: Iterable[TokenLogprob]) -> list[inference_pb2.TokenLogprob]:
    return [
        inference_pb2.TokenLogprob(
            token_id=e.token_id,
            token=e.token,
            token_bytes=e.token_bytes,
            logprob=e.logprob,
            top_logprobs=[
                inference_pb2.TopLogprob(
                    token_id=t.token_id, token=t.token, token_bytes=t.token_bytes, logprob=t.logprob
                )
                for t in e.top
            ],
        )
        for e in entries
    ]


def from_pb(entries: Sequence[inference_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            e.token_id,
            e.token,
            e.token_bytes,
            e.logprob,
            tuple(TopLogprob(t.token_id, t.token, t.token_bytes, t.logprob) for t in e.top_logprobs),
        )
        for e in entries
    )
