from __future__ import annotations

import time
from typing import Any

from services.router.policy import TierName
from services.router.registry import Registry, Replica


def _replica(**kw: Any) -> Replica:
    return Replica("127.0.0.1:1", TierName.EDGE, None, None, **kw)  # type: ignore[arg-type]


def test_load_is_the_larger_of_own_streams_and_reported_load() -> None:
    r = _replica(in_flight=2, active_sequences=1, queue_depth=0)
    assert r.load == 2
    r.active_sequences, r.queue_depth = 3, 2
    assert r.load == 5


def test_readmitted_replica_ramps_up_gradually() -> None:
    r = _replica(max_active=4, readmit_s=10.0)
    r.readmitted_at = time.monotonic()
    assert r.load == 4  # full penalty right after re-admission
    r.readmitted_at = time.monotonic() - 5.0
    assert r.load == 2  # half way
    r.readmitted_at = time.monotonic() - 11.0
    assert r.load == 0


def test_ejection_backs_off_exponentially_and_is_capped() -> None:
    reg = Registry([], [], internal_token="t", eject_base_s=1.0, eject_max_s=4.0)
    r = _replica(healthy=True)
    reg.replicas.append(r)
    backoffs = []
    for _ in range(4):
        r.healthy = True  # came back
        before = time.monotonic()
        reg.mark_down(r, "call_failed")
        backoffs.append(round(r.ejected_until - before))
        assert not r.healthy
    assert backoffs == [1, 2, 4, 4]
