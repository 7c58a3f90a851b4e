"""The S3 backend on the MinIO client (``minio`` 7.2).

Whole objects go through the public ``put_object``. minio 7.2's public API has no way to
push the parts of a multipart upload as they are produced (``put_object`` pulls them from a
stream and reads one part ahead, so a part "sent" would not yet be on the server), no
conditional PUT (its headers become user metadata) and no listing of multipart uploads:
streaming writers, ``put(if_none_match=..., if_match=...)`` and ``abort_uploads`` use the
client's ``_create_multipart_upload`` family, ``_put_object`` and ``_list/_abort_multipart_upload``,
here and nowhere else. The requirement stays below minio 8, the major version tested.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import urllib3
from minio import Minio
from minio.credentials import AWSConfigProvider
from minio.datatypes import Part
from minio.error import InvalidResponseError, MinioException, S3Error, ServerError
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import MaxRetryError, NewConnectionError

from remote_loader.config import StorageConfig
from remote_loader.errors import ConfigError, EndpointUnreachable, StorageError, TransientStorageError
from remote_loader.storage.base import DEFAULT_PART_SIZE, ObjectInfo, ObjectWriter, RangedStore, error_for

_MAX_ABORT_ROUNDS = 100


class MinioStore(RangedStore):
    """An S3-compatible store reached through the MinIO Python client.

    Args:
        config: Endpoint (required), credentials, retries and timeouts.
    """

    def __init__(self, config: StorageConfig) -> None:
        super().__init__()
        if config.endpoint_url is None:
            raise ConfigError("the minio backend needs an endpoint URL (AWS_ENDPOINT_URL or MINIO_ENDPOINT)")
        self.config = config

    @property
    def endpoint(self) -> str:
        return self.config.endpoint_url or ""

    def __repr__(self) -> str:
        return f"MinioStore(endpoint_url={self.config.endpoint_url!r}, region={self.config.region!r})"

    def _connect(self) -> Any:
        c = self.config
        parts = urlsplit(c.endpoint_url or "")
        retries = urllib3.Retry(
            total=c.max_attempts - 1,
            backoff_factor=0.2,
            backoff_jitter=0.1,
            status_forcelist=(500, 502, 503, 504),
            allowed_methods=None,  # S3 GET/PUT/DELETE of whole objects and parts are idempotent
            raise_on_status=False,
        )
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=c.connect_timeout, read=c.read_timeout),
            maxsize=c.max_connections,
            retries=retries,
        )
        # Without keys, an AWS profile's (AWS_PROFILE, the credentials file), as boto3 would.
        profile = None
        if c.access_key is None and (c.profile or c.credentials_file):
            profile = AWSConfigProvider(filename=c.credentials_file, profile=c.profile or "default")
        return Minio(
            parts.netloc,
            access_key=c.access_key,
            secret_key=c.secret_key,
            session_token=c.session_token,
            secure=parts.scheme == "https",
            region=c.region,
            http_client=http,
            credentials=profile,
        )

    @contextmanager
    def _errors(self, operation: str, bucket: str | None = None, key: str | None = None) -> Iterator[None]:
        """Translate every minio and urllib3 exception raised inside into our types."""
        endpoint = self.config.endpoint_url
        try:
            yield
        except S3Error as exc:
            status = exc.response.status if exc.response is not None else None
            raise error_for(exc.code or "", status, operation=operation, bucket=bucket, key=key, endpoint=endpoint) from None
        except ServerError as exc:
            raise error_for("", exc.status_code, operation=operation, bucket=bucket, key=key, endpoint=endpoint) from None
        except MaxRetryError as exc:
            if isinstance(exc.reason, NewConnectionError):
                raise EndpointUnreachable(
                    f"cannot connect to {endpoint} ({operation})", bucket=bucket, key=key, code="Unreachable"
                ) from None
            raise TransientStorageError(
                f"connection to {endpoint} failed during {operation} ({type(exc.reason).__name__})",
                bucket=bucket,
                key=key,
                code=type(exc.reason).__name__,
            ) from None
        except (Urllib3Error, ConnectionError, InvalidResponseError) as exc:
            raise TransientStorageError(
                f"connection to {endpoint} failed during {operation} ({type(exc).__name__})",
                bucket=bucket,
                key=key,
                code=type(exc).__name__,
            ) from None
        except (MinioException, ValueError) as exc:
            raise StorageError(f"{operation} failed: {type(exc).__name__}", bucket=bucket, key=key) from None

    def _read(self, bucket: str, key: str, byte_range: str | None) -> bytes:
        operation = "GET" if byte_range is None else f"GET {byte_range}"
        extra = {} if byte_range is None else {"request_headers": {"Range": byte_range}}
        with self._errors(operation, bucket, key):
            response = self._sdk().get_object(bucket, key, **extra)
            try:
                return bytes(response.read())
            finally:
                response.close()
                response.release_conn()

    def head(self, bucket: str, key: str) -> int:
        with self._errors("HEAD", bucket, key):
            return int(self._sdk().stat_object(bucket, key).size or 0)

    def get_versioned(self, bucket: str, key: str) -> tuple[bytes, str]:
        with self._errors("GET", bucket, key):
            response = self._sdk().get_object(bucket, key)
            try:
                return bytes(response.read()), str(response.headers.get("ETag", ""))
            finally:
                response.close()
                response.release_conn()

    def put(self, bucket: str, key: str, data: bytes | bytearray | memoryview, *,
            if_none_match: bool = False, if_match: str | None = None) -> None:
        headers = {"If-None-Match": "*"} if if_none_match else {}
        if if_match is not None:
            headers["If-Match"] = if_match
        with self._errors("PUT", bucket, key):
            if headers:  # the one thing put_object cannot send
                self._sdk()._put_object(bucket, key, bytes(data), headers)
            else:
                payload = bytes(data)
                self._sdk().put_object(bucket, key, io.BytesIO(payload), len(payload))

    def open_writer(self, bucket: str, key: str, *, part_size: int = DEFAULT_PART_SIZE) -> ObjectWriter:
        return _MinioWriter(self, bucket, key, part_size)

    def list(self, bucket: str, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        with self._errors("LIST", bucket, prefix or None):
            for item in self._sdk().list_objects(bucket, prefix=prefix, recursive=True, start_after=start_after):
                if not item.is_dir:
                    yield ObjectInfo(key=item.object_name or "", size=int(item.size or 0))

    def delete(self, bucket: str, key: str) -> None:
        with self._errors("DELETE", bucket, key):
            self._sdk().remove_object(bucket, key)

    def abort_uploads(self, bucket: str, prefix: str = "") -> int:
        count = 0
        with self._errors("abort multipart uploads", bucket, prefix or None):
            client = self._sdk()
            # Aborted uploads leave the listing, so list again until it is empty.
            for _ in range(_MAX_ABORT_ROUNDS):
                uploads = client._list_multipart_uploads(bucket, prefix=prefix).uploads
                if not uploads:
                    break
                for upload in uploads:
                    client._abort_multipart_upload(bucket, upload.object_name, upload.upload_id)
                    count += 1
        return count

    def create_bucket(self, bucket: str) -> None:
        try:
            with self._errors("create bucket", bucket):
                self._sdk().make_bucket(bucket)
        except StorageError as exc:
            if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def close(self) -> None:
        if self._sdk_client is not None:
            self._sdk_client._http.clear()
        super().close()


class _MinioWriter(ObjectWriter):
    def __init__(self, store: MinioStore, bucket: str, key: str, part_size: int) -> None:
        super().__init__(bucket, key, part_size)
        self._store = store
        self._upload_id = ""
        self._etags: list[Part] = []

    def _put_whole(self, data: bytes) -> None:
        self._store.put(self.bucket, self.key, data)

    def _start(self) -> None:
        with self._store._errors("create multipart upload", self.bucket, self.key):
            self._upload_id = self._store._sdk()._create_multipart_upload(self.bucket, self.key, {})

    def _upload_part(self, number: int, part: bytes) -> None:
        with self._store._errors("upload part", self.bucket, self.key):
            etag = self._store._sdk()._upload_part(self.bucket, self.key, part, None, self._upload_id, number)
        self._etags.append(Part(number, etag))

    def _complete(self) -> None:
        with self._store._errors("complete multipart upload", self.bucket, self.key):
            self._store._sdk()._complete_multipart_upload(self.bucket, self.key, self._upload_id, self._etags)

    def _abort_upload(self) -> None:
        with self._store._errors("abort multipart upload", self.bucket, self.key):
            self._store._sdk()._abort_multipart_upload(self.bucket, self.key, self._upload_id)
