"""The read path's requests: one retrying store per iteration, its metrics, and the refetch
of damaged bytes.

Retrying itself is the storage layer's (``storage.retrying``); what the read path adds is
counting (GETs, bytes, retries into ``Metrics``), cancelling (an iterator being closed
ends the waits of its requests), and ``refetch``: bytes that fail their checksum are
fetched again, up to ``FetchConfig.refetch_attempts`` fetches, a concern of the format
rather than of the store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from remote_loader.config import FetchConfig
from remote_loader.errors import CorruptShard, TruncatedShard
from remote_loader.read.metrics import Metrics
from remote_loader.storage import Store
from remote_loader.storage.retrying import Cancelled, Retry, RetryingStore

T = TypeVar("T")
P = TypeVar("P")

__all__ = ["Cancelled", "ReadSession"]


class ReadSession:
    """The requests of one reader or one iteration: ``store`` with every request retried
    under ``config.retry``, retries counted in ``metrics``, all of it ended by ``cancel``.

    Args:
        config: The fetch settings; ``config.retry`` drives the retries.
        metrics: Where GETs, bytes and retries are counted.
        store: The store the requests go to.
        cancel: Set it to make waiting requests give up at once with ``Cancelled``.
    """

    def __init__(self, config: FetchConfig, metrics: Metrics, store: Store,
                 cancel: threading.Event | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.cancel = cancel if cancel is not None else threading.Event()
        self.store = RetryingStore(store, Retry(config.retry, store.endpoint, self.cancel,
                                                on_retry=lambda: metrics.add(retries=1)))

    def refetch(self, fetch: Callable[[], P], parse: Callable[[P], T]) -> T:
        """Return ``parse(fetch())``; bytes that ``parse`` (or ``fetch`` itself) finds damaged
        (``CorruptShard``) are fetched again, up to ``config.refetch_attempts`` fetches in all.
        An object of the wrong size (``TruncatedShard``) is read once more only: a second
        answer of the same store settles it."""
        for attempt in range(1, self.config.refetch_attempts + 1):
            try:
                return parse(fetch())
            except CorruptShard as error:
                if attempt == self.config.refetch_attempts or (isinstance(error, TruncatedShard) and attempt >= 2):
                    raise
                self.metrics.add(retries=1)
        raise AssertionError("unreachable")
