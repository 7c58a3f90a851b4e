"""Which endpoints have answered a request in this process: only those get the whole outage
deadline (``RetryConfig.outage_deadline``); one that never answered gets the first-contact
deadline, so a mistyped endpoint fails in seconds.

A forked process inherits the record; a store pickled into a spawned one (a DataLoader or
upload worker) carries whether its endpoint had answered, so the worker does not treat a
store its parent has used for hours as a stranger.
"""

from __future__ import annotations

_ANSWERED: set[str] = set()


def answered(endpoint: str) -> bool:
    """Whether ``endpoint`` answered a request in this process (or the one it came from)."""
    return endpoint in _ANSWERED


def note_answer(endpoint: str) -> None:
    """Record that ``endpoint`` answered (an error answer, a 404 or a 403, counts)."""
    _ANSWERED.add(endpoint)
