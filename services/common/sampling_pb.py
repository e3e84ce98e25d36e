"""``meshserve.v1.SamplingParams`` <-> :class:`~services.common.sampling.SamplingParams`.

The only module that knows both: service edges call :func:`from_pb` where a request arrives (the
gateway's and the router's servicers, the worker's servicer) and :func:`to_pb` where a message is
built for the wire (the router's ``WorkerStart``). Nothing converts back and forth inside a service.
"""

from __future__ import annotations

from services.common.pb.meshserve.v1 import inference_pb2
from services.common.sampling import MESH_LIMITS, SamplingLimits, SamplingParams, resolve_sampling


def from_pb(msg: inference_pb2.SamplingParams, limits: SamplingLimits = MESH_LIMITS) -> SamplingParams:
    """The checked parameters of a request, defaults applied (``max_tokens`` still 0 when defaulted:
    see :meth:`SamplingParams.fit`); raises InvalidArgument naming the bad field."""
    return resolve_sampling(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=msg.stop,
        limits=limits,
    )


def to_pb(params: SamplingParams) -> inference_pb2.SamplingParams:
    msg = inference_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=list(params.stop),
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg
