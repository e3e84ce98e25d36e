"""The adaptive spinning choice: measures both sessions, keeps the faster, probes the other less and less."""

from __future__ import annotations

from services.edge_worker.spin import SpinChooser


def run(chooser: SpinChooser, rows: int, calls: int, cost: dict[bool, float]) -> list[bool]:
    chosen = []
    for _ in range(calls):
        spin = chooser.choose(rows)
        chooser.record(rows, spin, cost[spin])
        chosen.append(spin)
    return chosen


def test_the_faster_session_wins_and_the_loser_is_probed_ever_less_often() -> None:
    chooser = SpinChooser(probe_every=8, max_probe_every=64, probe_calls=2, window=5)
    chosen = run(chooser, 2, 400, {True: 0.008, False: 0.010})
    assert chosen[:4] == [True, True, False, False]  # both measured first
    probes = chosen[4:].count(False)
    assert 2 * 5 <= probes <= 2 * 9  # 2-call probes 8, 16, 32, 64, 64, ... calls apart: not 396 / 8
    assert chosen[-64:].count(False) <= 2
    assert chooser.spun == chosen.count(True)


def test_a_host_that_gets_loaded_moves_the_calls_to_the_sleeping_session_and_back() -> None:
    chooser = SpinChooser(probe_every=4, max_probe_every=32, probe_calls=2, window=3)
    run(chooser, 2, 100, {True: 0.008, False: 0.010})
    loaded = run(chooser, 2, 100, {True: 0.040, False: 0.015})  # other jobs took the second core
    assert loaded[-50:].count(True) <= 4
    quiet = run(chooser, 2, 200, {True: 0.008, False: 0.010})
    assert quiet[-50:].count(False) <= 4


def test_large_calls_always_sleep_and_are_not_counted() -> None:
    chooser = SpinChooser(max_rows=4)
    assert run(chooser, 16, 20, {True: 0.001, False: 1.0}) == [False] * 20
    assert chooser.spun == 0
    assert chooser.choose(4) is True  # each size has its own measurements
