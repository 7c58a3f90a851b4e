"""The storage interface every backend implements: bytes in and out of buckets, nothing more.

Backends translate their SDK's exceptions into ``remote_loader.errors`` types at this
boundary; callers catch types, never match messages.
"""

from __future__ import annotations

import base64
import os
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from remote_loader.checks import as_index
from remote_loader.checksum import crc32
from remote_loader.errors import (
    AccessDenied,
    BucketNotFound,
    InvalidRange,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
    TransientStorageError,
)
from remote_loader.storage.contact import answered, note_answer
from remote_loader.storage.writer import DEFAULT_PART_SIZE, MIN_PART_SIZE, ObjectWriter

__all__ = ["BUCKET_NAME_RULE", "DEFAULT_PART_SIZE", "MIN_PART_SIZE", "ObjectInfo", "ObjectWriter", "RangedStore",
           "Store", "bucket_name_problem", "check_range", "error_for",
           "place"]


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its key, its size and, where the store lists one, its version tag
    (``etag``: S3's ETag; a local file's write time, size and inode), which a ranged read may
    name to be refused once the object is written again (``get_range_into(if_match=...)``).
    On S3 it is the tag ``get_versioned`` gives and ``put(if_match=...)`` takes; a local
    directory's listing gives its own kind, not those (an MD5 of the bytes, which a listing
    would have to read every file for)."""

    key: str
    size: int
    etag: str = ""


def byte_bounds(start: object, end: object) -> tuple[int, int]:
    """A byte range's ``start`` and ``end`` as ints (numpy's too), or a TypeError naming them:
    a float was sent as ``Range: bytes=1.5-2``, True read from byte 1; a ValueError for a
    negative start."""
    first, stop = as_index(start, "a byte range's start"), as_index(end, "a byte range's end")
    if first < 0:
        raise ValueError(f"a byte range's start is >= 0, got {first}")
    return first, stop


def check_range(bucket: str, key: str, start: int, end: int, data: bytes, got: int | None = None) -> bytes:
    """Return ``data`` if it holds exactly ``end - start`` bytes (or ``got`` says so), else
    raise ``InvalidRange``: a whole answer with fewer bytes than asked for means the object
    ends before ``end`` (a body cut off by the network raises a transient error on its
    own). Not retried: the store answered, the object is shorter."""
    received = len(data) if got is None else got
    if received != end - start:
        raise InvalidRange(
            f"{place(bucket, key)} ends before byte {end}: bytes {start}-{end - 1} asked for, {received} of"
            f" {end - start} received",
            bucket=bucket,
            key=key,
            code="ShortRead",
        )
    return data


_FIRST_BYTE = re.compile(r"\s*bytes\s+(\d+)\s*-", re.IGNORECASE)  # a range unit is case-insensitive (RFC 9110)


def check_answer(bucket: str, key: str, start: int, end: int, content_range: str | None) -> None:
    """Raise ``StorageError`` (code ``RangeIgnored``) unless the answer to a GET of bytes
    ``[start, end)`` starts at ``start``: a 206 whose ``Content-Range`` says so, or the whole
    object (a 200, no ``Content-Range``) for a range from byte 0. A server, or a proxy before
    it, that ignores ``Range`` sends every object from its first byte: taken for the range,
    those bytes would stand where others belong. Not retried: it answers so every time."""
    if content_range is None:
        if start == 0:
            return
        answered = "the whole object"
    else:
        first = _FIRST_BYTE.match(content_range)
        if first is not None and int(first.group(1)) == start:
            return
        answered = f"Content-Range {content_range[:80]!r}"
    raise StorageError(
        f"{place(bucket, key)}: a GET of bytes {start}-{end - 1} was answered with {answered}: the server, or a"
        " proxy before it, ignores HTTP Range requests, which reading a dataset needs",
        bucket=bucket,
        key=key,
        code="RangeIgnored",
    )


_CONNECT_LOCK = threading.Lock()
if hasattr(os, "register_at_fork"):  # Windows has no fork
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

    def path_of(self, bucket: str, prefix: str) -> str:
        """The local path of a dataset's folder, for messages; "" for a store that is not a
        directory (its datasets are named ``s3://bucket/prefix``)."""
        return ""

    @abstractmethod
    def get(self, bucket: str, key: str) -> bytes:
        """Return the whole object."""

    @abstractmethod
    def get_range(self, bucket: str, key: str, start: int, end: int) -> bytes:
        """Return bytes ``[start, end)`` of the object; exactly ``end - start`` bytes or an error."""

    def get_range_into(self, bucket: str, key: str, start: int, end: int, out: memoryview, *,
                       if_match: str | None = None) -> None:
        """Read bytes ``[start, end)`` of the object into ``out`` (exactly that long), or raise.
        With ``if_match`` (a version tag its listing gave, ``ObjectInfo.etag``), raise
        ``PreconditionFailed`` if the object was written since: the parts of one read then
        all come from one version of it.

        Backends that can receive straight into ``out`` override this; the default copies,
        and cannot honour ``if_match``.
        """
        out[:] = self.get_range(bucket, key, start, end)

    def get_first_bytes(self, bucket: str, key: str, length: int) -> tuple[bytes, int]:
        """Return the first ``length`` bytes of the object (all of it if shorter) and the
        object's size: a reader of a large object learns how to split the rest of it.

        The default makes a HEAD and a ranged GET; the S3 backends make one GET and read
        the size from its ``Content-Range``.
        """
        size = self.head(bucket, key)
        return self.get_range(bucket, key, 0, min(length, size)), size

    def get_range_and_size(self, bucket: str, key: str, start: int, end: int, *,
                           if_match: str | None = None) -> tuple[bytes, int]:
        """Return bytes ``[start, end)`` of the object and the object's size, so a reader
        checks a size it was told (a manifest's) against the object's own before using it.
        With ``if_match`` (a version tag its listing gave), raise ``PreconditionFailed`` if
        the object was written since: the bytes and the size are then that version's. An
        empty range reads nothing: its size is the object's, whatever its version.

        The default makes a HEAD and a ranged GET (``get_range_into`` with ``if_match``, the
        HEAD first: a version written after it fails the GET); the S3 backends make one
        GET and read the size from its ``Content-Range``.
        """
        if if_match is None:
            return self.get_range(bucket, key, start, end), self.head(bucket, key)
        start, end = byte_bounds(start, end)
        size = self.head(bucket, key)
        out = bytearray(max(end - start, 0))
        self.get_range_into(bucket, key, start, end, memoryview(out), if_match=if_match)
        return bytes(out), size

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

    def connect(self) -> None:  # noqa: B027 - a store without a client has nothing to make
        """Make this process's client now, without a request, so that a request can be timed alone."""

    def close(self) -> None:  # noqa: B027 - a store holding no connection has nothing to release
        """Release connections held by this process."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



class RangedStore(Store):
    """A store whose reads are HTTP GETs with an optional ``Range`` header (the S3 backends).

    Its SDK client is created lazily in each process (after a fork, or in a spawned worker
    that unpickled the store) and dropped when the store is pickled. A store made around a
    caller's own SDK client (``as_store``, which every dataset and upload call applies to the
    client it is given) uses that client in the process that gave it, and makes its own in
    any other.
    """

    def __init__(self) -> None:
        self._sdk_client: Any = None
        self._pid = -1
        self._borrowed = False  # made around a caller's client (``lend``)

    def lend(self, client: Any) -> None:
        """Use the caller's SDK ``client`` for this store's requests in this process. It is
        the caller's: never closed here, never pickled; another process (a DataLoader or
        upload worker, forked or spawned) makes a client of its own for the same endpoint
        and region, with the credentials of its environment."""
        self._sdk_client, self._pid, self._borrowed = client, os.getpid(), True

    def _borrowed_elsewhere(self) -> str:
        """Why a store made around a caller's client has no credentials in this process."""
        return (f"the {type(self).__name__.removesuffix('Store').lower()} client passed to remote_loader was made in"
                f" another process and cannot be sent to this one (pid {os.getpid()}: a DataLoader or upload worker):"
                f" here a client of its own is made for {self.endpoint}, with credentials from the environment"
                " (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE), and none are set; pass"
                " remote_loader.make_client(endpoint, access_key, secret_key) instead, whose keys travel, or use"
                " num_workers=0 (upload: workers=0)")

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
        state["_answered"] = answered(self.endpoint)  # into a spawned worker: see storage/contact.py
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        had_answered = state.pop("_answered", False)
        self.__dict__.update(state)
        if had_answered:
            note_answer(self.endpoint)

    def connect(self) -> None:
        self._sdk()

    def close(self) -> None:
        if not (self._borrowed and self._pid == os.getpid()):  # a caller's client stays theirs to close
            self._sdk_client = None

    def _own_client(self) -> Any:
        """This process's client if the store made it (None for a caller's), to close."""
        return None if self._sdk_client is None or (self._borrowed and self._pid == os.getpid()) else self._sdk_client

    @abstractmethod
    def _read(self, bucket: str, key: str, byte_range: str | None,
              if_match: str | None = None) -> tuple[bytes, str | None]:
        """GET the object, or the part ``byte_range`` (an HTTP Range value) names, of version
        ``if_match`` where it is given (``PreconditionFailed`` for another); with the
        response's ``Content-Range`` header, if it has one."""

    def get(self, bucket: str, key: str) -> bytes:
        return self._read(bucket, key, None)[0]

    def get_range(self, bucket: str, key: str, start: int, end: int) -> bytes:
        start, end = byte_bounds(start, end)
        if end <= start:
            return b""
        data, content_range = self._read(bucket, key, f"bytes={start}-{end - 1}")
        check_answer(bucket, key, start, end, content_range)
        return check_range(bucket, key, start, end, data[: end - start])

    def get_range_and_size(self, bucket: str, key: str, start: int, end: int, *,
                           if_match: str | None = None) -> tuple[bytes, int]:
        start, end = byte_bounds(start, end)
        if end <= start:
            return b"", self.head(bucket, key)
        data, content_range = self._read(bucket, key, f"bytes={start}-{end - 1}", if_match)
        check_answer(bucket, key, start, end, content_range)
        if content_range is None:  # a 200: the server sent the whole object
            size = len(data)
        else:
            total = content_range.rpartition("/")[2]
            size = int(total) if total.isdigit() else self.head(bucket, key)
        return check_range(bucket, key, start, end, data[: end - start]), size

    def get_first_bytes(self, bucket: str, key: str, length: int) -> tuple[bytes, int]:
        length = as_index(length, "get_first_bytes' length")
        if length <= 0:
            return b"", self.head(bucket, key)
        try:
            data, content_range = self._read(bucket, key, f"bytes=0-{length - 1}")
        except InvalidRange:  # the object is empty: no byte 0 to start from
            size = self.head(bucket, key)
            if size:
                raise InvalidRange(f"{place(bucket, key)}: the store answered that byte 0 lies outside the object, yet"
                                   f" it is {size:,d} bytes: the store, or a proxy before it, answered wrongly",
                                   bucket=bucket, key=key, code="InvalidRange") from None
            return b"", 0
        total = content_range.rpartition("/")[2] if content_range else ""
        if total.isdigit():
            size = int(total)
        elif content_range is None:  # a 200: the server sent the whole object
            size = len(data)
        else:  # a size the server did not know ("*")
            size = self.head(bucket, key)
        return check_range(bucket, key, 0, min(length, size), data[:length]), size

_ACCESS_CODES = {"AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken", "ExpiredToken",
                 "AllAccessDisabled"}
_TRANSIENT_CODES = {
    "BadDigest",  # the body's checksum (x-amz-checksum-crc32) did not match: damaged on the way, sent again
    "XAmzContentChecksumMismatch",
    "SlowDown",
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "RequestTimeTooSkewed",
}


def crc32_header(data: bytes | bytearray | memoryview) -> str:
    """A body's ``x-amz-checksum-crc32``: its crc32, big-endian, base64. Servers that check
    it (AWS S3, MinIO, SeaweedFS) refuse a body damaged on the way (``BadDigest``)."""
    return base64.b64encode(crc32(data).to_bytes(4, "big")).decode()


BUCKET_NAME_RULE = (
    "S3 bucket names have 3-63 characters: lowercase letters, digits, dots and hyphens, beginning and ending"
    " with a letter or digit"
)
_BUCKET_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789.-")


def bucket_name_problem(bucket: str) -> str | None:
    """What keeps ``bucket`` from being an S3 bucket name (``BUCKET_NAME_RULE``), or None:
    ``'ab' has 2 characters``. Stores judge for themselves; this explains their refusal."""
    if not 3 <= len(bucket) <= 63:
        return f"{bucket!r} has {len(bucket)} character{'' if len(bucket) == 1 else 's'}"
    others = [c for c in dict.fromkeys(bucket) if c not in _BUCKET_CHARACTERS]
    if others:
        return f"{bucket!r} holds {', '.join(map(repr, others))}"
    for end, c in (("begins", bucket[0]), ("ends", bucket[-1])):
        if c in ".-":
            return f"{bucket!r} {end} with {c!r}"
    return None


def object_length(bucket: str, key: str, length: object) -> int:
    """The ``Content-Length`` of an answer to HEAD, which must hold one (a proxy may drop it)."""
    if length is None:
        raise StorageError(f"{place(bucket, key)}: the store answered HEAD without Content-Length, which names the"
                           " object's size (a proxy before it may drop it)", bucket=bucket, key=key,
                           code="NoContentLength")
    return int(length)  # type: ignore[call-overload]


def place(bucket: str | None, key: str | None = None) -> str:
    """``s3://bucket/key`` for a message; its ``repr`` where the names hold a control character
    (a newline, an escape sequence), which a message shows escaped, never as it is."""
    where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}" if bucket else "the store"
    return where if where.isprintable() else repr(where)


def error_for(
    code: str, status: int | None, *, operation: str, bucket: str | None, key: str | None, endpoint: str | None
) -> StorageError:
    """Map an S3 error code and HTTP status to one of our exception types, with a one-line message."""
    where = place(bucket, key)
    args = {"bucket": bucket, "key": key, "code": code}
    problem = bucket_name_problem(bucket) if bucket is not None else None
    if code == "InvalidBucketName":
        return StorageError(f"{where}: {operation} refused, the bucket's name is not one S3 allows"
                            f"{f': {problem}' if problem else ''}; {BUCKET_NAME_RULE}", **args)
    if code == "NoSuchBucket":
        return BucketNotFound(f"bucket {bucket!r} does not exist at {endpoint} ({operation})"
                              + (f", nor can it: {problem}; {BUCKET_NAME_RULE}" if problem else ""), **args)
    if code in ("NoSuchKey", "NotFound", "NoSuchUpload") or status == 404:
        return ObjectNotFound(f"{where} does not exist ({operation})", **args)
    if code in _ACCESS_CODES or status == 403:
        return AccessDenied(
            f"access denied to {where} at {endpoint} ({operation}, {code}): check the access key, secret and rights",
            **args,
        )
    if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
        return PreconditionFailed(
            f"{where}: the object changed or exists; a conditional {operation} was refused", **args
        )
    if code == "InvalidRange" or status == 416:
        return InvalidRange(f"{where}: requested range lies outside the object ({operation})", **args)
    if code == "NotImplemented" or status == 501:
        return StorageError(f"{where}: the store does not implement {operation}", **args)
    if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):  # 429: a rate limit
        return TransientStorageError(f"{where}: store answered {code or status} ({operation}); retry later", **args)
    return StorageError(f"{where}: {operation} failed with {code or status}", **args)
