"""A local directory as a store: ``root/<bucket>/<key>``, for tests, laptops and shared filesystems."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import uuid
from collections.abc import Iterator
from io import BufferedReader
from pathlib import Path
from typing import BinaryIO

from remote_loader.checks import require_path
from remote_loader.errors import (
    AccessDenied,
    BucketNotFound,
    InvalidRange,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
)
from remote_loader.storage.base import DEFAULT_PART_SIZE, ObjectInfo, ObjectWriter, Store, byte_bounds, check_range
from remote_loader.storage.locking import exclusive

_PARTIAL = ".rl-partial-"
"""Marks files of unfinished writes; they never show in listings."""
_LOCK = f"{_PARTIAL}lock"
"""The lock file of conditional writes, at the top of each bucket."""
_PRUNED_UNDER_US = 64
"""Times a write makes its directory again where deletes keep removing it as empty."""
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT
for _flag in ("O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC"):  # Windows has none of them (nor FIFOs)
    _LOCK_FLAGS |= getattr(os, _flag, 0)


def _open_lock(path: Path, bucket: str) -> int:
    """The bucket's lock file, opened (made where missing): a regular file, never a link,
    FIFO or device planted in its place, which it would follow out of the store or wait on."""
    try:
        fd = os.open(path, _LOCK_FLAGS, 0o644)
    except OSError as error:
        raise StorageError(f"{path} cannot be opened as the bucket's lock file ({error.strerror}): remove what is"
                           " there", bucket=bucket, code="BadLockFile") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StorageError(f"{path} is not a regular file, so not the bucket's lock file: remove it", bucket=bucket,
                           code="BadLockFile")
    return fd


class LocalStore(Store):
    """Buckets are subdirectories of ``root``; keys are relative paths inside them.

    Writes go to a temporary file in the same directory and are renamed into place, so a
    reader sees a whole object or none. A key can never name a path outside its bucket.

    Args:
        root: The directory holding the buckets.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__()
        self.root = Path(require_path("LocalStore's root", root)).resolve()

    @property
    def endpoint(self) -> str:
        return f"file://{self.root}"

    def __repr__(self) -> str:
        return f"LocalStore(root={str(self.root)!r})"

    def path_of(self, bucket: str, prefix: str) -> str:
        return (self.root / bucket / prefix).as_posix().rstrip("/")

    def _bucket_dir(self, bucket: str) -> Path:
        if not isinstance(bucket, str) or not bucket or "/" in bucket or bucket in (".", "..") or "\0" in bucket:
            raise StorageError(f"invalid bucket name {bucket!r}", bucket=bucket, code="InvalidBucketName")
        path = self.root / bucket
        if not path.is_dir():  # the message names the directory: a dataset's own, where the URL was a path
            raise BucketNotFound(_no_directory(path), bucket=bucket, code="NoSuchBucket")
        return path

    def _path(self, bucket: str, key: str) -> Path:
        base = self._bucket_dir(bucket)
        if not isinstance(key, str):  # an AttributeError from split
            raise StorageError(f"key {key!r} is not a safe relative path", bucket=bucket, key=key, code="InvalidKey")
        parts = key.split("/")
        if not key or key.startswith("/") or "\0" in key or any(p in ("", ".", "..") for p in parts):
            raise StorageError(f"key {key!r} is not a safe relative path", bucket=bucket, key=key, code="InvalidKey")
        path = base.joinpath(*parts)
        if base not in path.resolve().parents:  # a symlink inside the bucket could still point out
            raise StorageError(
                f"key {key!r} resolves outside bucket {bucket!r}", bucket=bucket, key=key, code="InvalidKey"
            )
        return path

    def _open(self, bucket: str, key: str) -> tuple[Path, int]:
        path = self._path(bucket, key)
        try:
            return path, path.stat().st_size
        except FileNotFoundError:
            raise ObjectNotFound(f"{bucket}/{key} does not exist under {self.root}", bucket=bucket, key=key) from None
        except PermissionError:
            raise AccessDenied(f"no permission to read {path}", bucket=bucket, key=key) from None

    def get(self, bucket: str, key: str) -> bytes:
        path, _ = self._open(bucket, key)
        return path.read_bytes()

    def _open_range(self, bucket: str, key: str, start: int, end: int) -> BufferedReader:
        """The object opened at ``start``, once ``[start, end)`` is known to lie inside it."""
        path, size = self._open(bucket, key)
        if start < 0 or end > size:
            raise InvalidRange(
                f"{bucket}/{key}: range {start}-{end} lies outside its {size} bytes", bucket=bucket, key=key
            )
        f = path.open("rb")
        f.seek(start)
        return f

    def get_range(self, bucket: str, key: str, start: int, end: int) -> bytes:
        start, end = byte_bounds(start, end)
        if end <= start:
            return b""
        with self._open_range(bucket, key, start, end) as f:
            return check_range(bucket, key, start, end, f.read(end - start))

    def get_range_into(self, bucket: str, key: str, start: int, end: int, out: memoryview, *,
                       if_match: str | None = None) -> None:
        start, end = byte_bounds(start, end)
        if end <= start:
            return
        with self._open_range(bucket, key, start, end) as f:
            _check_version(bucket, key, os.fstat(f.fileno()), if_match)  # the file read is the one checked
            check_range(bucket, key, start, end, b"", got=f.readinto(out[: end - start]))

    def get_range_and_size(self, bucket: str, key: str, start: int, end: int, *,
                           if_match: str | None = None) -> tuple[bytes, int]:
        start, end = byte_bounds(start, end)
        path, size = self._open(bucket, key)
        if end <= start:
            return b"", size
        if start < 0 or end > size:
            raise InvalidRange(
                f"{bucket}/{key}: range {start}-{end} lies outside its {size} bytes",
                bucket=bucket,
                key=key,
                code="ShortRead",
            )
        with path.open("rb") as f:
            found = os.fstat(f.fileno())  # the file read is the one checked, and measured
            _check_version(bucket, key, found, if_match)
            f.seek(start)
            return check_range(bucket, key, start, end, f.read(end - start)), found.st_size

    def head(self, bucket: str, key: str) -> int:
        return self._open(bucket, key)[1]

    def _partial(self, bucket: str, key: str) -> tuple[Path, BinaryIO]:
        """A new temporary file beside the object's path, open for writing, and its path. Its
        directory is made where missing, and made again where a ``delete`` in another thread
        or process took it away as empty between the two."""
        path = self._path(bucket, key)
        tmp = path.with_name(f"{path.name}{_PARTIAL}{uuid.uuid4().hex}")
        for attempt in range(_PRUNED_UNDER_US):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                return tmp, tmp.open("xb")
            except (FileNotFoundError, FileExistsError):  # a folder on the way removed meanwhile (FileExists: as
                if attempt == _PRUNED_UNDER_US - 1:  # pathlib found it made, then gone)
                    raise
        raise AssertionError("unreachable")

    def get_versioned(self, bucket: str, key: str) -> tuple[bytes, str]:
        data = self.get(bucket, key)
        return data, _etag(data)

    def put(
        self,
        bucket: str,
        key: str,
        data: bytes | bytearray | memoryview,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> None:
        if not if_none_match and if_match is None:
            with self.open_writer(bucket, key) as writer:
                writer.write(data)
            return
        target, (tmp, file) = self._path(bucket, key), self._partial(bucket, key)
        with file:
            file.write(data)
        try:
            # One lock per bucket makes check-and-replace atomic among processes on this host.
            with os.fdopen(_open_lock(self._bucket_dir(bucket) / _LOCK, bucket), "a") as lock, exclusive(lock.fileno()):
                current = _etag(target.read_bytes()) if target.exists() else None
                if (if_none_match and current is not None) or (if_match is not None and current != if_match):
                    raise PreconditionFailed(
                        f"{bucket}/{key}: the object changed or exists; a conditional PUT was refused",
                        bucket=bucket,
                        key=key,
                        code="PreconditionFailed",
                    )
                os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    def open_writer(self, bucket: str, key: str, *, part_size: int = DEFAULT_PART_SIZE) -> ObjectWriter:
        return _LocalWriter(self, bucket, key, part_size)

    def list(self, bucket: str, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        base = self._bucket_dir(bucket)
        found = []
        for dirpath, _, filenames in os.walk(base):
            rel = Path(dirpath).relative_to(base).as_posix()
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}"
                if _PARTIAL not in name and key.startswith(prefix) and (start_after is None or key > start_after):
                    info = (Path(dirpath) / name).stat()
                    found.append(ObjectInfo(key=key, size=info.st_size, etag=_version(info)))
        yield from sorted(found, key=lambda o: o.key)

    def delete(self, bucket: str, key: str) -> None:
        path = self._path(bucket, key)
        path.unlink(missing_ok=True)
        self._prune(path.parent, self._bucket_dir(bucket))

    @staticmethod
    def _prune(folder: Path, bucket_dir: Path) -> None:
        """Remove ``folder`` and the folders above it, up to the bucket's, while each is empty
        (as a prefix without objects is no more in S3); a write into one made again meanwhile
        makes it anew (``_partial``)."""
        while folder != bucket_dir and bucket_dir in folder.parents:
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone, or not ours to remove): what lies above is kept too
                return
            folder = folder.parent

    def abort_uploads(self, bucket: str, prefix: str = "") -> int:
        base = self._bucket_dir(bucket)
        count = 0
        partial = [Path(folder, name) for folder, _, names in os.walk(base) for name in names if _PARTIAL in name]
        for path in partial:  # listed first (a folder that goes meanwhile is passed over), then removed
            if path.name != _LOCK and path.relative_to(base).as_posix().startswith(prefix):
                path.unlink(missing_ok=True)
                self._prune(path.parent, base)
                count += 1
        return count

    def create_bucket(self, bucket: str) -> None:
        if not isinstance(bucket, str) or not bucket or "/" in bucket or bucket in (".", "..") or "\0" in bucket:
            raise StorageError(f"invalid bucket name {bucket!r}", bucket=bucket, code="InvalidBucketName")
        path = self.root / bucket
        try:
            path.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # a file there, or above it: never replaced
            raise StorageError(_no_directory(path), bucket=bucket, code="NotADirectory") from None
        except PermissionError:
            raise AccessDenied(f"no permission to make the directory {path}", bucket=bucket) from None
        except OSError as error:
            raise StorageError(f"cannot make the directory {path}: {error.strerror}", bucket=bucket) from None


def _no_directory(path: Path) -> str:
    """Why ``path`` is no directory, naming it: it is a file, a file lies above it, or nothing is there."""
    try:
        for above in (path, *path.parents):
            if above.is_dir():
                break
            if above.exists() or above.is_symlink():
                kind = "a file, not a directory" if above.is_file() else "not a directory"
                return f"{above} is {kind}" if above == path else f"{path}: {above} is {kind}"
    except OSError:  # a parent that cannot be searched
        pass
    return f"no directory {path}"


def _check_version(bucket: str, key: str, found: os.stat_result, if_match: str | None) -> None:
    """Raise ``PreconditionFailed`` where ``if_match`` is given and is not the version of the
    file ``found`` describes."""
    if if_match is not None and _version(found) != if_match:
        raise PreconditionFailed(f"{bucket}/{key} was written again since it was listed ({if_match})",
                                 bucket=bucket, key=key, code="PreconditionFailed")


def _version(found: os.stat_result) -> str:
    """A local object's version tag as its listing gives it: a write replaces the file (a new
    inode, a new write time), so the tag changes; reading the file is not needed."""
    return f'"{found.st_mtime_ns:x}-{found.st_size:x}-{found.st_ino:x}"'


def _etag(data: bytes) -> str:
    """An S3-style ETag (quoted MD5) of a local object."""
    return f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'


class _LocalWriter(ObjectWriter):
    """Parts go straight to a temporary file, renamed into place on commit."""

    def __init__(self, store: LocalStore, bucket: str, key: str, part_size: int) -> None:
        super().__init__(bucket, key, part_size)
        self._store, self._target = store, store._path(bucket, key)
        self._tmp, self._file = store._partial(bucket, key)
        self._seek_lock = threading.Lock()

    def _put_whole(self, data: bytes) -> None:
        self._file.write(data)
        self._complete()

    def _start(self) -> None:
        pass

    def _upload_part(self, number: int, part: bytes) -> None:
        offset = (number - 1) * self.part_size  # parts arrive in any order, on several threads
        if hasattr(os, "pwrite"):
            os.pwrite(self._file.fileno(), part, offset)
            return
        with self._seek_lock:  # Windows has no pwrite: a seek and a write, one part at a time
            self._file.seek(offset)
            self._file.write(part)

    def _complete(self) -> None:
        self._file.close()
        try:
            os.replace(self._tmp, self._target)
        except FileNotFoundError:  # abort_uploads removed it meanwhile, as S3 forgets an aborted upload
            raise StorageError(
                f"s3://{self.bucket}/{self.key}: its upload was aborted before it completed",
                bucket=self.bucket,
                key=self.key,
                code="NoSuchUpload",
            ) from None

    def _abort_upload(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)
        self._store._prune(self._tmp.parent, self._store._bucket_dir(self.bucket))

    def abort(self, *, interrupted: bool = False) -> None:
        super().abort(interrupted=interrupted)
        if not self._file.closed:  # nothing was sent as a part: the file is still open
            self._abort_upload()
