"""The S3 backend on boto3: the default, and the reference for AWS S3."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any
from urllib.parse import urlsplit
from xml.etree import ElementTree

import boto3
import botocore.exceptions as bce
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.httpsession import URLLib3Session
from botocore.response import StreamingBody
from urllib3.exceptions import HTTPError as Urllib3Error

from remote_loader.checks import one_line
from remote_loader.config import StorageConfig, aws_files
from remote_loader.errors import AccessDenied, ConfigError, EndpointUnreachable, StorageError, TransientStorageError
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
)
from remote_loader.storage.receive import BODY_ERRORS, read_body, receive_into
from remote_loader.storage.unsigned_logs import hide_signatures
from remote_loader.storage.writer import MultipartWriter

_UNREACHABLE = (bce.EndpointConnectionError, bce.ConnectTimeoutError, bce.ProxyConnectionError)
_TRANSIENT = (
    bce.ReadTimeoutError,
    bce.ConnectionClosedError,
    bce.ResponseStreamingError,
    bce.IncompleteReadError,
    bce.ConnectionError,
    Urllib3Error,
    ConnectionError,
    *BODY_ERRORS,  # a body read past urllib3 (storage.receive)
)


_PRESIGNED_FOR = 3600  # seconds a ranged GET's presigned URL is valid
_RENEW_BEFORE = 600  # a URL this close to expiring is signed anew
_URLS_KEPT = 4096  # presigned URLs kept per process (one per object read)
_ERROR_BODY = 1 << 16  # bytes of an error answer read for its code


def _error_code(body: bytes) -> str:
    """The ``<Code>`` of an S3 error answer, or "" if it holds none."""
    with suppress(ElementTree.ParseError):
        for element in ElementTree.fromstring(body).iter():
            if element.tag.rsplit("}", 1)[-1] == "Code":
                return element.text or ""
    return ""


def _on_aws(url: str | None) -> bool:
    """Whether an endpoint is AWS S3's own (virtual-hosted addressing, not a server's paths)."""
    return bool(url) and (urlsplit(url or "").hostname or "").endswith(".amazonaws.com")


def _named(url: str) -> str:
    """An endpoint URL botocore found (an ``endpoint_url`` of the AWS config file) as messages
    name it: ``scheme://host[:port]``, never a ``user:secret@`` or a query it holds."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError:  # a port that is no number: a secret with a '/' ends the host part before its '@'
        return "the endpoint_url of the AWS config file"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}" + ("" if port is None else f":{port}")


_SESSION: boto3.session.Session | None = None
hide_signatures()  # urllib3 logs the URL of each request: a presigned one's signature is not shown


def _session() -> boto3.session.Session:
    """One boto3 session per process tree (called under the store's connect lock): it keeps
    the loaded service models, so clients made later, also in forked workers, start fast."""
    global _SESSION
    if _SESSION is None:
        _SESSION = boto3.session.Session()
    return _SESSION


CONTINUE_FROM = 2 * 1024 * 1024
"""Bodies from this size are sent after the server's ``100 Continue``, smaller ones at once."""


def _continue_only_for_large_bodies(request: Any, **_: Any) -> None:
    """botocore asks for ``Expect: 100-continue`` on every PUT and POST with a body, and
    sends the body only once the server answers ``100 Continue``: a round trip more per
    request (40-80 ms across regions), spent so that a refused request does not send its
    body. Worth it for a 16 MiB part, not for a task record, the upload state, a manifest
    or a small shard. Below 2 MiB the body goes at once, as the AWS SDK for Go does. The
    header is not signed, so dropping it leaves the signature valid."""
    if int(request.headers.get("Content-Length") or 0) < CONTINUE_FROM:
        request.headers.pop("Expect", None)


@contextmanager
def _setup_errors(endpoint: str) -> Iterator[None]:
    """Translate what botocore raises while it reads the AWS profile and files to make a
    client (a profile that is not there, one with half its keys, a file it cannot parse, a
    credential_process whose output is no JSON) into a ConfigError naming the profile and the
    files, never a key: a traceback before."""
    try:
        yield
    except ConfigError:
        raise
    except bce.ProfileNotFound as exc:
        credentials, config = aws_files()
        raise ConfigError(
            f"the AWS profile {exc.kwargs.get('profile')!r} (AWS_PROFILE) is in neither the AWS credentials file"
            f" {credentials} nor the config file {config}: name a profile they hold, or unset AWS_PROFILE"
        ) from None
    except bce.PartialCredentialsError as exc:
        credentials, config = aws_files()
        profile = _SESSION.profile_name if _SESSION is not None else "default"
        files = {"shared-credentials-file": f"the AWS credentials file {credentials}",
                 "config-file": f"the AWS config file {config}"}
        provider = str(exc.kwargs.get("provider", ""))
        source = f"the AWS profile {profile!r} in {files[provider]}" if provider in files else \
            f"the AWS credentials botocore found ({provider})"
        raise ConfigError(f"{source} has no {exc.kwargs.get('cred_var')}: give both keys there") from None
    except bce.ConfigParseError as exc:
        raise ConfigError(f"the AWS file {exc.kwargs.get('path')} cannot be parsed (an INI file of profiles)") from None
    except bce.BotoCoreError as exc:  # a region no endpoint serves, a credential_process that failed...
        raise ConfigError(f"boto3 could not make a client for {endpoint}: {type(exc).__name__}") from None
    except (ValueError, AttributeError) as exc:  # json.loads of a credential_process's output (keys and all),
        # or "Invalid endpoint: <url>" (secret and all) for an endpoint_url of the AWS config file that is no URL
        cause = (f"the endpoint_url of the AWS config file {aws_files()[1]} is no URL"
                 if isinstance(exc, ValueError) and str(exc).startswith("Invalid endpoint") else
                 "the AWS profile's credential_process printing something else than the JSON botocore reads?")
        raise ConfigError(f"boto3 could not make a client for {endpoint}: {type(exc).__name__} ({cause})") from None


def _raw(body: Any) -> Any:
    """A plain body's urllib3 response, which ``receive_into`` reads; a subclass (one checking
    a checksum, say) reads itself."""
    return getattr(body, "_raw_stream", body) if type(body) is StreamingBody else body

class Boto3Store(RangedStore):
    """An S3-compatible store reached through boto3.

    Args:
        config: Endpoint, credentials, retries and timeouts.
    """

    def __init__(self, config: StorageConfig) -> None:
        super().__init__()
        self.config = config
        self._urls: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self._urls_pid = -1
        self._found_url: str | None = None  # the endpoint botocore chose, where the config names none

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_urls": OrderedDict(), "_urls_pid": -1}

    @classmethod
    def around(cls, client: Any) -> Boto3Store:
        """A store using a caller's boto3 S3 client in this process (see ``RangedStore.lend``),
        configured from the client's public attributes: endpoint, region, timeouts, pool size."""
        meta = client.meta
        if meta.service_model.service_name != "s3":
            raise ConfigError(f"a boto3 client for {meta.service_model.service_name!r} is not an S3 client")
        # The client's own endpoint, AWS's included: a copy in a worker process goes where the
        # client goes, never where that process's AWS_ENDPOINT_URL points.
        config = StorageConfig(endpoint_url=meta.endpoint_url, region=meta.region_name or "us-east-1",
                               connect_timeout=meta.config.connect_timeout, read_timeout=meta.config.read_timeout,
                               max_connections=meta.config.max_pool_connections)
        store = cls(config)
        store.lend(client)
        return store

    @property
    def endpoint(self) -> str:
        url = self._url()
        return f"AWS S3 ({url})" if _on_aws(url) else url or "AWS S3"

    def _url(self) -> str | None:
        """The endpoint URL given, else the one botocore found once the client is made (an
        ``endpoint_url`` of ``~/.aws/config``) where that is not AWS S3's default."""
        found = self._found_url
        return self.config.endpoint_url or (found if found is not None and not _on_aws(found) else None)

    def __repr__(self) -> str:
        return f"Boto3Store(endpoint_url={self.config.endpoint_url!r}, region={self.config.region!r})"

    def _connect(self) -> Any:
        with _setup_errors(self.endpoint):
            return self._new_client()

    def _new_client(self) -> Any:
        c = self.config
        if self._borrowed and c.access_key is None and _session().get_credentials() is None:
            raise ConfigError(self._borrowed_elsewhere())
        client = _session().client(
            "s3",
            endpoint_url=c.endpoint_url,
            aws_access_key_id=c.access_key,
            aws_secret_access_key=c.secret_key,
            aws_session_token=c.session_token,
            region_name=c.region,
            config=Config(
                retries={"total_max_attempts": c.max_attempts, "mode": "standard"},  # 1: our policy retries
                connect_timeout=c.connect_timeout,
                read_timeout=c.read_timeout,
                max_pool_connections=c.max_connections,
                signature_version="s3v4",
                # Bodies are not hashed into the signature (UNSIGNED-PAYLOAD), on http too,
                # where botocore otherwise SHA-256es every byte sent: up to a quarter of an
                # uploading process's CPU. Every byte is checked against its crc32 when read, https carries its
                # own integrity, and the minio backend sends parts on presigned URLs alike.
                s3={"addressing_style": "path" if c.endpoint_url and not _on_aws(c.endpoint_url) else "auto",
                    "payload_signing_enabled": False},
                # S3-compatible servers differ in their support of flexible checksums;
                # our own crc32s guard the data.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        client.meta.events.register("before-send.s3", _continue_only_for_large_bodies)
        self._found_url = _named(client.meta.endpoint_url)
        return client

    @contextmanager
    def _errors(self, operation: str, bucket: str | None = None, key: str | None = None) -> Iterator[None]:
        """Translate every boto3 and connection exception raised inside into our types. The
        endpoint is named as it is known after the request: the client is made by then."""
        try:
            yield
        except bce.ClientError as exc:
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            raise error_for(
                str(error.get("Code", "")), status, operation=operation, bucket=bucket, key=key, endpoint=self.endpoint
            ) from None
        except _UNREACHABLE:
            raise EndpointUnreachable(
                f"cannot connect to {self.endpoint} ({operation})", bucket=bucket, key=key, code="Unreachable"
            ) from None
        except _TRANSIENT as exc:
            raise TransientStorageError(
                f"connection to {self.endpoint} failed during {operation} ({type(exc).__name__})",
                bucket=bucket,
                key=key,
                code=type(exc).__name__,
            ) from None
        except (bce.NoCredentialsError, bce.PartialCredentialsError):
            # With no endpoint either, the user most likely meant another server than AWS S3.
            other = "" if self._url() else (
                ", and AWS_ENDPOINT_URL (or pass endpoint_url, the CLI's --endpoint-url) for another server than AWS S3"
            )
            raise AccessDenied(
                f"no credentials for {self.endpoint}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY{other}",
                code="NoCredentials",
            ) from None
        except bce.ParamValidationError as exc:  # refused before it was sent: an invalid bucket name, say
            if bucket is not None and bucket_name_problem(bucket):  # said as the minio backend says it
                raise error_for("InvalidBucketName", None, operation=operation, bucket=bucket, key=key,
                                endpoint=self.endpoint) from None
            detail = one_line(" ".join(str(exc).split()).removeprefix("Parameter validation failed: "))
            raise StorageError(f"{operation} refused: {detail}"[:300], bucket=bucket, key=key,
                               code="InvalidParameter") from None
        except bce.BotoCoreError as exc:
            raise StorageError(f"{operation} failed: {type(exc).__name__}", bucket=bucket, key=key) from None

    def _read(self, bucket: str, key: str, byte_range: str | None,
              if_match: str | None = None) -> tuple[bytes, str | None]:
        operation = "GET" if byte_range is None else f"GET {byte_range}"
        extra = {} if byte_range is None else {"Range": byte_range}
        if if_match is not None:
            extra["IfMatch"] = if_match
        with self._errors(operation, bucket, key):
            response = self._sdk().get_object(Bucket=bucket, Key=key, **extra)
            body = response["Body"]
            try:
                return read_body(_raw(body), self.config.read_timeout), response.get("ContentRange")
            finally:
                body.close()

    def get_range_into(self, bucket: str, key: str, start: int, end: int, out: memoryview, *,
                       if_match: str | None = None) -> None:
        """Receive the body straight into ``out``: no intermediate bytes object.

        The request goes on a URL the client presigned for the object, through the client's
        own connection pool (its TLS and proxy settings): a request through botocore costs
        about 1.2 ms of Python (endpoint rules, signing, event hooks, parsing), which a
        process streaming 8 MiB ranges pays once per 70 samples, holding the GIL. A URL
        serves every range of its object for an hour; one that has expired is signed anew.
        """
        start, end = byte_bounds(start, end)
        if end <= start:
            return
        byte_range = f"bytes={start}-{end - 1}"
        client = self._sdk()
        session = getattr(getattr(client, "_endpoint", None), "http_session", None)
        if not isinstance(session, URLLib3Session):  # another transport: botocore's own call
            self._get_object_into(bucket, key, start, end, out, if_match)
            return
        headers = {"Range": byte_range} if if_match is None else {"Range": byte_range, "If-Match": if_match}
        with self._errors(f"GET {byte_range}", bucket, key):
            for fresh in (False, True):
                request = AWSRequest(method="GET", url=self._presigned(client, bucket, key, fresh),
                                     headers=headers, stream_output=True)
                response = session.send(request.prepare())
                try:
                    if response.status_code < 300:
                        check_answer(bucket, key, start, end, response.headers.get("Content-Range"))
                        filled = receive_into(response.raw, out, self.config.read_timeout)
                        break
                    code = _error_code(response.raw.read(_ERROR_BODY))
                finally:
                    response.raw.close()  # the connection goes back to the pool once its body was read
                if response.status_code != 403 or fresh:  # a 403 may be an expired URL: signed anew once
                    raise error_for(code, response.status_code, operation=f"GET {byte_range}", bucket=bucket,
                                    key=key, endpoint=self.endpoint)
        check_range(bucket, key, start, end, b"", got=filled)

    def _presigned(self, client: Any, bucket: str, key: str, fresh: bool) -> str:
        """A presigned GET URL of the object, kept while it is valid (per process)."""
        if self._urls_pid != os.getpid():
            self._urls, self._urls_pid = OrderedDict(), os.getpid()
        now = time.monotonic()
        kept = self._urls.get((bucket, key))
        if kept is not None and kept[1] > now and not fresh:
            return kept[0]
        url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key},
                                            ExpiresIn=_PRESIGNED_FOR)
        self._urls[(bucket, key)] = (url, now + _PRESIGNED_FOR - _RENEW_BEFORE)
        while len(self._urls) > _URLS_KEPT:
            self._urls.popitem(last=False)
        return str(url)

    def _get_object_into(self, bucket: str, key: str, start: int, end: int, out: memoryview,
                         if_match: str | None) -> None:
        byte_range = f"bytes={start}-{end - 1}"
        condition = {} if if_match is None else {"IfMatch": if_match}
        with self._errors(f"GET {byte_range}", bucket, key):
            response = self._sdk().get_object(Bucket=bucket, Key=key, Range=byte_range, **condition)
            body = response["Body"]
            try:
                check_answer(bucket, key, start, end, response.get("ContentRange"))
                filled = receive_into(_raw(body), out, self.config.read_timeout)
            finally:
                body.close()
        check_range(bucket, key, start, end, b"", got=filled)

    def head(self, bucket: str, key: str) -> int:
        with self._errors("HEAD", bucket, key):
            return object_length(bucket, key, self._sdk().head_object(Bucket=bucket, Key=key).get("ContentLength"))

    def get_versioned(self, bucket: str, key: str) -> tuple[bytes, str]:
        with self._errors("GET", bucket, key):
            response = self._sdk().get_object(Bucket=bucket, Key=key)
            try:
                return read_body(_raw(response["Body"]), self.config.read_timeout), str(response.get("ETag", ""))
            finally:
                response["Body"].close()

    def put(self, bucket: str, key: str, data: bytes | bytearray | memoryview, *,
            if_none_match: bool = False, if_match: str | None = None) -> None:
        conditions = {"IfNoneMatch": "*"} if if_none_match else {}
        if if_match is not None:
            conditions["IfMatch"] = if_match
        with self._errors("PUT", bucket, key):
            self._sdk().put_object(Bucket=bucket, Key=key, Body=bytes(data), ChecksumCRC32=crc32_header(data),
                                   **conditions)

    def open_writer(self, bucket: str, key: str, *, part_size: int = DEFAULT_PART_SIZE) -> ObjectWriter:
        return _Boto3Writer(self, bucket, key, part_size)

    def list(self, bucket: str, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        with self._errors("LIST", bucket, prefix or None):
            after = {} if start_after is None else {"StartAfter": start_after}
            pages = self._sdk().get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix, PaginationConfig={"PageSize": self.list_page_size}, **after
            )
            for page in pages:
                for item in page.get("Contents", []):
                    yield ObjectInfo(key=item["Key"], size=int(item["Size"]), etag=str(item.get("ETag", "")))

    def delete(self, bucket: str, key: str) -> None:
        with self._errors("DELETE", bucket, key):
            self._sdk().delete_object(Bucket=bucket, Key=key)

    def abort_uploads(self, bucket: str, prefix: str = "") -> int:
        count = 0
        with self._errors("abort multipart uploads", bucket, prefix or None):
            client = self._sdk()
            for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
                for upload in page.get("Uploads", []):
                    client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                    count += 1
        return count

    def create_bucket(self, bucket: str) -> None:
        try:
            with self._errors("create bucket", bucket):
                self._sdk().create_bucket(Bucket=bucket)
        except StorageError as exc:
            if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def close(self) -> None:
        own = self._own_client()
        if own is not None:
            own.close()
        super().close()


class _Boto3Writer(MultipartWriter[Boto3Store, dict[str, Any]]):
    def _create_request(self) -> str:
        created = self._store._sdk().create_multipart_upload(
            Bucket=self.bucket, Key=self.key, ChecksumAlgorithm="CRC32")
        return str(created["UploadId"])

    def _part_request(self, number: int, part: bytes) -> dict[str, Any]:
        checksum = crc32_header(part)
        response = self._store._sdk().upload_part(
            Bucket=self.bucket, Key=self.key, UploadId=self._upload_id, PartNumber=number, Body=part,
            ChecksumCRC32=checksum,
        )
        return {"ETag": response["ETag"], "PartNumber": number, "ChecksumCRC32": checksum}

    def _complete_request(self, parts: list[tuple[int, dict[str, Any]]]) -> None:
        self._store._sdk().complete_multipart_upload(
            Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
            MultipartUpload={"Parts": [part for _, part in parts]}
        )

    def _abort_request(self) -> None:
        self._store._sdk().abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id)
