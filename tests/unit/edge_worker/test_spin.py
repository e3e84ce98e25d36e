"""The adaptive session choice: measures every session, keeps the fastest, probes the others less and less."""

from __future__ import annotations

from services.edge_worker.spin import SessionChooser


def run(chooser: SessionChooser, rows: int, calls: int, cost: list[float]) -> list[int | None]:
    chosen = []
    for _ in range(calls):
        mode = chooser.choose(rows)
        if mode is not None:
            chooser.record(rows, mode, cost[mode])
        chosen.append(mode)
    return chosen


def test_the_fastest_session_wins_and_the_others_are_probed_ever_less_often() -> None:
    chooser = SessionChooser(3, probe_every=8, max_probe_every=64, probe_calls=2, window=5)
    chosen = run(chooser, 2, 400, [0.010, 0.008, 0.012])
    assert chosen[:6] == [0, 0, 1, 1, 2, 2]  # every session measured first
    probes = [mode for mode in chosen[6:] if mode != 1]
    # Each loser: 2-call probes 8, 16, 32, 64, 64, ... calls apart (5-9 of them in 394 calls), not every 8.
    assert 2 * 2 * 5 <= len(probes) <= 2 * 2 * 9
    assert {0, 2} <= set(probes)  # the losers take turns
    assert chosen[-64:].count(1) >= 60  # one probe of each loser at most
    assert chooser.calls == [chosen.count(0), chosen.count(1), chosen.count(2)]


def test_a_host_that_gets_loaded_moves_the_calls_and_back() -> None:
    chooser = SessionChooser(3, probe_every=4, max_probe_every=32, probe_calls=2, window=3)
    run(chooser, 2, 100, [0.010, 0.008, 0.012])  # idle host: spinning threads fastest
    loaded = run(chooser, 2, 200, [0.030, 0.060, 0.020])  # other jobs on the cores: one thread fastest
    assert loaded[-50:].count(2) >= 44
    quiet = run(chooser, 2, 300, [0.010, 0.008, 0.012])
    assert quiet[-50:].count(1) >= 44


def test_large_calls_are_left_to_the_default_session() -> None:
    chooser = SessionChooser(2, max_rows=4)
    assert run(chooser, 16, 20, [0.001, 1.0]) == [None] * 20
    assert chooser.calls == [0, 0]
    assert chooser.choose(4) == 0  # each size has its own measurements


def test_a_much_slower_session_is_probed_rarely_while_the_others_trade_places() -> None:
    chooser = SessionChooser(3, probe_every=8, max_probe_every=256, probe_calls=2, window=3)
    spinning = 0
    for phase in range(12):  # sleeping and single-thread sessions take turns being fastest; spinning is 5x slower
        costs = [0.010, 0.050, 0.012] if phase % 2 else [0.012, 0.050, 0.010]
        spinning += run(chooser, 2, 60, costs).count(1)
    assert spinning <= 2 * 7  # 8, 16, 32, 64, 128, 256 ... calls apart in 720 calls, not reset by the trades


def test_probes_never_run_back_to_back_so_the_winner_keeps_running() -> None:
    # Probing every call: the two losers take turns, but a call on the winner separates each probe
    # (back to back, the losers' probes took every call and the winner never ran).
    chooser = SessionChooser(3, probe_every=1, max_probe_every=1, probe_calls=1, window=1)
    seconds = {0: 0.020, 1: 0.010, 2: 0.030}
    modes = []
    for _ in range(30):
        mode = chooser.choose(2)
        assert mode is not None
        chooser.record(2, mode, seconds[mode])
        modes.append(mode)
    assert modes[3:].count(1) >= 13  # every other call after the first measurements
    assert all(calls > 3 for calls in chooser.calls)
