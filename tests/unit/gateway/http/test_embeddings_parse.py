"""OpenAI embeddings bodies -> EmbedRequest, and the response body (float and base64)."""

from __future__ import annotations

import base64
import re

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.http.embeddings import embed_request, embeddings_body


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("hi", [("hi", [])]),
        (["a", "b"], [("a", []), ("b", [])]),
        ([1, 2, 3], [("", [1, 2, 3])]),
        ([[1], [2, 3]], [("", [1]), ("", [2, 3])]),
        (["a", [4]], [("a", []), ("", [4])]),
    ],
)
def test_every_openai_input_shape(value: object, expected: list[tuple[str, list[int]]]) -> None:
    model, encoding, request = embed_request({"model": "m", "input": value, "dimensions": 8})
    assert (model, encoding, request.dimensions) == ("m", "float", 8)
    assert [(i.text, list(i.token_ids)) for i in request.inputs] == expected


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": None}, "'input'"),
        ({"input": [True]}, "'input[0]'"),
        ({"input": [[]]}, "'input[0]'"),
        ({"input": "x", "encoding_format": "int8"}, "'encoding_format'"),
        ({"input": "x", "dimensions": True}, "'dimensions'"),
        ({"input": "x", "model": 3}, "'model'"),
    ],
)
def test_bad_bodies_name_the_field(body: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(field)):
        embed_request(body)


def test_base64_is_little_endian_float32_of_the_float_vector() -> None:
    reply = pb.EmbedResponse(embeddings=[pb.Embedding(values=[0.5, -0.25, 1e-3])], usage=pb.Usage(prompt_tokens=4))
    floats = embeddings_body(reply, "m", "float")
    encoded = embeddings_body(reply, "m", "base64")
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.array(floats["data"][0]["embedding"], dtype=np.float32))
    assert floats["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert floats["data"][0]["object"] == "embedding" and floats["object"] == "list"
