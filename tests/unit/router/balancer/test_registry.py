from __future__ import annotations

import time
from typing import Any

import pytest

from services.common.errors import ResourceExhausted
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.router.balancer.policies.cache_aware import CacheAware
from services.router.balancer.registry import MAX_REPORTED_BLOCKS, Registry, Replica, WorkerReport
from services.router.balancer.tiers import TierName


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


def _registry(**kw: Any) -> Registry:
    return Registry([], [], internal_token="t", block_tokens=16, model_version="v1", kv_high_watermark=0.9, **kw)


def test_a_report_sets_load_kv_and_hot_blocks() -> None:
    reg = _registry()
    r = _replica(kv_high_watermark=0.9)
    hot = (b"a" * 32, b"b" * 32)
    reg.apply_report(
        r,
        WorkerReport(
            worker_id="w-1",
            active=2,
            queued=1,
            max_active=8,
            kv_used_bytes=95,
            kv_budget_bytes=100,
            block_tokens=16,
            hot_blocks=hot,
            model_version="v1",
        ),
    )
    assert (r.name, r.load, r.max_active, r.hot_blocks) == ("w-1", 3, 8, frozenset(hot))
    assert r.report.kv_usage == 0.95 and r.kv_full
    reg.apply_report(r, WorkerReport(kv_used_bytes=50, kv_budget_bytes=100))
    assert not r.kv_full and r.hot_blocks == frozenset()
    reg.apply_report(r, WorkerReport(kv_used_bytes=1 << 40))  # no budget: usage unknown, never "full"
    assert r.report.kv_usage is None and not r.kv_full


def test_hot_blocks_hashed_differently_from_ours_are_ignored() -> None:
    reg = _registry()
    r = _replica()
    for block_tokens, version in ((32, "v1"), (16, "v0")):
        reg.apply_report(r, WorkerReport(block_tokens=block_tokens, model_version=version, hot_blocks=(b"x" * 32,)))
        assert r.hot_blocks == frozenset()


def test_report_from_stats_keeps_every_field() -> None:
    from services.common.pb.meshserve.internal.v1 import worker_pb2

    stats = worker_pb2.WorkerStats(
        worker_id="w",
        active_sequences=1,
        queue_depth=2,
        max_active_sequences=3,
        recent_tokens_per_second=4.5,
        kv_used_bytes=6,
        kv_budget_bytes=7,
        kv_tokens=8,
        held_sequences=9,
        prefix_block_tokens=10,
        hot_prefix_blocks=[b"h"],
        model_version="v",
        prompt_tokens_total=11,
        prefill_tokens_total=12,
        model="m",
    )
    want = WorkerReport("w", 1, 2, 3, 4.5, 6, 7, 8, 9, 10, (b"h",), "v", 11, 12, model_id="m")
    assert WorkerReport.from_pb(stats) == want


def test_a_report_in_our_hash_scheme_replaces_the_routers_belief() -> None:
    reported: list[str] = []
    reg = _registry(on_report=lambda r: reported.append(r.address))
    r = _replica()
    reg.apply_report(r, WorkerReport(block_tokens=16, model_version="v1"))  # holds nothing: also the truth
    reg.apply_report(r, WorkerReport(block_tokens=32, model_version="v1", hot_blocks=(b"x" * 32,)))
    reg.apply_report(r, WorkerReport())  # an old worker that reports no blocks: the router's memory stays
    assert reported == [r.address]


async def test_registrations_stop_at_max_replicas_and_a_dropped_replica_leaves_nothing_behind() -> None:
    selector = CacheAware()
    dropped: list[str] = []

    def on_drop(address: str) -> None:
        dropped.append(address)
        selector.drop(address)

    # Nothing listens on these ports: each new address costs one refused probe, not a timeout.
    reg = Registry([], [], internal_token="t", timeout_s=0.2, max_replicas=3, on_drop=on_drop, model_version="v1")
    addresses = [f"127.0.0.1:{port}" for port in range(1, 51)]
    refused = 0
    try:
        for address in addresses:
            try:
                await reg.heartbeat(address, TierName.EDGE, WorkerReport(block_tokens=8, hot_blocks=(b"x" * 32,)))
            except ResourceExhausted as exc:
                refused += 1
                assert exc.retry_after_ms == int(reg.heartbeat_ttl_s * 1000)
            selector.record(address, [b"b" * 32])
            selector.picks[address] = 1
        assert len(reg.replicas) == 3 and refused == 47
        for r in list(reg.replicas):
            await reg.heartbeat(r.address, TierName.EDGE, leaving=True)
        assert reg.replicas == [] and sorted(dropped) == sorted(addresses[:3])
        assert reg._mismatch_warned == set()  # the warned-about addresses went with their replicas
        assert all(a not in selector.picks for a in addresses[:3])
        assert selector.cached_blocks(addresses[0], [b"b" * 32]) == 0
        await reg.heartbeat(addresses[10], TierName.EDGE)  # room again
        assert [r.address for r in reg.replicas] == [addresses[10]]
    finally:
        await reg.close()


def test_a_report_keeps_at_most_max_reported_blocks() -> None:
    stats = worker_pb2.WorkerStats(hot_prefix_blocks=[i.to_bytes(32, "big") for i in range(MAX_REPORTED_BLOCKS + 500)])
    report = WorkerReport.from_pb(stats)
    assert len(report.hot_blocks) == MAX_REPORTED_BLOCKS
    assert report.hot_blocks[0] == (0).to_bytes(32, "big")


def test_max_replicas_is_at_least_one() -> None:
    from services.router.config import RouterSettings

    with pytest.raises(ValueError):
        RouterSettings(max_replicas=0, edge_workers=["127.0.0.1:1"])


def test_a_report_carries_the_model_state_and_only_awake_replicas_are_routed_to() -> None:
    from services.common.model_state import ModelState

    stats = worker_pb2.WorkerStats(model_state=worker_pb2.MODEL_STATE_ASLEEP, resident_bytes=123)
    report = WorkerReport.from_pb(stats)
    assert (report.model_state, report.resident_bytes) == (ModelState.ASLEEP, 123)
    assert WorkerReport.from_pb(worker_pb2.WorkerStats()).model_state is ModelState.AWAKE  # a worker before it
    reg = _registry()
    asleep, awake = _replica(healthy=True), Replica("127.0.0.1:2", TierName.EDGE, None, None, healthy=True)  # type: ignore[arg-type]
    reg.replicas += [asleep, awake]
    reg.apply_report(asleep, report)
    assert reg.healthy(TierName.EDGE) == [awake]  # the asleep one stays known, not routed to
    assert reg.healthy_tiers() == {TierName.EDGE} and asleep in reg.replicas
    assert not asleep.routable and awake.routable


def test_a_change_of_model_state_tells_the_listeners() -> None:
    reg = _registry()
    told: list[int] = []
    reg.listeners.append(lambda: told.append(1))
    r = _replica(healthy=True)
    reg.replicas.append(r)
    asleep = worker_pb2.WorkerStats(worker_id="w", model_state=worker_pb2.MODEL_STATE_ASLEEP)
    reg.apply_report(r, WorkerReport.from_pb(asleep))
    assert told == [1]
    reg.apply_report(r, WorkerReport.from_pb(asleep))  # no change: nobody told
    assert told == [1]
    reg.apply_report(r, WorkerReport.from_pb(worker_pb2.WorkerStats(worker_id="w")))
    assert told == [1, 1]
