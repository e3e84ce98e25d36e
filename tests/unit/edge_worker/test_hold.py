"""The batched edge engine's hold rule (services/edge_worker/hold.py) with a fake clock: background
sequences sit out every round while foreground work is active here or on the host, and the bound lets
them through after ``max_hold_s``."""

from __future__ import annotations

from dataclasses import dataclass

from services.edge_worker.hold import BackgroundHold


@dataclass(eq=False)
class Seq:
    background: bool = False
    closed: bool = False
    kv_len: int = 10
    prefill_end: int = 10  # decoding; prefill_end - kv_len >= 2: prefilling


def test_background_runs_alone_and_with_nothing_foreground() -> None:
    hold = BackgroundHold(max_hold_s=2.0)
    bg = Seq(background=True)
    assert hold.split([bg], 0.0) == ([bg], [])
    assert hold.rounds == 0


def test_background_sits_out_every_decode_round_of_a_foreground_sequence() -> None:
    hold = BackgroundHold(max_hold_s=2.0)
    fg, bg = Seq(), Seq(background=True)
    for i in range(5):  # decode rounds, not only prefill ones
        assert hold.split([fg, bg], i * 0.01) == ([fg], [bg])
    assert hold.rounds == 5


def test_a_foreground_sequence_between_two_steps_still_holds_until_it_goes_idle_or_closes() -> None:
    hold = BackgroundHold(max_hold_s=2.0, idle_s=0.05)
    fg, bg = Seq(), Seq(background=True)
    hold.split([fg, bg], 0.0)
    assert hold.split([bg], 0.01) == ([], [bg])  # its thread is sending the frame: not back yet
    assert 0 < hold.wait_s(0.01) <= 0.04 + 1e-9
    assert hold.split([bg], 0.06) == ([bg], [])  # idle since 0.0: no longer active
    assert hold.held_s == 0.06

    hold.split([fg, bg], 1.0)
    fg.closed = True  # its turn ended
    assert hold.split([bg], 1.001) == ([bg], [])


def test_the_host_flag_holds_until_it_expires_or_is_cleared() -> None:
    hold = BackgroundHold(max_hold_s=5.0)
    bg = Seq(background=True)
    hold.hold_host(1.0)
    assert hold.split([bg], 0.0) == ([], [bg])
    assert hold.wait_s(0.0) == 1.0
    assert hold.split([bg], 0.5) == ([], [bg])
    assert hold.split([bg], 1.0) == ([bg], [])  # expired: never renewed (the router went away)

    hold.hold_host(3.0)
    assert hold.split([bg], 2.0) == ([], [bg])
    hold.hold_host(0.0)  # the router's foreground count went back to 0
    assert hold.split([bg], 2.1) == ([bg], [])


def test_the_bound_lets_one_round_through_then_holds_again() -> None:
    hold = BackgroundHold(max_hold_s=2.0)
    fg, bg = Seq(), Seq(background=True)
    t = 0.0
    through = []
    while t < 10.0:  # a foreground load that never pauses
        run, _ = hold.split([fg, bg], t)
        if bg in run:
            through.append(t)
        t += 0.25  # exact in binary: the clock's steps add up without rounding
    assert through == [2.0, 4.25, 6.5, 8.75]  # one round per max_hold_s: delayed, never starved
    assert hold.bound_hits == 4


def test_the_bound_never_lets_background_into_a_foreground_prefill_round() -> None:
    hold = BackgroundHold(max_hold_s=1.0)
    prefilling = Seq(kv_len=0, prefill_end=300)
    bg = Seq(background=True)
    hold.split([prefilling, bg], 0.0)
    assert hold.split([prefilling, bg], 1.5) == ([prefilling], [bg])
    prefilling.kv_len = 300  # the prompt is in: the next round may let the line through
    assert hold.split([prefilling, bg], 1.6) == ([prefilling, bg], [])


def test_wait_is_bounded_by_the_max_hold() -> None:
    hold = BackgroundHold(max_hold_s=2.0)
    bg = Seq(background=True)
    hold.hold_host(100.0)
    hold.split([bg], 0.0)
    assert hold.wait_s(0.5) == 1.5
    assert hold.split([bg], 2.0) == ([bg], [])


def test_holds_are_counted_by_the_cause_that_began_them() -> None:
    hold = BackgroundHold(max_hold_s=10.0)
    fg, bg = Seq(), Seq(background=True)
    hold.hold_host(1.0)
    hold.split([bg], 0.0)
    hold.split([fg, bg], 0.1)  # the same hold goes on
    fg.closed = True
    hold.split([bg], 2.0)  # ended
    hold.split([Seq(), bg], 3.0)
    assert hold.holds == {"host": 1, "here": 1}
