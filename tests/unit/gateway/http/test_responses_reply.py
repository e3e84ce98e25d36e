"""The Responses output items built from frames (text, tool calls, logprobs) in the order the model produced
them (services/gateway/http/responses_reply.py)."""

from __future__ import annotations

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.http.responses_reply import Output


async def test_output_items_follow_the_frames_order() -> None:
    out = Output("resp_ab", None, with_logprobs=True)
    entry = pb.TokenLogprob(token="Hi", token_bytes=b"Hi", logprob=-0.1)
    await out.text("Hi", [entry])
    await out.call(pb.ToolCallDelta(index=0, id="call_1", name="f", arguments='{"a"'))
    await out.call(pb.ToolCallDelta(index=0, arguments=": 1}"))
    await out.call(pb.ToolCallDelta(index=1, id="call_2", name="g"))
    await out.text("Done", [])
    await out.finish("incomplete")
    assert [(i["type"], i["id"], i["status"]) for i in out.items] == [
        ("message", "msg_ab", "completed"),
        ("function_call", "fc_1", "completed"),
        ("function_call", "fc_2", "completed"),
        ("message", "msg_ab_1", "incomplete"),
    ]
    assert out.items[0]["content"][0]["logprobs"][0]["token"] == "Hi"
    assert out.items[1]["arguments"] == '{"a": 1}' and out.items[2]["arguments"] == ""
    assert [(m["role"], m["content"], len(m.get("tool_calls", []))) for m in out.conversation()] == [
        ("assistant", "Hi", 2),
        ("assistant", "Done", 0),
    ]


async def test_an_empty_answer_is_one_empty_message() -> None:
    out = Output("resp_ab", None, with_logprobs=False)
    await out.text("", [])
    await out.finish("completed")
    assert [(i["type"], i["content"][0]["text"]) for i in out.items] == [("message", "")]


def test_a_budget_closed_answer_is_marked_in_the_output_token_details() -> None:
    from services.gateway.http.responses_reply import _usage

    closed = pb.Final(
        finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage(prompt_tokens=3, completion_tokens=9, budget_closed=True)
    )
    assert _usage(closed)["output_tokens_details"] == {"reasoning_tokens": 0, "budget_closed": True}  # type: ignore[index]
    plain = pb.Final(finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage(prompt_tokens=3, completion_tokens=9))
    assert _usage(plain)["output_tokens_details"] == {"reasoning_tokens": 0}  # type: ignore[index]
