"""``meshserve.internal.v1.ModelState`` <-> :class:`~services.common.model_state.ModelState`: the only
module that knows both (the worker's servicer writes it with :func:`to_pb`; the router's registry and
``meshserve status`` read it with :func:`from_pb`)."""

from __future__ import annotations

from services.common.model_state import ModelState
from services.common.pb.meshserve.internal.v1 import worker_pb2

_TO_PB = {
    ModelState.AWAKE: worker_pb2.MODEL_STATE_AWAKE,
    ModelState.ASLEEP: worker_pb2.MODEL_STATE_ASLEEP,
    ModelState.WAKING: worker_pb2.MODEL_STATE_WAKING,
    ModelState.FALLING_ASLEEP: worker_pb2.MODEL_STATE_FALLING_ASLEEP,
}
_FROM_PB: dict[int, ModelState] = {number: state for state, number in _TO_PB.items()}


def to_pb(state: ModelState) -> worker_pb2.ModelState.ValueType:
    return _TO_PB[state]


def from_pb(value: int) -> ModelState | None:
    """The state of a pb number; None for a number this build does not know (a newer worker's)."""
    return _FROM_PB.get(value)
