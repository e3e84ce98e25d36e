"""services/common/model_state_pb.py: every state goes to its pb number and back; an unknown number is None."""

from __future__ import annotations

import pytest

from services.common import model_state_pb
from services.common.model_state import ModelState
from services.common.pb.meshserve.internal.v1 import worker_pb2


@pytest.mark.parametrize("state", list(ModelState))
def test_every_state_goes_to_the_wire_and_back(state: ModelState) -> None:
    assert model_state_pb.from_pb(model_state_pb.to_pb(state)) is state


def test_the_numbers_are_the_protos() -> None:
    assert [model_state_pb.to_pb(s) for s in ModelState] == [
        worker_pb2.MODEL_STATE_AWAKE,
        worker_pb2.MODEL_STATE_ASLEEP,
        worker_pb2.MODEL_STATE_WAKING,
        worker_pb2.MODEL_STATE_FALLING_ASLEEP,
    ]
    assert len(worker_pb2.ModelState.values()) == len(ModelState)


def test_an_unknown_number_is_none() -> None:
    assert model_state_pb.from_pb(99) is None
