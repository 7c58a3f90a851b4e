"""The one retry policy of every request the library makes: a ``Store`` that retries.

A request that fails with a fault worth retrying (connection refused or reset, a timeout,
5xx, slow-down, a short read) is repeated with exponential backoff and full jitter until it
succeeds or until it has failed for ``RetryConfig.outage_deadline`` seconds: long enough to
ride out a server restart. Then ``EndpointUnreachable`` names the endpoint and how long it
was tried. An endpoint that has not answered once in this process gets
``first_contact_deadline`` instead. The SDKs' own retries are off
(``StorageConfig.max_attempts=1``), so attempts do not multiply across layers. Waits
between attempts end at once when the retry is cancelled (an iterator being closed), so
shutting down never waits for a backoff.

``RetryingStore`` wraps any store so that each of its requests runs under one ``Retry``;
the readers, the uploader and the indexer make their requests through one.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from remote_loader.checks import one_line
from remote_loader.config import RetryConfig
from remote_loader.errors import EndpointUnreachable, StorageError, TransientStorageError
from remote_loader.storage.base import DEFAULT_PART_SIZE, ObjectInfo, ObjectWriter, Store
from remote_loader.storage.contact import answered, note_answer

T = TypeVar("T")

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

    def failing(self, endpoint: str, since: float, error: BaseException, deadline: float, setting: str) -> None:
        if time.monotonic() - since < _NOTICE_SECONDS or not answered(endpoint):
            return  # a first contact fails within seconds, with an error that says it all
        with self._lock:
            if endpoint in self._since:
                return
            self._since[endpoint] = since
        never = "" if answered(endpoint) else ", and it has never answered"
        log.warning("storage at %s is failing (%s)%s; retrying for up to %g s (RetryConfig.%s)",
                    endpoint, error, never, deadline, setting)

    def answered(self, endpoint: str) -> None:
        if not self._since:  # the common case: no outage, no lock
            return
        with self._lock:
            since = self._since.pop(endpoint, None)
        if since is not None:
            log.warning("storage at %s answers again after %.1f s", endpoint, time.monotonic() - since)


_OUTAGES = _Outages()
if hasattr(os, "register_at_fork"):  # Windows has no fork
    os.register_at_fork(after_in_child=lambda: globals().update(_OUTAGES=_Outages()))

def _nothing() -> None:
    pass


@dataclass
class Retry:
    """Attempts, backoff with jitter and an outage deadline for requests to one endpoint.

    Args:
        config: Backoff and deadlines.
        where: The store the requests go to, or its endpoint: named in errors and log lines
            (never with credentials). A store is asked at each use: one may learn where it
            is only when it makes its client (boto3's endpoint from ``~/.aws/config``).
        cancel: Set it to make waiting requests give up at once with ``Cancelled``.
        on_retry: Called once per repeated attempt (to count retries).
    """

    config: RetryConfig
    where: str | Store
    cancel: threading.Event = field(default_factory=threading.Event)
    on_retry: Callable[[], None] = _nothing

    @property
    def endpoint(self) -> str:
        """The endpoint, as the store names it now."""
        return self.where if isinstance(self.where, str) else self.where.endpoint

    def call(self, request: Callable[[], T], *, bucket: str | None = None, key: str | None = None,
             afresh: Callable[[], bool] | None = None) -> T:
        """Return ``request()``, repeating it on retryable faults until the deadline.

        ``afresh`` makes ``request`` a unit of several requests and other work (an upload's
        task, which reads and encodes between them), asked after each failed attempt whether
        to time its outage afresh (the store answered the attempt's earlier requests: the
        task's ``_Attempts.afresh`` says when). Such a unit's outage is timed from the
        failure, not from the attempt's start: a fault in each of two tasks that outlast the
        deadline is no outage. One that fails at the same point every time still gives up at
        the deadline.
        """
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
                if afresh is None:
                    first_failure = started if first_failure is None else first_failure
                elif afresh() or first_failure is None:
                    first_failure = time.monotonic()
                failing = time.monotonic() - first_failure
                deadline, setting = self._deadline()
                _OUTAGES.failing(self.endpoint, first_failure, error, deadline, setting)
                if failing >= deadline:
                    raise EndpointUnreachable(
                        self._gave_up(error, failing, attempts, deadline, setting),
                        bucket=bucket if bucket is not None else getattr(error, "bucket", None),
                        key=key if key is not None else getattr(error, "key", None),
                        code=getattr(error, "code", None),
                    ) from None
                self.on_retry()
                ceiling = min(self.config.max_backoff, self.config.backoff * 2 ** min(attempts - 1, 30))
                pause = min(random.uniform(0, ceiling), deadline - failing)
                if self.cancel.wait(pause):
                    raise Cancelled() from None
                continue
            except StorageError:
                note_answer(self.endpoint)  # an error answer (404, 403...) is an answer
                raise
            endpoint = self.endpoint
            note_answer(endpoint)
            _OUTAGES.answered(endpoint)
            return result

    def _gave_up(self, error: BaseException, failing: float, attempts: int, deadline: float, setting: str) -> str:
        if setting == "first_contact_deadline":
            # Nothing ever answered: most likely a mistyped endpoint or a server not started.
            # The request it was (a range of a manifest) means nothing to the user.
            last = "" if isinstance(error, EndpointUnreachable) else f" (last: {one_line(error)})"
            check = ("no endpoint is set: set AWS_ENDPOINT_URL (or pass endpoint_url, the CLI's --endpoint-url) for"
                     " another server" if self.endpoint.startswith("AWS S3")
                     else "check the endpoint URL and that the server runs")
            return (
                f"cannot connect to {self.endpoint}: it has never answered, {attempts} attempts in"
                f" {failing:.1f} s{last}; {check} (RetryConfig.first_contact_deadline={deadline:g} s,"
                " or REMOTE_LOADER_FIRST_CONTACT_DEADLINE)"
            )
        return (
            f"{self.endpoint} failed every request for {failing:.1f} s ({attempts} attempts, last: {one_line(error)});"
            f" gave up at RetryConfig.{setting}={deadline:g} s (or REMOTE_LOADER_{setting.upper()})"
        )

    def _deadline(self) -> tuple[float, str]:
        """How long requests may fail, and the setting that says so."""
        config = self.config
        if answered(self.endpoint) or config.outage_deadline <= config.first_contact_deadline:
            return config.outage_deadline, "outage_deadline"
        return config.first_contact_deadline, "first_contact_deadline"


def _conditions(store: Store, name: str = "get_range_into") -> bool:
    """Whether ``store.<name>`` takes ``if_match``: a subclass written before it (a user's,
    overriding the method) reads without it, as a store that cannot condition a read."""
    method = getattr(type(store), name)
    known = _CONDITIONS.get(method)
    if known is None:
        parameters = inspect.signature(method).parameters
        known = _CONDITIONS[method] = "if_match" in parameters or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return known


_CONDITIONS: dict[Any, bool] = {}


class RetryingStore(Store):
    """``inner`` with every request run under ``retry``.

    A listing is yielded as its pages arrive; one that fails part-way goes on after the
    last key it yielded. A streaming upload retries each of its
    requests; its parts are kept in memory until sent, so a part is sent again as it was.
    """

    def __init__(self, inner: Store, retry: Retry) -> None:
        super().__init__()
        self.inner = inner
        self.retry = retry

    @property
    def endpoint(self) -> str:
        return self.inner.endpoint

    def __repr__(self) -> str:
        return f"RetryingStore({self.inner!r})"

    def path_of(self, bucket: str, prefix: str) -> str:
        return self.inner.path_of(bucket, prefix)

    def _call(self, method: str, bucket: str, key: str, *args: Any, **kwargs: Any) -> Any:
        """``inner.<method>(bucket, key, ...)`` under the retry: every one-request method."""
        request = partial(getattr(self.inner, method), bucket, key, *args, **kwargs)
        return self.retry.call(request, bucket=bucket, key=key)

    def get(self, bucket: str, key: str) -> bytes:
        return self._call("get", bucket, key)

    def get_range(self, bucket: str, key: str, start: int, end: int) -> bytes:
        return self._call("get_range", bucket, key, start, end)

    def get_range_into(self, bucket: str, key: str, start: int, end: int, out: memoryview, *,
                       if_match: str | None = None) -> None:
        if if_match is None or not _conditions(self.inner):  # a store of the user's may not know the keyword
            self._call("get_range_into", bucket, key, start, end, out)
        else:
            self._call("get_range_into", bucket, key, start, end, out, if_match=if_match)

    def get_range_and_size(self, bucket: str, key: str, start: int, end: int, *,
                           if_match: str | None = None) -> tuple[bytes, int]:
        if if_match is None:
            return self._call("get_range_and_size", bucket, key, start, end)
        if type(self.inner).get_range_and_size is Store.get_range_and_size \
                or not _conditions(self.inner, "get_range_and_size"):  # a HEAD, then the read naming the version
            return super().get_range_and_size(bucket, key, start, end, if_match=if_match)  # each request retried
        return self._call("get_range_and_size", bucket, key, start, end, if_match=if_match)

    def get_first_bytes(self, bucket: str, key: str, length: int) -> tuple[bytes, int]:
        return self._call("get_first_bytes", bucket, key, length)

    def head(self, bucket: str, key: str) -> int:
        return self._call("head", bucket, key)

    def exists(self, bucket: str, key: str) -> bool:
        return self._call("exists", bucket, key)

    def get_versioned(self, bucket: str, key: str) -> tuple[bytes, str]:
        return self._call("get_versioned", bucket, key)

    def put(self, bucket: str, key: str, data: bytes | bytearray | memoryview, *,
            if_none_match: bool = False, if_match: str | None = None) -> None:
        self._call("put", bucket, key, data, if_none_match=if_none_match, if_match=if_match)

    def open_writer(self, bucket: str, key: str, *, part_size: int = DEFAULT_PART_SIZE) -> ObjectWriter:
        return _RetryingWriter(self.inner.open_writer(bucket, key, part_size=part_size), self.retry)

    def list(self, bucket: str, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        # Lazy, page by page: a listing that fails part-way goes on after the last key it
        # yielded (S3's StartAfter), so a long listing survives faults between its pages.
        last = start_after
        pages: Iterator[ObjectInfo] | None = None

        def next_object() -> ObjectInfo | None:
            nonlocal pages
            if pages is None:
                pages = iter(self.inner.list(bucket, prefix, start_after=last))
            try:
                return next(pages, None)
            except BaseException:
                pages = None  # the next attempt lists again after ``last``
                raise

        while (found := self.retry.call(next_object, bucket=bucket)) is not None:
            last = found.key
            yield found

    def delete(self, bucket: str, key: str) -> None:
        self._call("delete", bucket, key)

    def abort_uploads(self, bucket: str, prefix: str = "") -> int:
        return self.retry.call(partial(self.inner.abort_uploads, bucket, prefix), bucket=bucket)

    def create_bucket(self, bucket: str) -> None:
        self.retry.call(partial(self.inner.create_bucket, bucket), bucket=bucket)

    def close(self) -> None:
        self.inner.close()


class _RetryingWriter(ObjectWriter):
    """An ``ObjectWriter`` whose requests (the inner writer's) each run under a retry."""

    def __init__(self, inner: ObjectWriter, retry: Retry) -> None:
        super().__init__(inner.bucket, inner.key, inner.part_size)
        self._inner, self._retry = inner, retry

    def _call(self, request: Callable[[], None]) -> None:
        self._retry.call(request, bucket=self.bucket, key=self.key)

    def _put_whole(self, data: bytes) -> None:
        self._call(partial(self._inner._put_whole, data))

    def _start(self) -> None:
        self._call(self._inner._start)

    def _upload_part(self, number: int, part: bytes) -> None:
        self._call(partial(self._inner._upload_part, number, part))

    def _complete(self) -> None:
        self._call(self._inner._complete)

    def _abort_upload(self) -> None:
        self._call(self._inner._abort_upload)
