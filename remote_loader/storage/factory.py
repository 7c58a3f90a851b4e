"""Build a store from a URL and credentials, and split dataset URLs into (bucket, prefix)."""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from remote_loader.config import BACKENDS, StorageConfig
from remote_loader.errors import ConfigError
from remote_loader.storage.base import BUCKET_NAME_RULE, Store, bucket_name_problem
from remote_loader.storage.local import LocalStore
from remote_loader.storage.s3_boto3 import Boto3Store

Backend = Literal["boto3", "minio"]

_HOST_PORT = re.compile(r"^[A-Za-z0-9.-]+:\d+$")
_SCHEMES = ("s3://", "http://", "https://", "file://")
_SCHEME_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_EXPLICIT_PATH = ("/", "./", "../", "~/")
_MISTYPED_SCHEME = re.compile(r"^(s3|https?)[:/]+(?=[^:/])", re.IGNORECASE)
_NOT_IN_BUCKETS = re.compile(r"[^A-Za-z0-9._-]")
"""What no S3 SDK sends as a bucket's name (older buckets may hold capitals and ``_``)."""


_USERINFO = r"(?:[^/@]*|[^@]*:[^@]*)@"
"""``user@``, or ``key:secret@`` whatever the secret holds but ``@`` (an AWS secret key may hold ``/``)."""


def redact(url: str) -> str:
    """``url`` for messages: any ``user:secret@`` part replaced by ``***@``, also after a
    mistyped scheme (``s3:/key:secret@bucket``) or none (``key:secret@host:port``) and where
    the secret holds a ``/``; the query of a URL other than ``s3://`` (whose key may hold a
    ``?``) by ``?...``."""
    if _SCHEME_LIKE.match(url) and "://" in url and not url.startswith("s3://"):
        url = re.sub(r"\?.*", "?...", url, count=1, flags=re.DOTALL)  # a query may hold a presigned URL's signature
    url = re.sub(r"(?<=//)" + _USERINFO, "***@", url, count=1)
    url = re.sub(r"^((?:s3|https?|file)[:/]+)(?!\*\*\*@)" + _USERINFO, r"\1***@", url, flags=re.IGNORECASE)
    if "***@" in url:
        return url
    return re.sub(r"^(?![A-Za-z][A-Za-z0-9+.-]*:/)[^/@:]*:[^@]*@", "***@", url)  # key:secret@host:port, no scheme


def _meant(url: str) -> str:
    """`` (did you mean s3://b/p?)`` for a URL whose ``://`` was mistyped (``s3:/b/p``,
    ``s3:b/p``, ``s3:///b/p``, ``s3//b/p``), else nothing."""
    match = _MISTYPED_SCHEME.match(url)
    meant = f"{match.group(1).lower()}://{url[match.end():]}" if match else url
    return f" (did you mean {redact(meant)}?)" if meant != url else ""


def _kind(url: str, *, endpoint_ok: bool) -> Literal["local", "s3", "endpoint"]:
    """What ``url`` names: a local directory, an ``s3://`` dataset, or (where ``endpoint_ok``)
    an http(s) endpoint. Anything that looks like a URL and is not a valid one is refused:
    a typo must not become a directory named ``s3:`` beside the caller."""
    if not isinstance(url, str) or not url:
        value = "" if isinstance(url, (bytes, bytearray, memoryview)) else f" {url!r}"  # bytes may hold user:secret@
        raise ConfigError(f"expected a URL or a local path, got {type(url).__name__}{value}"[:200])
    shown = redact(url)
    if url != url.strip():
        raise ConfigError(f"{shown!r} has leading or trailing whitespace")
    lower = url.lower()
    for scheme in _SCHEMES:
        if lower.startswith(scheme) and not url.startswith(scheme):
            raise ConfigError(f"{shown!r}: write the scheme in lower case, {scheme}{shown[len(scheme):]}")
    if url.startswith("file://"):
        return "local"
    if url.startswith("s3://"):
        if redact(url) != url:  # key:secret@, the secret perhaps with a '/' in it
            raise ConfigError("the URL holds credentials (key:secret@bucket), which are not used from there: pass"
                              " access_key and secret_key, or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        return "s3"
    if url.startswith(("http://", "https://")) or (endpoint_ok and _HOST_PORT.match(url)):
        if not endpoint_ok:
            raise ConfigError(f"{shown!r} is an endpoint, not a dataset: a dataset is s3://bucket/prefix (the endpoint"
                              " goes in endpoint_url or AWS_ENDPOINT_URL)")
        return "endpoint"
    if url.startswith(_EXPLICIT_PATH) or url in (".", "..", "~"):
        return "local"
    if _SCHEME_LIKE.match(url) or "://" in url or url.startswith(("s3:", "http", "file:")) or "//" in url:
        raise ConfigError(f"{shown!r} is not a valid URL{_meant(url)}: use s3://bucket/prefix, http(s)://host:port,"
                          " file:///path, or a local path starting with / or ./")
    hint = f"did you mean s3://{shown}? " if "/" in url or not endpoint_ok else ""
    raise ConfigError(f"{shown!r} is neither a URL nor an explicit local path: {hint}(for a local directory write"
                      f" ./{shown} or an absolute path)")


def _is_local(url: str, *, endpoint_ok: bool = False) -> bool:
    return _kind(url, endpoint_ok=endpoint_ok) == "local"


def _local_path(url: str) -> Path:
    if url.startswith("file://"):
        # Split by hand, as s3:// URLs are: urlsplit drops a path's tabs and cuts its '?' off.
        host, slash, path = url.removeprefix("file://").partition("/")
        if host not in ("", "localhost"):
            raise ConfigError(f"file URL {redact(url)!r} names a host; use file:///absolute/path")
        return Path(slash + path)
    return Path(url).expanduser()


def make_client(
    url: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    *,
    region: str | None = None,
    backend: Backend = "boto3",
    config: StorageConfig | None = None,
) -> Store:
    """Return a store usable everywhere in remote_loader.

    Args:
        url: Where the store is:

            * ``http(s)://host:port`` or ``host:port``: an S3-compatible endpoint;
            * ``s3://bucket/prefix`` or None: the endpoint from the environment
              (``AWS_ENDPOINT_URL``, ``MINIO_ENDPOINT``), or AWS S3 if none is set;
            * ``file:///path`` or a plain path: a local directory whose subdirectories
              are buckets.
        access_key: Access key id; default from ``AWS_ACCESS_KEY_ID`` / ``MINIO_ACCESS_KEY``.
        secret_key: Secret key; default from ``AWS_SECRET_ACCESS_KEY`` / ``MINIO_SECRET_KEY``.
        region: Signing region; default from ``AWS_DEFAULT_REGION``, else ``us-east-1``.
        backend: ``"boto3"`` (default) or ``"minio"`` for S3 endpoints.
        config: A complete config; when given, the other connection arguments must be None.

    Examples:
        >>> client = make_client("http://127.0.0.1:9000", "minioadmin", "minioadmin")
    """
    if backend not in BACKENDS or backend == "local":
        raise ConfigError(f"backend must be 'boto3' or 'minio', got {backend!r}")
    if url is not None and _is_local(url, endpoint_ok=True):
        return LocalStore(_local_path(url))
    if config is None:
        endpoint = url if url is not None and not url.startswith("s3://") else None
        config = StorageConfig.from_env(
            endpoint_url=endpoint, access_key=access_key, secret_key=secret_key, region=region
        )
    elif access_key or secret_key or region or (url and not url.startswith("s3://")):
        raise ConfigError("pass either config or url/access_key/secret_key/region, not both")
    if backend == "minio":
        # Imported when asked for: most processes never use minio, and it costs ~0.1 s to import.
        from remote_loader.storage.s3_minio import MinioStore

        return MinioStore(config)
    return Boto3Store(config)


def as_store(client: Any, bucket: str) -> Store:
    """The store behind what a caller gave as ``client``: a store from ``make_client`` as it
    is, or a caller's own boto3 S3 client or ``minio.Minio``, used as it is in this process
    (``RangedStore.lend``: another process, such as a DataLoader worker, makes its own client
    for the same endpoint, with its environment's credentials). ``bucket`` is the one the
    caller works in (minio names its endpoint only for a bucket)."""
    if isinstance(client, Store):
        return client
    kind = f"{type(client).__module__}.{type(client).__name__}"
    if kind.startswith("botocore.client.") and hasattr(client, "meta"):
        return Boto3Store.around(client)
    if kind == "minio.api.Minio":
        from remote_loader.storage.s3_minio import MinioStore  # minio is imported only by those who use it

        return MinioStore.around(client, bucket)
    raise ConfigError(
        f"client must be a store from remote_loader.make_client, a boto3 S3 client or a minio.Minio, got {kind}"
    )


@dataclass(frozen=True)
class Location:
    """A dataset's place: the bucket and its folder inside it (``base_folder``, the key
    prefix of its objects), as every dataset and upload call names them. A local dataset
    also keeps the path it was named by (``path``): messages show that path, not a bucket."""

    bucket: str
    base_folder: str
    path: str = field(default="", compare=False)

    def key(self, name: str) -> str:
        """Return the full key of object ``name`` inside the dataset's folder."""
        return f"{self.base_folder}/{name}" if self.base_folder else name

    def __str__(self) -> str:
        return self.path or f"s3://{self.bucket}/{self.base_folder}"


def parse_location(url: str) -> Location:
    """Split ``s3://bucket/prefix`` into a Location; a local path (``./data/ds``,
    ``/data/ds``, ``file:///data/ds``) is the dataset's directory: a ``LocalStore`` rooted at
    its parent holds it as its bucket (``open_location``), so nothing outside it is written.
    """
    if _kind(url, endpoint_ok=False) == "s3":
        # Split by hand: urlsplit drops tabs and newlines (another bucket than the one
        # written), cuts a key's '?' or '#' off, and raises a bare ValueError on a '['.
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        prefix = prefix.strip("/")
        if not bucket:
            raise ConfigError(f"dataset URL {redact(url)!r} has no bucket{_meant(url)}")
        if not bucket.isascii() or _NOT_IN_BUCKETS.search(bucket):
            raise ConfigError(f"dataset URL {redact(url)!r} names no bucket an S3 store can hold:"
                              f" {bucket_name_problem(bucket) or repr(bucket)}; {BUCKET_NAME_RULE}")
        if not prefix.isprintable():
            raise ConfigError(f"dataset URL {redact(url)!r} holds a control character; a dataset's prefix holds none")
        return Location(bucket=bucket, base_folder=prefix)
    path = _local_path(url).expanduser().resolve()
    if path == path.parent:
        raise ConfigError(f"{url!r} is the file system's root, not a dataset's directory")
    return Location(bucket=path.name, base_folder="", path=path.as_posix())


def open_location(
    url: str,
    *,
    endpoint_url: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    region: str | None = None,
    backend: Backend = "boto3",
) -> tuple[Store, Location]:
    """Return the store and location of a dataset URL (``s3://...`` or a local path: the
    store is rooted at the path's parent and the path is its bucket)."""
    location = parse_location(url)
    if _is_local(url):
        return LocalStore(Path(location.path).parent), location
    return make_client(endpoint_url or url, access_key, secret_key, region=region, backend=backend), location


CONNECTION = ("endpoint_url", "access_key", "secret_key", "region", "backend")
"""The keywords a dataset given a URL passes on to ``open_location``."""

_ELSEWHERE = {
    "prefix": "the dataset's prefix is base_folder",
    "folder": "the dataset's prefix is base_folder",
    "shuffle": "a shuffle buffer is .shuffle(bufsize), a method of the dataset",
    "batch_size": "batches are .batched(batch_size), a method of the dataset",
    "num_workers": "workers are the DataLoader's: loader(ds, num_workers=...)",
}
_METHODS = {"shuffle": "shuffle", "batch_size": "batched"}


def check_connection(owner: type, connection: Mapping[str, Any], with_url: bool) -> None:
    """Refuse what a dataset class's ``**connection`` caught that is no connection option (a
    mistyped keyword: ``TypeError``, as Python's own, with the nearest name), or connection
    options given with a store of the user's own (``ConfigError``)."""
    for key in connection:
        if key in CONNECTION:
            continue
        known = [p for p in inspect.signature(owner).parameters if p != "connection"]
        hint = _ELSEWHERE.get(key)
        if key in _METHODS and not hasattr(owner, _METHODS[key]):
            hint = "the DataLoader's, or its sampler's"
        hint = hint or next((f"did you mean {near!r}?" for near in
                             difflib.get_close_matches(key, [*known, *CONNECTION], n=1)), None)
        said = f"{owner.__name__}() got an unexpected keyword argument {key!r}"
        raise TypeError(said + (f" ({hint})" if hint else ""))
    if connection and not with_url:
        raise ConfigError(f"{', '.join(sorted(connection))}: connection options go with a URL, not a store")
