"""The S3 backend on the MinIO client (``minio`` 7.2).

It uses only minio's public API. Reads, whole-object writes, listings and deletes are the
client's own calls. minio 7.2 has no public call for a conditional PUT (``put_object``
turns its headers into user metadata), for pushing the parts of a multipart upload as
they are produced (``put_object`` pulls them from a stream) or for listing multipart
uploads: those requests go on URLs the client presigns (``get_presigned_url``, or
``minio.signer.presign_v4`` for a bucket), through the store's own connection pool, and
their XML is read here.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit
from xml.etree import ElementTree

import urllib3
from minio import Minio
from minio.credentials import AWSConfigProvider, Credentials, Provider, StaticProvider
from minio.error import InvalidResponseError, MinioException, S3Error, ServerError
from minio.signer import presign_v4
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import MaxRetryError, NewConnectionError

from remote_loader.config import StorageConfig, aws_files
from remote_loader.errors import (
    ConfigError,
    EndpointUnreachable,
    RemoteLoaderError,
    StorageError,
    TransientStorageError,
)
from remote_loader.storage.base import (
    DEFAULT_PART_SIZE,
    ObjectInfo,
    ObjectWriter,
    RangedStore,
    bucket_name_problem,
    byte_bounds,
    check_answer,
    check_range,
    crc32_header,
    error_for,
    object_length,
    place,
)
from remote_loader.storage.receive import BODY_ERRORS, read_body, receive_into
from remote_loader.storage.unsigned_logs import hide_signatures
from remote_loader.storage.writer import MultipartWriter

_MAX_ABORT_ROUNDS = 100
_GARBLED = (ElementTree.ParseError, UnicodeDecodeError)
"""What minio raises for an answer's XML cut short or garbled on its way (a listing's page): a
fault to retry, as a connection reset is."""
hide_signatures()  # urllib3 logs the URL of each request: a presigned one's signature is not shown
_PRESIGNED_FOR = timedelta(minutes=15)  # a request is sent at once; a part may take minutes on a slow link


def _xml(data: bytes, *names: str) -> list[str]:
    """The text of every element named one of ``names`` (namespaces ignored), in order."""
    root = ElementTree.fromstring(data)
    return [(e.text or "") for e in root.iter() if e.tag.rsplit("}", 1)[-1] in names]


def _quoted(etag: str | None) -> str:
    """An ETag as S3 sends it, quoted (minio's listing strips the quotes); "" for none."""
    return f'"{etag}"' if etag else ""


def _checksum(body: bytes | bytearray | memoryview) -> dict[str, str]:
    """A body's ``x-amz-checksum-crc32`` as a query parameter of a presigned URL, where the
    signature covers it (an unsigned header is refused): a body damaged on the way is refused."""
    return {"x-amz-checksum-crc32": crc32_header(body)}


class _ProfileProvider(AWSConfigProvider):
    """minio's reader of a profile's keys in an AWS credentials file, which reads the file
    again at each request (keys rotated there are picked up); a profile without both keys is
    a ConfigError naming the profile and the file, where minio raised a bare ValueError."""

    def __init__(self, filename: str, profile: str, *, named: bool) -> None:
        super().__init__(filename=filename, profile=profile)
        self.filename, self.profile, self.named = filename, profile, named

    def retrieve(self) -> Credentials:
        try:
            return super().retrieve()
        except (ValueError, configparser.Error):  # the file changed since the store connected
            self.check()
            raise ConfigError(f"{self._shown()} cannot be read from the AWS credentials file {self.filename}") from None

    def holds_a_key(self) -> bool:
        """Whether the profile names an access key."""
        return bool(self._value("aws_access_key_id"))

    def check(self) -> None:
        """Raise a ConfigError saying what keeps the profile from giving both keys, if anything."""
        if not os.path.isfile(self.filename):
            raise ConfigError(f"{self._shown()} is not there: there is no AWS credentials file {self.filename}")
        if not self._read().has_section(self.profile):
            raise ConfigError(f"{self._shown()} is not in the AWS credentials file {self.filename}, where the minio"
                              " backend reads it")
        for option in ("aws_access_key_id", "aws_secret_access_key"):
            if not self._value(option):
                raise ConfigError(f"{self._shown()} in the AWS credentials file {self.filename} has no {option}:"
                                  " give both keys there")

    def _shown(self) -> str:
        return f"the AWS profile {self.profile!r}{' (AWS_PROFILE)' if self.named else ''}"

    def _read(self) -> configparser.ConfigParser:
        """The file as minio reads it (empty where there is none)."""
        parser = configparser.ConfigParser()
        try:
            parser.read(self.filename)
        except (configparser.Error, UnicodeDecodeError) as exc:  # its message may quote a line, a key's
            raise ConfigError(f"the AWS credentials file {self.filename} cannot be parsed as [profile] sections"
                              f" ({type(exc).__name__})") from None
        return parser

    def _value(self, option: str) -> str | None:
        try:
            return self._read().get(self.profile, option, fallback=None)
        except configparser.Error as exc:  # a '%' the file's syntax does not take, say
            raise ConfigError(f"{self._shown()} in the AWS credentials file {self.filename} cannot be read"
                              f" ({type(exc).__name__})") from None


def _keys(config: StorageConfig) -> Provider | None:
    """The keys minio signs with, found as boto3 finds them: the config's (the environment's,
    which win over any profile), else those of the AWS profile it names (``AWS_PROFILE``) in
    its credentials file, else the default profile's there. None (anonymous requests) where no
    profile is named and the default one holds no key. A profile's faults are said now, once."""
    if config.access_key is not None and config.secret_key is not None:
        return StaticProvider(config.access_key, config.secret_key, config.session_token)
    provider = _ProfileProvider(config.credentials_file or aws_files()[0], config.profile or "default",
                                named=config.profile is not None)
    if not provider.named and not provider.holds_a_key():
        return None
    provider.check()
    return provider


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
        # Made with the client, in each process (see RangedStore).
        self._pool: urllib3.PoolManager | None = None
        self._provider: Provider | None = None

    @classmethod
    def around(cls, client: Minio, bucket: str) -> MinioStore:
        """A store using a caller's ``minio.Minio`` in this process (see ``RangedStore.lend``).

        minio 7.2 shows its endpoint and region only in what its public API makes: both are
        read from a URL it presigns for ``bucket`` (which asks the store for the bucket's
        region when the client was not given one). Requests minio has no call for go through
        a pool of this store's own, on URLs the client presigns; listing unfinished uploads
        is one the store cannot make with a borrowed client (``NotImplemented``).
        """
        try:
            url = urlsplit(client.get_presigned_url("GET", bucket, "remote-loader-probe", expires=timedelta(minutes=1)))
        except (MinioException, ValueError, Urllib3Error) as exc:
            raise ConfigError(f"the minio client could not name its endpoint for bucket {bucket!r}"
                              f" ({type(exc).__name__}: {exc})"[:300]) from None
        credential = dict(parse_qsl(url.query)).get("X-Amz-Credential", "").split("/")
        region = credential[2] if len(credential) == 5 else "us-east-1"
        store = cls(StorageConfig(endpoint_url=f"{url.scheme}://{url.netloc}", region=region))
        store._pool = store._new_pool()
        store.lend(client)
        return store

    @property
    def endpoint(self) -> str:
        return self.config.endpoint_url or ""

    def __repr__(self) -> str:
        return f"MinioStore(endpoint_url={self.config.endpoint_url!r}, region={self.config.region!r})"

    def _new_pool(self) -> urllib3.PoolManager:
        c = self.config
        retries = urllib3.Retry(
            total=c.max_attempts - 1,
            backoff_factor=0.2,
            backoff_jitter=0.1,
            status_forcelist=(500, 502, 503, 504),
            allowed_methods=None,  # S3 GET/PUT/DELETE of whole objects and parts are idempotent
            raise_on_status=False,
        )
        return urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=c.connect_timeout, read=c.read_timeout),
            maxsize=c.max_connections,
            retries=retries,
        )

    def _connect(self) -> Any:
        c = self.config
        if self._borrowed and c.access_key is None:  # another process than the caller's: keys from its environment
            c = StorageConfig.from_env(endpoint_url=c.endpoint_url, region=c.region)
        provider = _keys(c)  # without keys, an AWS profile's (AWS_PROFILE, else the default), as boto3 would
        if self._borrowed and provider is None:
            raise ConfigError(self._borrowed_elsewhere())
        self.config = c
        parts = urlsplit(c.endpoint_url or "")
        http = self._new_pool()
        self._pool, self._provider = http, provider
        return Minio(parts.netloc, secure=parts.scheme == "https", region=c.region, http_client=http,
                     credentials=provider)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_pool": None, "_provider": None}

    def _signed(self, method: str, bucket: str, key: str | None, *, query: dict[str, str] | None = None,
                body: bytes | None = None, headers: dict[str, str] | None = None) -> urllib3.BaseHTTPResponse:
        """Send a request minio 7.2 has no public call for, on a URL presigned by its public
        API, through this store's connection pool (see the module's docstring). An S3 error
        is raised as minio's ``S3Error``, whatever the status (CompleteMultipartUpload can
        fail with 200)."""
        client = self._sdk()  # this process's client, pool and credentials
        assert self._pool is not None
        if key is not None:
            url = client.get_presigned_url(method, bucket, key, expires=_PRESIGNED_FOR, extra_query_params=query)
        else:
            url = self._presign_bucket(method, bucket, query or {})
        response = self._pool.request(method, url, body=body, headers=headers)
        data = response.data
        if response.status >= 300 or b"<Error>" in data[:256]:
            if data.lstrip()[:1] == b"<":
                with suppress(ElementTree.ParseError):  # else not S3's XML: the status says what there is
                    raise S3Error.fromxml(response)
            raise ServerError(f"{method} answered HTTP {response.status}", response.status)
        return response

    def _presign_bucket(self, method: str, bucket: str, query: dict[str, str]) -> str:
        """A presigned URL of the bucket itself (``get_presigned_url`` wants an object)."""
        parts = urlsplit(self.config.endpoint_url or "")
        url = parts._replace(path=quote(f"/{bucket}"), query=urlencode(query), fragment="")
        credentials = self._provider.retrieve() if self._provider is not None else None
        if credentials is None:
            return urlunsplit(url)
        if credentials.session_token:
            url = url._replace(query=urlencode({**query, "X-Amz-Security-Token": credentials.session_token}))
        signed = presign_v4(method=method, url=url, region=self.config.region, credentials=credentials,
                            date=datetime.now(timezone.utc), expires=int(_PRESIGNED_FOR.total_seconds()))
        return urlunsplit(signed)

    @contextmanager
    def _errors(self, operation: str, bucket: str | None = None, key: str | None = None) -> Iterator[None]:
        """Translate every minio and urllib3 exception raised inside into our types."""
        endpoint = self.config.endpoint_url
        try:
            yield
        except RemoteLoaderError:  # ours already (a ConfigError is also a ValueError)
            raise
        except S3Error as exc:
            status = exc.response.status if exc.response is not None else None
            raise error_for(
                exc.code or "", status, operation=operation, bucket=bucket, key=key, endpoint=endpoint
            ) from None
        except ServerError as exc:
            raise error_for(
                "", exc.status_code, operation=operation, bucket=bucket, key=key, endpoint=endpoint
            ) from None
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
        except (Urllib3Error, ConnectionError, *BODY_ERRORS, InvalidResponseError, *_GARBLED) as exc:
            raise TransientStorageError(
                f"connection to {endpoint} failed during {operation} ({type(exc).__name__})",
                bucket=bucket,
                key=key,
                code=type(exc).__name__,
            ) from None
        except (MinioException, ValueError) as exc:
            if bucket is not None and bucket_name_problem(bucket):  # minio checks the name before sending
                raise error_for("InvalidBucketName", None, operation=operation, bucket=bucket, key=key,
                                endpoint=endpoint) from None
            raise StorageError(f"{operation} failed: {type(exc).__name__}", bucket=bucket, key=key) from None

    def _read(self, bucket: str, key: str, byte_range: str | None,
              if_match: str | None = None) -> tuple[bytes, str | None]:
        operation = "GET" if byte_range is None else f"GET {byte_range}"
        headers = {} if byte_range is None else {"Range": byte_range}
        if if_match is not None:
            headers["If-Match"] = if_match
        extra = {"request_headers": headers} if headers else {}
        with self._errors(operation, bucket, key):
            response = self._sdk().get_object(bucket, key, **extra)
            try:
                return read_body(response, self.config.read_timeout), response.headers.get("Content-Range")
            finally:
                response.close()
                response.release_conn()

    def get_range_into(self, bucket: str, key: str, start: int, end: int, out: memoryview, *,
                       if_match: str | None = None) -> None:
        """Receive the body straight into ``out``: no intermediate bytes object."""
        start, end = byte_bounds(start, end)
        if end <= start:
            return
        byte_range = f"bytes={start}-{end - 1}"
        headers = {"Range": byte_range} if if_match is None else {"Range": byte_range, "If-Match": if_match}
        with self._errors(f"GET {byte_range}", bucket, key):
            response = self._sdk().get_object(bucket, key, request_headers=headers)
            try:
                check_answer(bucket, key, start, end, response.headers.get("Content-Range"))
                filled = receive_into(response, out, self.config.read_timeout)
            finally:
                response.close()
                response.release_conn()
        check_range(bucket, key, start, end, b"", got=filled)

    def head(self, bucket: str, key: str) -> int:
        with self._errors("HEAD", bucket, key):
            found = self._sdk().stat_object(bucket, key)  # its size reads a missing length as 0: the header
            return object_length(bucket, key, (found.metadata or {}).get("content-length"))

    def get_versioned(self, bucket: str, key: str) -> tuple[bytes, str]:
        with self._errors("GET", bucket, key):
            response = self._sdk().get_object(bucket, key)
            try:
                return read_body(response, self.config.read_timeout), str(response.headers.get("ETag", ""))
            finally:
                response.close()
                response.release_conn()

    def put(
        self,
        bucket: str,
        key: str,
        data: bytes | bytearray | memoryview,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> None:
        headers = {"If-None-Match": "*"} if if_none_match else {}
        if if_match is not None:
            headers["If-Match"] = if_match
        with self._errors("PUT", bucket, key):  # put_object sends no checksum: a presigned PUT, which signs it
            self._signed("PUT", bucket, key, body=bytes(data), headers=headers, query=_checksum(data))

    def open_writer(self, bucket: str, key: str, *, part_size: int = DEFAULT_PART_SIZE) -> ObjectWriter:
        return _MinioWriter(self, bucket, key, part_size)

    def list(self, bucket: str, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        with self._errors("LIST", bucket, prefix or None):
            for item in self._sdk().list_objects(bucket, prefix=prefix, recursive=True, start_after=start_after):
                if not item.is_dir:
                    yield ObjectInfo(key=item.object_name or "", size=int(item.size or 0), etag=_quoted(item.etag))

    def delete(self, bucket: str, key: str) -> None:
        with self._errors("DELETE", bucket, key):
            self._sdk().remove_object(bucket, key)

    def abort_uploads(self, bucket: str, prefix: str = "") -> int:
        if self._borrowed and self._pid == os.getpid():
            raise StorageError(
                f"{place(bucket)}: unfinished uploads cannot be listed through a minio client of the"
                " caller's (minio 7.2 has no public call for it)",
                bucket=bucket,
                code="NotImplemented",
            )
        count = 0
        with self._errors("abort multipart uploads", bucket, prefix or None):
            # Aborted uploads leave the listing, so list again until it is empty.
            for _ in range(_MAX_ABORT_ROUNDS):
                listing = self._signed("GET", bucket, None, query={"uploads": "", "prefix": prefix}).data
                uploads = list(zip(_xml(listing, "Key"), _xml(listing, "UploadId"), strict=True))
                if not uploads:
                    break
                for key, upload_id in uploads:
                    self._signed("DELETE", bucket, key, query={"uploadId": upload_id})
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
        if self._pool is not None:
            self._pool.clear()
        super().close()


class _MinioWriter(MultipartWriter[MinioStore, str]):
    def _create_request(self) -> str:
        created = self._store._signed("POST", self.bucket, self.key, query={"uploads": ""})
        (upload_id,) = _xml(created.data, "UploadId")
        return upload_id

    def _part_request(self, number: int, part: bytes) -> str:
        sent = self._store._signed(
            "PUT", self.bucket, self.key, body=part,
            query={"partNumber": str(number), "uploadId": self._upload_id, **_checksum(part)},
        )
        return str(sent.headers.get("ETag", ""))

    def _complete_request(self, parts: list[tuple[int, str]]) -> None:
        root = ElementTree.Element("CompleteMultipartUpload")
        for number, etag in parts:
            element = ElementTree.SubElement(root, "Part")
            ElementTree.SubElement(element, "PartNumber").text = str(number)
            ElementTree.SubElement(element, "ETag").text = etag
        self._store._signed(
            "POST",
            self.bucket,
            self.key,
            query={"uploadId": self._upload_id},
            body=ElementTree.tostring(root),
            headers={"Content-Type": "application/xml"},
        )

    def _abort_request(self) -> None:
        self._store._signed("DELETE", self.bucket, self.key, query={"uploadId": self._upload_id})
