"""The exception tree of remote_loader: every failure a caller can catch by type.

Each exception carries the facts as attributes (``bucket``, ``key``, ``offset``...) and a
one-line message. Secrets are never formatted into a message.
"""

from __future__ import annotations


def _rebuild(cls: type[RemoteLoaderError], message: str, state: dict[str, object]) -> RemoteLoaderError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class RemoteLoaderError(Exception):
    """Base class of every error raised by remote_loader."""

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only attributes survive the trip out of a worker process.
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


class ConfigError(RemoteLoaderError, ValueError):
    """An argument or configuration value is invalid."""


# --------------------------------------------------------------------------- storage


class StorageError(RemoteLoaderError):
    """A request to the object store failed.

    Attributes:
        bucket: The bucket of the request, if any.
        key: The object key of the request, if any.
        code: The store's error code (``NoSuchKey``, ``SlowDown``...), if any.
    """

    def __init__(
        self, message: str, *, bucket: str | None = None, key: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.key = key
        self.code = code


class ObjectNotFound(StorageError):
    """The object does not exist."""


class BucketNotFound(StorageError):
    """The bucket does not exist."""


class AccessDenied(StorageError):
    """The store refused the credentials or the request (wrong key, wrong secret, no rights)."""


class EndpointUnreachable(StorageError):
    """No connection could be made to the endpoint."""


class InvalidRange(StorageError):
    """A byte range lies outside the object."""


class TransientStorageError(StorageError):
    """A fault worth retrying: connection reset, 5xx, slow-down, timeout or short read."""


# --------------------------------------------------------------------------- format


class FormatError(RemoteLoaderError):
    """Bytes read from the store do not follow the remote_loader format.

    Attributes:
        name: The object (shard or manifest) the bytes came from, if known.
    """

    def __init__(self, message: str, *, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class UnsupportedVersion(FormatError):
    """The manifest or index was written by a format version this reader does not know."""


class CorruptShard(FormatError):
    """A shard, its index or a manifest is truncated, malformed or fails its checksum."""


class CorruptSampleError(CorruptShard):
    """One sample's bytes fail their checksum.

    Attributes:
        key: The sample key.
        field: The field whose bytes are corrupt.
    """

    def __init__(self, message: str, *, name: str | None = None, key: str, field: str) -> None:
        super().__init__(message, name=name)
        self.key = key
        self.field = field


class IndexOutOfBounds(FormatError):
    """An index or manifest points outside the object it describes."""


# --------------------------------------------------------------------------- other


class DecodeError(RemoteLoaderError):
    """A field's bytes could not be decoded (not an image, not a label)."""


class UploadError(RemoteLoaderError):
    """The upload could not be completed, or a sample could not be encoded.

    Attributes:
        index: The index of the offending sample in the source dataset, if any.
    """

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index
