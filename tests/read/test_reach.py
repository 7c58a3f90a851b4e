"""How far a prefetcher reaches, given what it measured (times passed in, no clock)."""

from __future__ import annotations

from remote_loader.read.reach import FAR, START_BYTES, START_GETS, Reach

MiB = 1 << 20


def windows(reach: Reach, rates: list[float], waiting: float, held_back: bool = True) -> list[bool]:
    """Feed quarter-second windows bringing ``rates`` bytes/s, the reader waiting ``waiting``
    of each; return whether each look raised the limits."""
    now, waited, received = 0.0, 0.0, 0.0
    reach.start(now, waited, received)
    grew = []
    for rate in rates:
        now, waited, received = now + 0.25, waited + waiting * 0.25, received + rate * 0.25
        grew.append(reach.look(now, waited, received, held_back))
    return grew


def test_a_starved_reader_doubles_both_limits_while_it_pays_up_to_the_ceilings():
    reach = Reach(max_gets=16, max_bytes=128 * MiB)
    assert (reach.gets, reach.bytes) == (START_GETS, START_BYTES)
    # Two starved windows, then each step faster by half: grows, grows, then the ceilings.
    grew = windows(reach, [100, 100, 150, 150, 225, 225, 340, 340], waiting=0.5)
    assert grew == [False, True, False, True, False, False, False, False]
    assert (reach.gets, reach.bytes) == (16, 128 * MiB)


def test_growth_that_brings_nothing_settles_the_limits():
    reach = Reach(max_gets=64, max_bytes=1 << 30)
    grew = windows(reach, [100, 100, 102, 100, 100, 100], waiting=0.5)  # a busy store: no faster after a step
    assert grew == [False, True, False, False, False, False]
    assert (reach.gets, reach.bytes) == (2 * START_GETS, 2 * START_BYTES)


def test_no_growth_when_the_reader_hardly_waits_or_nothing_holds_the_fetcher_back():
    assert not any(windows(Reach(64, 1 << 30), [100] * 6, waiting=0.01))
    assert not any(windows(Reach(64, 1 << 30), [100] * 6, waiting=0.9, held_back=False))


def test_nothing_is_measured_before_the_first_hand_out_and_the_start_is_a_quarter_of_a_low_ceiling():
    reach = Reach(max_gets=4, max_bytes=8 * MiB)
    assert (reach.gets, reach.bytes) == (4, 2 * MiB)  # grown to the ceilings while the reader waits
    assert not reach.look(10.0, 5.0, 1000.0, True)  # no window started


def test_a_network_round_trip_starts_at_the_ceilings_and_a_nearby_one_at_the_start():
    far = Reach(max_gets=16, max_bytes=128 * MiB, round_trip=FAR)
    assert (far.gets, far.bytes) == (16, 128 * MiB)
    assert not any(windows(far, [100, 100, 200, 200], waiting=0.9))  # nothing left to grow
    near = Reach(max_gets=16, max_bytes=128 * MiB, round_trip=FAR / 4)
    assert (near.gets, near.bytes) == (START_GETS, START_BYTES)
    assert (Reach(4, 8 * MiB, round_trip=1.0).gets, Reach(4, 8 * MiB, round_trip=1.0).bytes) == (4, 8 * MiB)
