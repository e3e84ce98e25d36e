"""The gateway's structured-output check: refused constraints name the field, passed ones are remembered,
and the check is bounded in time."""

from __future__ import annotations

import pytest

from services.common.constraints import check_constraint
from services.common.errors import InvalidArgument
from services.common.sampling import SamplingParams
from services.gateway.validation import GrammarChecks


def with_constraint(kind: str, text: str = "") -> SamplingParams:
    return SamplingParams(max_tokens=4, structured=check_constraint(kind, text))


async def test_a_constraint_llguidance_refuses_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match=r"^response_format \(sampling\.structured\): the regex is not valid"):
        await GrammarChecks().check(with_constraint("regex", "(("))


async def test_passed_constraints_are_remembered_and_unconstrained_requests_skip_the_check() -> None:
    checks = GrammarChecks(entries=1)
    await checks.check(None)
    await checks.check(SamplingParams(max_tokens=4))
    await checks.check(with_constraint("regex", "a+"))
    checks.timeout_s = 0.0  # a remembered constraint is not checked again
    await checks.check(with_constraint("regex", "a+"))


async def test_a_check_past_its_time_limit_is_invalid_argument_naming_the_limit() -> None:
    with pytest.raises(InvalidArgument, match=r"did not compile within the limit of 0 s"):
        await GrammarChecks(timeout_s=0.0).check(with_constraint("json_schema", '{"type": "object"}'))
