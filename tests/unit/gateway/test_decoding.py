"""Naming the string field that holds bad UTF-8, from the wire bytes protobuf refused."""

from __future__ import annotations

import logging

import pytest
from google.protobuf.message import DecodeError

from services.common import metadata as md
from services.common.logging import quiet_grpc_decode_errors
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.decoding import _guard_deserializer, bad_utf8_field

MARK = "\u00a7"  # encodes as b"\xc2\xa7"; replaced on the wire by b"\xed\xa0" (a surrogate's first bytes)


def _corrupt(message: pb.GenerateRequest | pb.ChatRequest) -> bytes:
    data = message.SerializeToString()
    assert data.count(MARK.encode()) == 1
    return data.replace(MARK.encode(), b"\xed\xa0")


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (pb.GenerateRequest(prompt=MARK), "prompt"),
        (pb.GenerateRequest(model=MARK, prompt="hi"), "model"),
        (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(stop=["a", MARK])), "sampling.stop[1]"),
        (
            pb.ChatRequest(turn=pb.ChatTurn(messages=[pb.ChatMessage(content="a"), pb.ChatMessage(role=MARK)])),
            "turn.messages[1].role",
        ),
    ],
)
def test_the_bad_field_is_named(message: pb.GenerateRequest | pb.ChatRequest, field: str) -> None:
    data = _corrupt(message)
    with pytest.raises(DecodeError):
        type(message).FromString(data)
    assert bad_utf8_field(message.DESCRIPTOR, data) == field
    guarded = _guard_deserializer(type(message).FromString)
    assert guarded is not None
    assert guarded(data).message == f"the field {field!r} is not valid UTF-8; send text fields as UTF-8"


@pytest.mark.parametrize("junk", [b"\xff", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0a\x05ab", b"\x0b"])
def test_unreadable_bytes_name_no_field(junk: bytes) -> None:
    assert bad_utf8_field(pb.GenerateRequest.DESCRIPTOR, junk) is None


def test_unreadable_metadata_key() -> None:
    assert md.unreadable_key([("authorization", "Bearer k"), ("x-request-id", "abc")]) is None
    assert md.unreadable_key([("a", "ok"), ("x-request-id", "\u00ff\u00fe")]) == "x-request-id"
    assert md.unreadable_key([("x-junk", "tab\there")]) == "x-junk"
    assert md.unreadable_key([("trace-bin", b"\xff")]) is None


def test_grpcs_invalid_encoding_record_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    quiet_grpc_decode_errors()
    quiet_grpc_decode_errors()  # idempotent
    logger = logging.getLogger("grpc._cython.cygrpc")
    assert len(logger.filters) == 1
    with caplog.at_level(logging.INFO):
        logger.error("Invalid encoding on %s", b"\xff")
        logger.error("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
