"""The one retry policy of every request the loader makes, and the refetch of damaged bytes.

A request that fails with a fault worth retrying (connection refused or reset, a timeout,
5xx, slow-down, a short read) is repeated with exponential backoff and full jitter until it
succeeds or until it has failed for ``FetchConfig.outage_deadline`` seconds: long enough to
ride out a server restart. Then ``EndpointUnreachable`` names the endpoint and how long it
was tried. The SDKs' own retries are off (``StorageConfig.max_attempts=1``), so attempts do
not multiply across layers. Waits between attempts end at once when the policy is
cancelled (an iterator being closed), so shutting down never waits for a backoff.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from remote_loader.config import FetchConfig
from remote_loader.errors import CorruptShard, EndpointUnreachable, StorageError, TransientStorageError
from remote_loader.read.metrics import Metrics

T = TypeVar("T")
P = TypeVar("P")

log = logging.getLogger("remote_loader")

_RETRYABLE = (TransientStorageError, EndpointUnreachable)
_NOTICE_SECONDS = 1.0  # a request failing this long means an outage, worth a log line


class Cancelled(Exception):
    """The request's consumer went away (its iterator was closed): stop retrying."""


class _Outages:
    """Per-process record of which endpoints are failing, for one log line at the start and
    one at the end of each outage rather than one per attempt."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}

    def failing(self, endpoint: str, since: float, error: BaseException, deadline: float) -> None:
        if time.monotonic() - since < _NOTICE_SECONDS:
            return
        with self._lock:
            if endpoint in self._since:
                return
            self._since[endpoint] = since
        log.warning("storage at %s is failing (%s); retrying for up to %.0f s (FetchConfig.outage_deadline)",
                    endpoint, error, deadline)

    def answered(self, endpoint: str) -> None:
        if not self._since:  # the common case: no outage, no lock
            return
        with self._lock:
            since = self._since.pop(endpoint, None)
        if since is not None:
            log.warning("storage at %s answers again after %.1f s", endpoint, time.monotonic() - since)


_OUTAGES = _Outages()
os.register_at_fork(after_in_child=lambda: globals().update(_OUTAGES=_Outages()))

_ANSWERED: set[str] = set()
"""Endpoints that answered a request in this process (or the parent it forked from): only
those get the full outage deadline; the others the first-contact deadline."""


@dataclass
class RetryPolicy:
    """Attempts, backoff with jitter and an outage deadline for requests to one endpoint.

    Args:
        config: ``backoff``, ``max_backoff``, ``outage_deadline`` and, for damaged bytes,
            ``max_attempts``.
        metrics: Where retries are counted.
        endpoint: Named in errors and log lines (never with credentials).
        cancel: Set it to make waiting requests give up at once with ``Cancelled``.
    """

    config: FetchConfig
    metrics: Metrics
    endpoint: str
    cancel: threading.Event = field(default_factory=threading.Event)

    def call(self, request: Callable[[], T], *, bucket: str | None = None, key: str | None = None) -> T:
        """Return ``request()``, repeating it on retryable faults until the outage deadline."""
        first_failure: float | None = None
        attempts = 0
        while True:
            if self.cancel.is_set():
                raise Cancelled()
            started = time.monotonic()
            try:
                result = request()
            except _RETRYABLE as error:
                attempts += 1
                first_failure = started if first_failure is None else first_failure
                failing = time.monotonic() - first_failure
                deadline, setting = self._deadline()
                _OUTAGES.failing(self.endpoint, first_failure, error, deadline)
                if failing >= deadline:
                    never = "" if self.endpoint in _ANSWERED else ", and it has never answered: check the endpoint URL"
                    raise EndpointUnreachable(
                        f"{self.endpoint} failed every request for {failing:.1f} s ({attempts} attempts, last: {error});"
                        f" gave up at FetchConfig.{setting}={deadline:g} s{never}",
                        bucket=bucket if bucket is not None else getattr(error, "bucket", None),
                        key=key if key is not None else getattr(error, "key", None),
                        code=getattr(error, "code", None),
                    ) from None
                self.metrics.add(retries=1)
                ceiling = min(self.config.max_backoff, self.config.backoff * 2 ** min(attempts - 1, 30))
                pause = min(random.uniform(0, ceiling), deadline - failing)
                if self.cancel.wait(pause):
                    raise Cancelled() from None
                continue
            except StorageError:
                _ANSWERED.add(self.endpoint)  # an error answer (404, 403...) is an answer
                raise
            _ANSWERED.add(self.endpoint)
            _OUTAGES.answered(self.endpoint)
            return result

    def _deadline(self) -> tuple[float, str]:
        """How long requests may fail, and the setting that says so."""
        config = self.config
        if self.endpoint in _ANSWERED or config.outage_deadline <= config.first_contact_deadline:
            return config.outage_deadline, "outage_deadline"
        return config.first_contact_deadline, "first_contact_deadline"

    def refetch(self, fetch: Callable[[], P], parse: Callable[[P], T]) -> T:
        """Return ``parse(fetch())``; bytes that ``parse`` finds damaged (``CorruptShard``)
        are fetched again, up to ``config.max_attempts`` fetches in all."""
        for attempt in range(1, self.config.max_attempts + 1):
            data = fetch()
            try:
                return parse(data)
            except CorruptShard:
                if attempt == self.config.max_attempts:
                    raise
                self.metrics.add(retries=1)
        raise AssertionError("unreachable")
