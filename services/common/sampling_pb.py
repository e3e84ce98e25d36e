"""``meshserve.v1.SamplingParams`` <-> :class:`~services.common.sampling.SamplingParams`.

The only module that knows both: service edges call :func:`from_pb` where a request arrives (the
gateway's and the router's servicers, the worker's servicer) and :func:`to_pb` where a message is
built for the wire (the router's ``WorkerStart``). Nothing converts back and forth inside a service.
"""

from __future__ import annotations

from services.common.constraints import Constraint, check_constraint
from services.common.pb.meshserve.v1 import inference_pb2
from services.common.sampling import MESH_LIMITS, SamplingLimits, SamplingParams, resolve_sampling


def from_pb(msg: inference_pb2.SamplingParams, limits: SamplingLimits = MESH_LIMITS) -> SamplingParams:
    """The checked parameters of a request, neutral values applied to the fields it left unset (named in
    ``defaulted``: the router fills them with the model's defaults; ``max_tokens`` still 0 when unset:
    see :meth:`SamplingParams.fit`); raises InvalidArgument naming the bad field."""
    return resolve_sampling(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else None,
        top_p=msg.top_p if msg.HasField("top_p") else None,
        top_k=msg.top_k if msg.HasField("top_k") else None,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=msg.stop,
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else None,
        logit_bias=dict(msg.logit_bias),
        min_tokens=msg.min_tokens,
        structured=structured_from_pb(msg.structured) if msg.HasField("structured") else None,
        n=msg.n if msg.HasField("n") else 1,
        logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
        limits=limits,
    )


def to_pb(params: SamplingParams) -> inference_pb2.SamplingParams:
    """The wire form. A field the request left unset (``params.defaulted``: the gateway's message to a
    router in another process) stays unset, so that router applies the model's default; every other
    field is set (the router's ``WorkerStart``: the worker applies no default)."""
    msg = inference_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        stop=list(params.stop),
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
    )
    unset = params.defaulted
    if "temperature" not in unset:
        msg.temperature = params.temperature
    if "top_p" not in unset:
        msg.top_p = params.top_p
    if "top_k" not in unset:
        msg.top_k = params.top_k
    if "repetition_penalty" not in unset:
        msg.repetition_penalty = params.repetition_penalty
    if params.seed is not None:
        msg.seed = params.seed
    if params.n != 1:  # unset is 1: a receiver from before n existed sees the same message
        msg.n = params.n
    if params.structured is not None:
        msg.structured.CopyFrom(structured_to_pb(params.structured))
    return msg


def structured_from_pb(msg: inference_pb2.StructuredOutput) -> Constraint | None:
    """The checked constraint of a ``StructuredOutput`` (None when no kind is set, or ``json_object``
    is false); raises InvalidArgument naming ``sampling.structured``."""
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    return check_constraint(kind, "" if kind == "json_object" else getattr(msg, kind))


def structured_to_pb(constraint: Constraint) -> inference_pb2.StructuredOutput:
    if constraint.kind == "json_object":
        return inference_pb2.StructuredOutput(json_object=True)
    msg = inference_pb2.StructuredOutput()
    setattr(msg, constraint.kind, constraint.text)
    return msg
