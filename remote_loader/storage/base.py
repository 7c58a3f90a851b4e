"""The storage interface every backend implements: bytes in and out of buckets, nothing more.

Backends translate their SDK's exceptions into ``remote_loader.errors`` types at this
boundary; callers catch types, never match messages.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

from remote_loader.errors import (
    AccessDenied,
    BucketNotFound,
    ConfigError,
    InvalidRange,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
    TransientStorageError,
)

T = TypeVar("T")

DEFAULT_PART_SIZE = 16 * 1024 * 1024
MIN_PART_SIZE = 5 * 1024 * 1024
"""S3 refuses multipart parts smaller than 5 MiB (except the last)."""


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object."""

    key: str
    size: int


def check_range(bucket: str, key: str, start: int, end: int, data: bytes, got: int | None = None) -> bytes:
    """Return ``data`` if it holds exactly ``end - start`` bytes (or ``got`` says so), else raise a retryable error."""
    received = len(data) if got is None else got
    if received != end - start:
        raise TransientStorageError(
            f"short read of s3://{bucket}/{key} bytes {start}-{end - 1}: got {received} of {end - start} bytes",
            bucket=bucket,
            key=key,
            code="ShortRead",
        )
    return data


def in_daemon_thread(call: Callable[[], T], name: str = "remote-loader-request") -> Future[T]:
    """Run ``call`` in a daemon thread of its own. Not a ThreadPoolExecutor: the interpreter
    joins those at exit, so one stuck in a request to a hung server would delay Ctrl-C."""
    future: Future[T] = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


PARTS_IN_FLIGHT = 4
"""Parts of one streaming upload sent at once, while the next one fills."""


class ObjectWriter(ABC):
    """A streaming upload of one object: ``write`` chunks, then ``commit`` or ``abort``.

    A multipart upload starts only once a first full part exists; a small object gets one
    PUT. Full parts are sent on threads of the writer's own while the caller fills the
    next one, so encoding and sending overlap and a connection's bandwidth does not cap a
    shard's: at most ``PARTS_IN_FLIGHT`` parts are being sent and one filled (that many
    parts of memory, plus one). A part that failed raises at the next ``write`` or at
    ``commit``, and the writer aborts. Used as a context manager, it commits on
    success and aborts on an exception, so a failed upload never leaves a partial object
    under its key.
    """

    def __init__(self, bucket: str, key: str, part_size: int) -> None:
        if part_size < MIN_PART_SIZE:
            raise ConfigError(f"part_size must be >= {MIN_PART_SIZE} bytes, got {part_size}")
        self.bucket = bucket
        self.key = key
        self.part_size = part_size
        self.size = 0
        self._buffer = bytearray()
        self._parts = 0
        self._started = False
        self._done = False
        self._sending: deque[Future[None]] = deque()
        self._failed: BaseException | None = None  # a part that could not be sent

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``; full parts are sent as they fill."""
        if self._done:
            raise ValueError(f"writer for s3://{self.bucket}/{self.key} is already finished")
        self._buffer += data
        self.size += len(data)
        while len(self._buffer) >= self.part_size:
            part = bytes(self._buffer[: self.part_size])
            del self._buffer[: self.part_size]
            self._send(part)

    def _send(self, part: bytes) -> None:
        """Send ``part`` on one of the writer's threads, once fewer than ``PARTS_IN_FLIGHT`` are."""
        if not self._started:
            self._start()
            self._started = True
        try:
            self._sent(PARTS_IN_FLIGHT - 1)
        except BaseException as error:
            self._failed = error
            self.abort()  # the object cannot be whole any more: free what the store holds for it
            raise
        self._parts += 1
        self._sending.append(in_daemon_thread(partial(self._upload_part, self._parts, part), "remote-loader-part"))

    def _sent(self, leave: int = 0) -> None:
        """Wait until at most ``leave`` parts are being sent, oldest first; raise the error of one that failed."""
        while len(self._sending) > leave:
            self._sending.popleft().result()

    def _stop_sending(self) -> None:
        """Wait for the parts being sent, whatever their fate."""
        while self._sending:
            with suppress(Exception):
                self._sending.popleft().result()

    def commit(self) -> None:
        """Send what is buffered and make the object visible under its key."""
        if self._failed is not None:
            raise StorageError(f"s3://{self.bucket}/{self.key} cannot be committed: a part failed ({self._failed})",
                               bucket=self.bucket, key=self.key)
        if self._done:
            return
        self._done = True
        tail, self._buffer = bytes(self._buffer), bytearray()
        if not self._started:
            self._put_whole(tail)
            return
        try:
            self._sent()
            if tail:
                self._parts += 1
                self._upload_part(self._parts, tail)
            self._complete()
        except BaseException as error:
            self._failed = error
            self._stop_sending()
            with suppress(StorageError):
                self._abort_upload()
            raise
        finally:
            self._stop_sending()

    def abort(self, *, interrupted: bool = False) -> None:
        """Drop everything written; no object appears.

        ``interrupted`` (Ctrl-C, a process being stopped): return at once, neither waiting
        for parts being sent nor asking the store to drop what it holds, which a store that
        hangs would make wait until the outage deadline. The next upload of the prefix, or
        ``Store.abort_uploads``, drops it.
        """
        if self._done:
            return
        self._done = True
        self._buffer = bytearray()
        if interrupted:
            self._sending.clear()
            return
        self._stop_sending()
        if self._started:
            self._abort_upload()

    @abstractmethod
    def _put_whole(self, data: bytes) -> None:
        """Store a small object in one PUT."""

    @abstractmethod
    def _start(self) -> None:
        """Create the multipart upload."""

    @abstractmethod
    def _upload_part(self, number: int, part: bytes) -> None:
        """Upload part ``number`` (from 1); parts are sent from several threads at once, in
        any order. Every part but the last is ``part_size`` bytes."""

    @abstractmethod
    def _complete(self) -> None:
        """Complete the multipart upload: the object appears."""

    @abstractmethod
    def _abort_upload(self) -> None:
        """Abandon the multipart upload and free what the store holds for it."""

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()
            return
        with suppress(StorageError):  # the exception in flight says more than a failed clean-up
            self.abort(interrupted=not issubclass(exc_type, Exception))


_CONNECT_LOCK = threading.Lock()
os.register_at_fork(after_in_child=lambda: globals().update(_CONNECT_LOCK=threading.Lock()))


class Store(ABC):
    """An object store: buckets of keys holding bytes.

    Instances pickle (for DataLoader and upload workers).
    """

    list_page_size = 1000
    """Keys per LIST request where the SDK lets us choose (boto3)."""

    @property
    def endpoint(self) -> str:
        """Where the store is, for messages (never with credentials)."""
        return type(self).__name__

    @abstractmethod
    def get(self, bucket: str, key: str) -> bytes:
        """Return the whole object."""

    @abstractmethod
    def get_range(self, bucket: str, key: str, start: int, end: int) -> bytes:
        """Return bytes ``[start, end)`` of the object; exactly ``end - start`` bytes or an error."""

    def get_range_into(self, bucket: str, key: str, start: int, end: int, out: memoryview) -> None:
        """Read bytes ``[start, end)`` of the object into ``out`` (exactly that long), or raise.

        Backends that can receive straight into ``out`` override this; the default copies.
        """
        out[:] = self.get_range(bucket, key, start, end)

    @abstractmethod
    def get_tail(self, bucket: str, key: str, length: int) -> bytes:
        """Return the last ``length`` bytes of the object (all of it if shorter)."""

    def get_first_bytes(self, bucket: str, key: str, length: int) -> tuple[bytes, int]:
        """Return the first ``length`` bytes of the object (all of it if shorter) and the
        object's size: a reader of a large object learns how to split the rest of it.

        The default makes a HEAD and a ranged GET; the S3 backends make one GET and read
        the size from its ``Content-Range``.
        """
        size = self.head(bucket, key)
        return self.get_range(bucket, key, 0, min(length, size)), size

    @abstractmethod
    def head(self, bucket: str, key: str) -> int:
        """Return the object's size in bytes."""

    @abstractmethod
    def get_versioned(self, bucket: str, key: str) -> tuple[bytes, str]:
        """Return the whole object and its version tag (the ETag), for ``put(if_match=...)``."""

    @abstractmethod
    def put(self, bucket: str, key: str, data: bytes | bytearray | memoryview, *,
            if_none_match: bool = False, if_match: str | None = None) -> None:
        """Store ``data`` under ``key`` in one request (atomic: readers see old or new).

        A conditional write (S3's ``If-None-Match: *`` and ``If-Match``) raises
        ``PreconditionFailed`` when ``if_none_match`` is set and the object exists, or when
        ``if_match`` is not the object's current version tag. A server that ignores the
        conditions writes anyway: see docs on concurrent uploads.
        """

    @abstractmethod
    def open_writer(self, bucket: str, key: str, *, part_size: int = DEFAULT_PART_SIZE) -> ObjectWriter:
        """Start a streaming (multipart) upload of ``key``."""

    @abstractmethod
    def list(self, bucket: str, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Yield every object whose key starts with ``prefix``, in key order, across pages;
        with ``start_after``, only those whose key sorts after it (S3's ``StartAfter``)."""

    @abstractmethod
    def delete(self, bucket: str, key: str) -> None:
        """Delete the object; deleting a missing object is not an error."""

    @abstractmethod
    def abort_uploads(self, bucket: str, prefix: str = "") -> int:
        """Abort unfinished multipart uploads under ``prefix``; return how many."""

    @abstractmethod
    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` if it does not exist."""

    def exists(self, bucket: str, key: str) -> bool:
        """Return whether the object exists."""
        try:
            self.head(bucket, key)
        except ObjectNotFound:
            return False
        return True

    def close(self) -> None:
        """Release connections held by this process."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



class RangedStore(Store):
    """A store whose reads are HTTP GETs with an optional ``Range`` header (the S3 backends).

    Its SDK client is created lazily in each process (after a fork, or in a spawned worker
    that unpickled the store) and dropped when the store is pickled.
    """

    def __init__(self) -> None:
        self._sdk_client: Any = None
        self._pid = -1

    def _sdk(self) -> Any:
        """Return this process's SDK client, creating it on first use after a fork or unpickle.

        Threads asking at once share one new client: creating several would each load the
        SDK's service models, which takes long in a freshly started DataLoader worker.
        """
        if self._sdk_client is None or self._pid != os.getpid():
            with _CONNECT_LOCK:
                if self._sdk_client is None or self._pid != os.getpid():
                    self._sdk_client = self._connect()
                    self._pid = os.getpid()
        return self._sdk_client

    @abstractmethod
    def _connect(self) -> Any:
        """Create the SDK client."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_sdk_client"] = None
        state["_pid"] = -1
        return state

    def close(self) -> None:
        self._sdk_client = None

    @abstractmethod
    def _read(self, bucket: str, key: str, byte_range: str | None) -> tuple[bytes, str | None]:
        """GET the object, or the part ``byte_range`` (an HTTP Range value) names; with
        the response's ``Content-Range`` header, if it has one."""

    def get(self, bucket: str, key: str) -> bytes:
        return self._read(bucket, key, None)[0]

    def get_range(self, bucket: str, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        return check_range(bucket, key, start, end, self._read(bucket, key, f"bytes={start}-{end - 1}")[0])

    def get_tail(self, bucket: str, key: str, length: int) -> bytes:
        if length <= 0:
            return b""
        return self._read(bucket, key, f"bytes=-{length}")[0]

    def get_first_bytes(self, bucket: str, key: str, length: int) -> tuple[bytes, int]:
        if length <= 0:
            return b"", self.head(bucket, key)
        try:
            data, content_range = self._read(bucket, key, f"bytes=0-{length - 1}")
        except InvalidRange:  # the object is empty: no byte 0 to start from
            return b"", self.head(bucket, key)
        total = content_range.rpartition("/")[2] if content_range else ""
        if total.isdigit():
            size = int(total)
        elif content_range is None:  # a 200: the server sent the whole object
            size = len(data)
        else:  # a size the server did not know ("*")
            size = self.head(bucket, key)
        return check_range(bucket, key, 0, min(length, size), data[:length]), size

_ACCESS_CODES = {"AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken", "ExpiredToken", "AllAccessDisabled"}
_TRANSIENT_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling", "ThrottlingException", "RequestTimeTooSkewed"}


def error_for(
    code: str, status: int | None, *, operation: str, bucket: str | None, key: str | None, endpoint: str | None
) -> StorageError:
    """Map an S3 error code and HTTP status to one of our exception types, with a one-line message."""
    where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}" if bucket else "the store"
    args = {"bucket": bucket, "key": key, "code": code}
    if code == "NoSuchBucket":
        return BucketNotFound(f"bucket {bucket!r} does not exist at {endpoint} ({operation})", **args)
    if code in ("NoSuchKey", "NotFound", "NoSuchUpload") or status == 404:
        return ObjectNotFound(f"{where} does not exist ({operation})", **args)
    if code in _ACCESS_CODES or status == 403:
        return AccessDenied(
            f"access denied to {where} at {endpoint} ({operation}, {code}): check the access key, secret and rights",
            **args,
        )
    if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
        return PreconditionFailed(f"{where}: the object changed or exists; a conditional {operation} was refused", **args)
    if code == "InvalidRange" or status == 416:
        return InvalidRange(f"{where}: requested range lies outside the object ({operation})", **args)
    if code == "NotImplemented" or status == 501:
        return StorageError(f"{where}: the store does not implement {operation}", **args)
    if code in _TRANSIENT_CODES or (status is not None and status >= 500):
        return TransientStorageError(f"{where}: store answered {code or status} ({operation}); retry later", **args)
    return StorageError(f"{where}: {operation} failed with {code or status}", **args)
