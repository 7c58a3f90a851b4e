"""Streaming uploads: ``ObjectWriter``, what ``Store.open_writer`` returns, sends an object
part by part while its caller produces the next part, on daemon threads; ``MultipartWriter``
is its S3 multipart upload, to which each S3 backend adds its four requests."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future
from contextlib import AbstractContextManager, suppress
from types import TracebackType
from typing import Generic, Protocol, TypeVar

from remote_loader.checks import require_int
from remote_loader.errors import StorageError
from remote_loader.storage.daemon import in_daemon_thread, wait_result

DEFAULT_PART_SIZE = 16 * 1024 * 1024
MIN_PART_SIZE = 5 * 1024 * 1024
"""S3 refuses multipart parts smaller than 5 MiB (except the last)."""
MAX_PART_SIZE = 5 * 1024**3
"""Nor does it take parts larger than 5 GiB."""


def check_part_size(part_size: object) -> int:
    """``part_size`` checked: an integer number of bytes S3 takes as a part."""
    return require_int("part_size (bytes)", part_size, MIN_PART_SIZE, MAX_PART_SIZE)


PARTS_IN_FLIGHT = 4
"""Parts of one streaming upload sent at once, while the next one fills."""


class ObjectWriter(ABC):
    """A streaming upload of one object: ``write`` chunks, then ``commit`` or ``abort``.

    A multipart upload starts only once a first full part exists; a small object gets one
    PUT. Full parts are sent on threads of the writer's own while the caller fills the
    next one, so encoding and sending overlap and a connection's bandwidth does not cap a
    shard's: at most ``PARTS_IN_FLIGHT`` parts are being sent and one filled (that many
    parts of memory, plus one). The request that creates the upload goes out on a thread
    too, and the parts wait for it there, not the caller; at commit the last part goes out
    with those still in flight. A part that failed raises at the next ``write`` or at
    ``commit``, and the writer aborts. Used as a context manager, it commits on
    success and aborts on an exception, so a failed upload never leaves a partial object
    under its key.
    """

    def __init__(self, bucket: str, key: str, part_size: int) -> None:
        self.bucket = bucket
        self.key = key
        self.part_size = check_part_size(part_size)
        self.size = 0
        self.acknowledged = 0  # bytes the store answered for: of parts sent, or of the object put whole
        self._buffer = bytearray()
        self._parts = 0
        self._creating: Future[None] | None = None  # the request creating the multipart upload
        self._done = False
        self._sending: deque[Future[None]] = deque()
        self._failed: BaseException | None = None  # a part that could not be sent

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``; full parts are sent as they fill."""
        if self._done:
            raise ValueError(f"writer for s3://{self.bucket}/{self.key} is already finished")
        with memoryview(data) as given, given.cast("B") as view:  # bytes, whatever the buffer's item type
            self.size += len(view)
            # Parts are cut from ``data`` as they fill: a member larger than a part is never
            # held whole in the buffer beside the caller's copy (a 300 MB one was).
            taken = 0
            while len(self._buffer) + len(view) - taken >= self.part_size:
                if self._buffer:
                    end = taken + self.part_size - len(self._buffer)
                    self._buffer += view[taken:end]
                    part, self._buffer = bytes(self._buffer), bytearray()
                else:
                    end = taken + self.part_size
                    part = bytes(view[taken:end])  # one copy, straight from the caller's bytes
                taken = end
                self._send(part)
            self._buffer += view[taken:]

    def _send(self, part: bytes) -> None:
        """Send ``part`` on one of the writer's threads, once fewer than ``PARTS_IN_FLIGHT`` are."""
        if self._creating is None:
            self._creating = in_daemon_thread(self._start, "remote-loader-part")
        try:
            self._sent(PARTS_IN_FLIGHT - 1)
        except BaseException as error:
            self._failed = error
            # The object cannot be whole any more: free what the store holds for it, unless
            # this is Ctrl-C while parts hang. The error in flight says more than a failed abort.
            with suppress(StorageError):
                self.abort(interrupted=not isinstance(error, Exception))
            raise
        self._part(part)

    def _part(self, part: bytes) -> None:
        """Send ``part`` as the next part, on a thread that waits for the upload to exist."""
        assert self._creating is not None
        self._parts += 1
        creating, number = self._creating, self._parts

        def send() -> None:
            creating.result()  # a failed create fails every part with its error
            self._upload_part(number, part)
            self.acknowledged += len(part)

        self._sending.append(in_daemon_thread(send, "remote-loader-part"))

    def _created(self) -> bool:
        """Whether the multipart upload was created (waiting for the request if it is out)."""
        if self._creating is None:
            return False
        try:
            wait_result(self._creating)
            return True
        except Exception:
            return False

    def _sent(self, leave: int = 0) -> None:
        """Wait until at most ``leave`` parts are being sent, oldest first; raise the error of one that failed."""
        while len(self._sending) > leave:
            wait_result(self._sending.popleft())

    def _stop_sending(self) -> None:
        """Wait for the parts being sent, whatever their fate."""
        while self._sending:
            with suppress(Exception):
                wait_result(self._sending.popleft())

    def commit(self) -> None:
        """Send what is buffered and make the object visible under its key."""
        if self._failed is not None:
            raise StorageError(f"s3://{self.bucket}/{self.key} cannot be committed: a part failed ({self._failed})",
                               bucket=self.bucket, key=self.key)
        if self._done:
            return
        self._done = True
        tail, self._buffer = bytes(self._buffer), bytearray()
        if self._creating is None:
            self._put_whole(tail)
            self.acknowledged += len(tail)
            return
        try:
            if tail:  # with the parts still on their way: each may take a connection's bandwidth
                self._part(tail)
            self._sent()
            self._complete()
        except BaseException as error:
            self._failed = error
            if not isinstance(error, Exception):  # Ctrl-C: as abort(interrupted=True)
                self._sending.clear()
                raise
            self._stop_sending()
            if self._created():
                with suppress(StorageError):
                    self._abort_upload()
            raise

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
        if self._created():
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


class WritingStore(Protocol):
    """What a ``MultipartWriter`` asks of its store: a whole-object PUT, and the context that
    translates the store's SDK exceptions into ours."""

    def put(self, bucket: str, key: str, data: bytes | bytearray | memoryview) -> None: ...

    def _errors(self, operation: str, bucket: str | None = None,
                key: str | None = None) -> AbstractContextManager[None]: ...


StoreT = TypeVar("StoreT", bound=WritingStore)
PartT = TypeVar("PartT")


class MultipartWriter(ObjectWriter, Generic[StoreT, PartT]):
    """An ``ObjectWriter`` on an S3 multipart upload of ``store``. A backend supplies its four
    requests (``_create_request``, ``_part_request``, ``_complete_request``, ``_abort_request``);
    each runs here under the store's exception translation, and what each part's request
    answered (a ``PartT``) is kept for the completion."""

    def __init__(self, store: StoreT, bucket: str, key: str, part_size: int) -> None:
        super().__init__(bucket, key, part_size)
        self._store = store
        self._upload_id = ""
        self._answers: list[tuple[int, PartT]] = []  # (part number, what its request answered), as they finished

    def _put_whole(self, data: bytes) -> None:
        self._store.put(self.bucket, self.key, data)

    def _start(self) -> None:
        with self._store._errors("create multipart upload", self.bucket, self.key):
            self._upload_id = self._create_request()

    def _upload_part(self, number: int, part: bytes) -> None:
        with self._store._errors("upload part", self.bucket, self.key):
            sent = self._part_request(number, part)
        self._answers.append((number, sent))

    def _complete(self) -> None:
        with self._store._errors("complete multipart upload", self.bucket, self.key):
            self._complete_request(sorted(self._answers, key=lambda p: p[0]))

    def _abort_upload(self) -> None:
        with self._store._errors("abort multipart upload", self.bucket, self.key):
            self._abort_request()

    @abstractmethod
    def _create_request(self) -> str:
        """Create the multipart upload; return its upload id."""

    @abstractmethod
    def _part_request(self, number: int, part: bytes) -> PartT:
        """Send part ``number`` of the upload ``self._upload_id``; return what completing it needs of the part."""

    @abstractmethod
    def _complete_request(self, parts: list[tuple[int, PartT]]) -> None:
        """Complete the upload from its ``parts`` (number, what its request answered), by number."""

    @abstractmethod
    def _abort_request(self) -> None:
        """Abort the upload ``self._upload_id``."""
