"""The exception tree of remote_loader: every failure a caller can catch by type.

Each exception carries the facts as attributes (``bucket``, ``key``, ``offset``...) and a
one-line message. Secrets are never formatted into a message.

The facts survive a DataLoader worker. PyTorch sends a worker's exception to the main
process as its class and its formatted traceback, then rebuilds it as ``cls(text)``. So
every class here can be built from a message alone, and each error adds its facts to its
traceback as a note (``remote_loader facts: {...}``, JSON); ``cls(text)`` reads them back
from the last such note in the text.
"""

from __future__ import annotations

import enum
import json
from typing import Any

_FACTS = "remote_loader facts: "


def _rebuild(cls: type[RemoteLoaderError], message: str, state: dict[str, object]) -> RemoteLoaderError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


def _facts_in(message: str) -> dict[str, Any]:
    """The facts of the last ``remote_loader facts:`` note in a rebuilt traceback text."""
    at = message.rfind(_FACTS)
    if at < 0:
        return {}
    line = message[at + len(_FACTS):].split("\n", 1)[0]
    try:
        facts = json.loads(line)
    except ValueError:
        return {}
    return facts if isinstance(facts, dict) else {}


class RemoteLoaderError(Exception):
    """Base class of every error raised by remote_loader."""

    def __init__(self, message: str = "", **facts: Any) -> None:
        super().__init__(message)
        recovered = _facts_in(message) if facts else {}
        for name, value in facts.items():
            setattr(self, name, recovered.get(name) if value is None else value)
        given = {k: v for k, v in facts.items() if v is not None}
        if given:
            self.__notes__ = [_FACTS + json.dumps(given, default=str)]

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only attributes survive pickling (a process pool, a queue).
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


class ConfigError(RemoteLoaderError, ValueError):
    """An argument or configuration value is invalid."""


class ResumeError(ConfigError):
    """A checkpoint state cannot resume this dataset: malformed, from another dataset, seed or
    split, or taken where it cannot resume exactly (a ``ConfigError``, so code catching
    those catches it too)."""


# --------------------------------------------------------------------------- storage


class StorageError(RemoteLoaderError):
    """A request to the object store failed.

    Attributes:
        bucket: The bucket of the request, if any.
        key: The object key of the request, if any.
        code: The store's error code (``NoSuchKey``, ``SlowDown``...), if any.
    """

    bucket: str | None
    key: str | None
    code: str | None

    def __init__(
        self, message: str = "", *, bucket: str | None = None, key: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message, bucket=bucket, key=key, code=code)


class ObjectNotFound(StorageError):
    """The object does not exist."""


class DatasetNotFound(ObjectNotFound):
    """No dataset lives at this location: it has no manifest (an upload that has not
    finished, plain tars never indexed, or a mistyped prefix). ``key`` is the manifest's."""


class BucketNotFound(StorageError):
    """The bucket does not exist."""


class AccessDenied(StorageError):
    """The store refused the credentials or the request (wrong key, wrong secret, no rights)."""


class EndpointUnreachable(StorageError):
    """No connection could be made to the endpoint."""


class InvalidRange(StorageError):
    """A byte range lies outside the object."""


class PreconditionFailed(StorageError):
    """A conditional write was refused: the object exists (``if_none_match``) or changed
    since it was read (``if_match``)."""


class TransientStorageError(StorageError):
    """A fault worth retrying: connection reset, 5xx, slow-down, timeout or short read."""


# --------------------------------------------------------------------------- format


class FormatError(RemoteLoaderError):
    """Bytes read from the store do not follow the remote_loader format.

    Attributes:
        name: The object (shard or manifest) the bytes came from, if known.
    """

    name: str | None

    def __init__(self, message: str = "", *, name: str | None = None, **facts: Any) -> None:
        super().__init__(message, name=name, **facts)


class UnsupportedVersion(FormatError):
    """The manifest or index was written by a format version this reader does not know."""


class CorruptShard(FormatError):
    """A shard, its index or a manifest is truncated, malformed or fails its checksum."""


class TruncatedShard(CorruptShard):
    """A shard or its index is not the size the manifest says: it was truncated or replaced
    (the store answered, with fewer bytes than asked for or another object size)."""


class CorruptSampleError(CorruptShard):
    """One sample's bytes fail their checksum.

    Attributes:
        key: The sample key.
        field: The field whose bytes are corrupt.
    """

    key: str | None
    field: str | None

    def __init__(self, message: str = "", *, name: str | None = None, key: str | None = None,
                 field: str | None = None) -> None:
        super().__init__(message, name=name, key=key, field=field)


class IndexOutOfBounds(FormatError):
    """An index or manifest points outside the object it describes."""


# --------------------------------------------------------------------------- other


class DatasetChanged(RemoteLoaderError):
    """The dataset was overwritten or removed while being read: its manifest changed. The
    pass that sees it raises; a ``RemoteDataset``'s next pass reads the new upload.

    Attributes:
        bucket: The dataset's bucket.
        key: Its manifest's key.
    """

    bucket: str | None
    key: str | None

    def __init__(self, message: str = "", *, bucket: str | None = None, key: str | None = None) -> None:
        super().__init__(message, bucket=bucket, key=key)


class DecodeError(RemoteLoaderError):
    """A field's bytes could not be decoded (not an image, not a label).

    Attributes:
        key: The sample's key, if known.
        field: The field, if known.
    """

    key: str | None
    field: str | None

    def __init__(self, message: str = "", *, key: str | None = None, field: str | None = None) -> None:
        super().__init__(message, key=key, field=field)


class DecoderExited(RemoteLoaderError):
    """The process that decodes a device pipeline's batches (``loader()``'s decoding
    process) ended without being asked to: killed, out of memory, or crashed in a library.

    Attributes:
        pid: Its process id.
        returncode: Its exit status (negative: the signal that ended it), if known.
    """

    pid: int | None
    returncode: int | None

    def __init__(self, message: str = "", *, pid: int | None = None, returncode: int | None = None) -> None:
        super().__init__(message, pid=pid, returncode=returncode)


class UploadError(RemoteLoaderError):
    """The upload could not be completed, or a sample could not be encoded.

    Attributes:
        index: The index of the offending sample in the source dataset, if any.
    """

    index: int | None

    def __init__(self, message: str = "", *, index: int | None = None) -> None:
        super().__init__(message, index=index)


class UploadConflict(UploadError):
    """Another upload to the same prefix holds it or finished first; this one stopped
    without touching the other's objects.

    Attributes:
        location: The dataset's ``s3://bucket/prefix``.
    """

    location: str | None

    def __init__(self, message: str = "", *, location: str | None = None) -> None:
        RemoteLoaderError.__init__(self, message, location=location)
        self.index = None


class OnError(str, enum.Enum):
    """What is done with a sample that cannot be read, decoded or encoded, decided once from
    an ``on_error`` argument (``OnError.of("skip")``): ``RAISE`` its error, naming the
    sample, or ``SKIP`` it, counted in ``metrics.skipped`` (an upload's ``skipped``) and
    logged. It equals its string (``OnError.SKIP == "skip"``)."""

    RAISE = "raise"
    SKIP = "skip"

    @classmethod
    def of(cls, value: str | OnError) -> OnError:
        """The policy ``value`` names; anything but ``"raise"`` and ``"skip"`` is a ConfigError."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {value!r}") from None

    @property
    def skips(self) -> bool:
        return self is OnError.SKIP

    def __str__(self) -> str:
        return self.value
