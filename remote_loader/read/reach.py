"""How far a prefetcher reaches: its limits on GETs in flight and on bytes fetched ahead,
raised from what it measures.

It starts with up to 8 GETs and a budget of a quarter of its ceiling, 32 MiB at most.
After two windows of a quarter second running in which the reader spent more than 5% of
its time waiting for bytes while either limit held the fetcher back, it doubles both, up
to the configured ceilings, for as long as each step brings bytes in at least 10% faster.
Across a network each GET costs a round trip, and the limits grow until enough are in
flight to cover it (the bandwidth-delay product); on a nearby store that is busy, more
GETs bring nothing and the limits stay.

A reader whose first GET (its manifest's) took a network's round trip, 15 ms or more,
starts at the ceilings instead: growing from the start takes a second or more, a large
part of an epoch read from a few thousand samples' worth of shards.
"""

from __future__ import annotations

START_GETS = 8
START_BYTES = 32 * 1024 * 1024
WINDOW = 0.25  # seconds between looks
STARVED = 0.05  # the share of a window spent waiting that counts as starved
GROWTH = 2.0
PAYS = 1.1  # growing goes on while each step brings bytes in at least this much faster
FAR = 0.015  # a first GET this long is a network's (loopback: 5-6 ms, one request's client overhead included)


class Reach:
    """The limits and what they are raised from; not thread-safe (the prefetcher's lock
    guards it).

    Args:
        max_gets: Ceiling on GETs in flight (``FetchConfig.concurrency``).
        max_bytes: Ceiling on the budget (``FetchConfig.prefetch_bytes``).
        round_trip: Seconds the reader's first GET waited for its answer, if known.
    """

    def __init__(self, max_gets: int, max_bytes: int, round_trip: float | None = None) -> None:
        self.max_gets, self.max_bytes = max_gets, max_bytes
        self.gets = min(START_GETS, max_gets)
        self.bytes = min(START_BYTES, max(1, max_bytes // 4))
        self._window: tuple[float, float, float] | None = None  # (start, wait seconds, bytes received) then
        self._rate = 0.0  # bytes per second received in the last window
        self._starved = False  # the last window was starved
        self._grown = False  # the limits grew at the end of the last window
        self._settled = False  # growing stopped paying: the limits stay
        if round_trip is not None and round_trip >= FAR:  # across a network: no ramp
            self.gets, self.bytes, self._settled = max_gets, max_bytes, True

    def start(self, now: float, waited: float, received: float) -> None:
        """Begin measuring, at the first hand-out: waiting for the very first bytes is no
        sign of a slow store."""
        if self._window is None:
            self._window = (now, waited, received)

    def look(self, now: float, waited: float, received: float, held_back: bool) -> bool:
        """Given the reader's total wait seconds and the bytes received so far, and whether
        a limit holds the fetcher back now: end the window if it is over, and say whether
        the limits grew."""
        if self._window is None or self._settled or now - self._window[0] < WINDOW:
            return False
        started, waited_before, received_before = self._window
        self._window = (now, waited, received)
        rate, before = (received - received_before) / (now - started), self._rate
        self._rate = rate
        if self._grown:
            self._grown = False
            if rate < PAYS * before:  # the store, not the latency, is the limit: stay here
                self._settled = True
                return False
        starved = waited - waited_before >= STARVED * (now - started) and held_back
        self._starved, previous = starved, self._starved
        if not (starved and previous):  # two windows running: a stall at the start or a slow GET is no sign
            return False
        if (self.gets, self.bytes) == (self.max_gets, self.max_bytes):
            self._settled = True  # at the ceilings
            return False
        self._starved, self._grown = False, True
        self.gets = min(self.max_gets, int(self.gets * GROWTH))
        self.bytes = min(self.max_bytes, int(self.bytes * GROWTH))
        return True
