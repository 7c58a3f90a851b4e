"""Read an uploaded dataset shard by shard: the manifest, each shard's index, its samples.

This is where bytes from storage meet the format; the streaming and map-style datasets and
the CLI build on it.
"""

from __future__ import annotations

import itertools
import logging
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any, TypeVar

from remote_loader.checks import require_bool, require_int, shown
from remote_loader.checksum import crc32
from remote_loader.config import CacheConfig, FetchConfig, fetch_config
from remote_loader.errors import (
    ConfigError,
    CorruptSampleError,
    CorruptShard,
    DatasetChanged,
    DatasetNotFound,
    FormatError,
    InvalidRange,
    ObjectNotFound,
    RemoteLoaderError,
    StorageError,
    TruncatedShard,
)
from remote_loader.format import MANIFEST_NAME, UPLOAD_STATE, Manifest, Sample, ShardEntry, ShardIndex, ShardView
from remote_loader.format.manifest import datasets_inside
from remote_loader.format.pages import PagedTable
from remote_loader.format.shard_counts import Counts
from remote_loader.format.tar import COMPRESSED_TARS, scan_tar
from remote_loader.read.heap import release_free_memory
from remote_loader.read.metrics import Metrics
from remote_loader.read.node_cache import NodeCache
from remote_loader.read.session import ReadSession, Shard
from remote_loader.read.upload_cache import UploadCache, open_upload
from remote_loader.read.whole import fetch_whole
from remote_loader.storage import Location, Store, as_store
from remote_loader.storage.base import ObjectInfo

T = TypeVar("T")

log = logging.getLogger("remote_loader")



def _identity(manifest: bytes | bytearray) -> int:
    """The manifest's own crc32 trailer: it differs between any two uploads (the upload id,
    the shard names, the time). Not the crc32 of all its bytes: with the trailer that is a
    constant of the CRC."""
    return int(struct.unpack("<I", manifest[-4:])[0])


@dataclass
class ShardReport:
    """The result of checking one shard: empty ``problems`` means it is sound."""

    name: str
    samples: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class DatasetReader:
    """A dataset in a bucket, read through its manifest.

    Args:
        client: The store (``make_client``), or a boto3 S3 client or ``minio.Minio`` of your own.
        bucket: The bucket.
        base_folder: The dataset's key prefix.
        verify: Check crc32s of indexes and sample members as they are read (always, where
            ``cache`` checks every read: ``CacheConfig.verify_reads``).
        fetch: Checksum refetches and, in ``fetch.retry``, how requests are retried.
        cache_pages: Pages of a version 3 manifest kept once read (each holds 4,096 shards'
            sizes, index places and checksums: about 60 kB).
        cache: A node-local shard cache (docs/cache.md): shards kept whole on local disk
            once fetched, read from there again.

    Examples:
        >>> reader = DatasetReader(client, "bucket", "imagenet-val")
        >>> for sample in reader:
        ...     sample["__key__"], bytes(sample["jpg"])[:2]
    """

    def __init__(self, client: Store | Any, bucket: str, base_folder: str, *, verify: bool = True,
                 fetch: FetchConfig | None = None, cache_pages: int = 32, cache: CacheConfig | None = None,
                 views: bool = False) -> None:
        if not isinstance(bucket, str) or not bucket:
            raise ConfigError(f"bucket must be a non-empty string, got {shown(bucket)}")
        if not isinstance(base_folder, str):  # a Path's separators are no key's
            raise ConfigError(f"base_folder must be a string (the dataset's key prefix), got {shown(base_folder)}")
        require_bool("verify", verify)  # None or 0 would turn every checksum off without a word
        require_bool("views", views)
        self.client = as_store(client, bucket)
        base_folder = base_folder.strip("/")
        self.location = Location(bucket, base_folder, self.client.path_of(bucket, base_folder))
        self.verify = verify or (isinstance(cache, CacheConfig) and cache.verify_reads)
        """Whether crc32s are checked: asked for, or implied by a cache that checks every read (a
        member it reads again after a failed check may come from the store)."""
        self.views = views
        """Members as read-only memoryviews (of the mapped file, from the node's cache), not bytes."""
        self.fetch = fetch_config(fetch)
        self.cache_pages = require_int("cache_pages", cache_pages, 1)
        if cache is not None and not isinstance(cache, CacheConfig):
            raise ConfigError(f"cache must be a CacheConfig, got {type(cache).__name__}")
        self.cache = cache
        self._identity: int | None = None  # of the manifest read
        self._upload_cache: UploadCache | None = None  # kept alive, not read: asked of open_upload each time
        self.after_change = "open it again to read the new upload"
        """What a ``DatasetChanged`` of this reader advises: its owner says what reads the new upload."""
        self.replaced_by: int | None = None
        """Once this reader raised ``DatasetChanged``: the identity of the upload it found in
        place of its own (-1 where the dataset was removed)."""
        self.round_trip: float | None = None
        """Seconds the manifest's first GET took beyond its transfer at 1 GB/s, once read: a
        network's round trip or a nearby store's; the fetcher starts wide after a long one."""
        self._compressed_told = False  # whether ``listed_tars`` warned of compressed tars it left out

    def session(self, metrics: Metrics | None = None, cancel: threading.Event | None = None,
                fetch: FetchConfig | None = None) -> ReadSession:
        """The requests on behalf of this reader: a retrying store, counted in ``metrics``,
        fetched with ``fetch`` (default the reader's own)."""
        return ReadSession(fetch or self.fetch, metrics or Metrics(), self.client, cancel,
                           self.upload_cache if self.cache is not None else None)

    def upload_cache(self) -> UploadCache | None:
        """This process's view of the node's cache of the upload read (None without a cache),
        kept while this reader lives: its folders are closed once no reader uses it."""
        if self.cache is None:
            return None
        self._upload_cache = open_upload(NodeCache(self.cache), self.client.endpoint, str(self.location),
                                         self.identity)
        return self._upload_cache

    def __repr__(self) -> str:
        return f"DatasetReader({self.location}, client={self.client!r})"

    @property
    def identity(self) -> int:
        """The manifest's identity (its crc32 trailer): different for any two uploads, so a
        checkpoint names the dataset it was taken on."""
        _ = self.manifest
        assert self._identity is not None
        return self._identity

    @property
    def upload_read(self) -> int | None:
        """The identity of the upload whose manifest this reader read (in this process or the
        one it was copied from), without a request; None before it read one."""
        return self._identity

    def reopened(self) -> DatasetReader:
        """A reader of this dataset as it is now, with the same settings: its manifest read
        anew, the upload a new reader would read (``DatasetNotFound`` where there is none)."""
        fresh = object.__new__(type(self))
        fresh.__dict__.update(self.__getstate__())
        fresh._identity = fresh.replaced_by = fresh.round_trip = None
        _ = fresh.manifest
        return fresh

    def changed(self, found: int | None, when: str, advice: str | None = None) -> DatasetChanged:
        """The error for this dataset found replaced by upload ``found`` (None: removed)
        ``when``, advising ``advice`` (default ``after_change``); ``replaced_by`` remembers it."""
        self.replaced_by = -1 if found is None else found
        now = "removed" if found is None else "replaced by another upload"
        return DatasetChanged(f"the dataset at {self.location} was {now} {when}; {advice or self.after_change}",
                              bucket=self.location.bucket, key=self.location.key(MANIFEST_NAME))

    @property
    def classes(self) -> list[str]:
        """The class names recorded at upload (an image folder's, or ``ds.classes``): class
        ``i`` is ``classes[i]``; empty where none were recorded."""
        return [str(name) for name in self.manifest.params.get("classes") or []]

    @cached_property
    def manifest(self) -> Manifest:
        """The dataset's manifest, fetched on first use (again, if its bytes arrive damaged)."""
        data = self._manifest_bytes()
        if data is None:
            raise DatasetNotFound(f"no dataset at {self.location}: {self._why_no_manifest()}",
                                  bucket=self.location.bucket, key=self.location.key(MANIFEST_NAME), code="NoSuchKey")
        manifest = Manifest.decode(data, name=f"{self.location}/{MANIFEST_NAME}", trailer_checked=True,
                                   load=self._pages)
        if self._identity is not None and _identity(data) != self._identity:
            raise self.changed(_identity(data), "since this reader first read it")
        self._identity = _identity(data)
        if isinstance(manifest.shards, PagedTable):
            manifest.shards.keep = self.cache_pages
        del data
        release_free_memory()
        return manifest

    @property
    def counts(self) -> Counts:
        """Samples per shard, in manifest order: runs (version 3) or one int64 array, so the
        per-epoch split and lookups are array operations."""
        return self.manifest.shards.counts

    def _pages(self, name: str, size: int, start: int, end: int, parse: Callable[[bytes], T]) -> T:
        """A version 3 manifest's pages ``[start, end)`` of object ``name`` (``size`` bytes), parsed;
        fetched again while they fail their checksum, then told apart from a dataset replaced."""
        session, key = self.session(), self.location.key(name)

        def fetch() -> bytes:
            try:
                data, real = session.store.get_range_and_size(self.location.bucket, key, start, end)
            except (ObjectNotFound, InvalidRange):
                real, data = -1, b""
            if real != size:
                raise TruncatedShard(f"manifest pages {self.location}/{name} are {max(real, 0):,d} bytes; the manifest"
                                     f" says {size:,d}: they were removed, truncated or replaced", name=name)
            return data

        try:
            return session.refetch(fetch, parse)
        except CorruptShard as exc:
            self.check_unchanged(exc)
            raise

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to a spawned worker) without the manifest: the worker fetches it once
        and checks it is the one this reader read, instead of receiving a copy in the pickle."""
        state = self.__dict__.copy()
        state.pop("manifest", None)
        state.pop("counts", None)
        state["_upload_cache"] = None  # this process's open folders
        return state

    def _manifest_bytes(self) -> bytes | bytearray | None:
        """The manifest's bytes (fetched again while damaged), or None if there is none."""
        key = self.location.key(MANIFEST_NAME)
        session = self.session()

        def parse(data: bytes | bytearray) -> bytes | bytearray:
            if len(data) < 5 or struct.unpack("<I", data[-4:])[0] != crc32(memoryview(data)[:-4]):
                raise CorruptShard(f"manifest {self.location}/{MANIFEST_NAME} fails its crc32 check", name=key)
            return data

        try:
            return session.refetch(partial(fetch_whole, session, self.location.bucket, key, self._timed), parse)
        except ObjectNotFound:
            return None

    def _timed(self, seconds: float, nbytes: int) -> None:
        self.round_trip = max(0.0, seconds - nbytes / 1e9)

    def check_current(self) -> None:
        """Raise DatasetChanged if the dataset was replaced or removed since its manifest was
        read (one GET of the manifest; nothing where it was never read, or cannot be now). A
        reader whose shards come from a node's cache asks at the start of every pass: without
        the cache, the old shards' absence from the store tells it."""
        if "manifest" in self.__dict__:  # else its first read in this process checks it (a new worker)
            self.check_unchanged("seen as a pass began")

    def check_unchanged(self, error: BaseException | str) -> None:
        """Raise DatasetChanged if the dataset was replaced since its manifest was read.

        Called when a shard is missing or its index does not match the manifest: it tells a
        dataset overwritten under a running reader apart from damage or a storage fault.
        """
        if self._identity is None:
            return
        try:
            data = self._manifest_bytes()
        except (StorageError, CorruptShard):
            return  # the original error says more
        if data is None or _identity(data) != self._identity:
            raise self.changed(None if data is None else _identity(data), f"while being read ({error})") from None

    def _why_no_manifest(self) -> str:
        """What lies at a prefix without a manifest, and what to do about it."""
        try:
            return self._what_lies_there()
        except StorageError:  # the missing manifest is the error to report, not this look around
            return f"{MANIFEST_NAME} is missing"

    def _what_lies_there(self) -> str:
        store, where = self.session().store, self.location
        if store.exists(where.bucket, where.key(UPLOAD_STATE)):
            return (f"an upload to it has not finished (it has {UPLOAD_STATE} but no {MANIFEST_NAME}): run the upload"
                    " again to finish it; its shards are not a dataset until then")
        listing = [o.key for o in itertools.islice(store.list(where.bucket, where.key("")), 1000)]
        inside = datasets_inside(listing, where.key(""))
        if inside:
            shown = ", ".join(
                str(Location(where.bucket, d, f"{where.path}/{d[len(where.key('')) :]}" if where.path else ""))
                for d in inside[:5]
            )
            return (
                f"it holds no dataset itself, but {len(inside)}{'+' if len(listing) == 1000 else ''} below it:"
                f" {shown}{', ...' if len(inside) > 5 else ''}; name one of those"
            )
        if any(key.endswith(".tar") for key in listing):
            return (
                f"it holds .tar objects but no {MANIFEST_NAME}: to read tars written by other tools, index them"
                f" once with `remote-loader index {where}` (or stream them unindexed with"
                " RemoteDataset(..., unindexed=True))"
            )
        return f"{MANIFEST_NAME} is missing (is the bucket or prefix mistyped?)"

    def has_manifest(self) -> bool:
        """Whether the dataset has a manifest (fetching it if not yet fetched)."""
        try:
            _ = self.manifest
        except ObjectNotFound:
            return False
        return True

    def list_tars(self, warn: bool = True) -> list[tuple[str, int]]:
        """``(name, size)`` of every ``.tar`` object under the prefix, in name order (``listed_tars``)."""
        return [(tar.key, tar.size) for tar in self.listed_tars(warn)]

    def listed_tars(self, warn: bool = True) -> list[ObjectInfo]:
        """Every ``.tar`` object under the prefix as listed, named within it (``key``), in name
        order, with its version tag (``etag``, "" where the store lists none). Compressed
        tars (``COMPRESSED_TARS``) are left out: they cannot be read by byte range. With
        ``warn``, the first time this reader lists them, a warning says so."""
        prefix = self.location.key("")
        tars, compressed = [], []
        for o in self.session().store.list(self.location.bucket, prefix):
            if o.key.endswith(".tar"):
                tars.append(ObjectInfo(o.key[len(prefix) :], o.size, o.etag))
            elif o.key.endswith(COMPRESSED_TARS):
                compressed.append(o.key[len(prefix) :])
        if compressed and warn and not self._compressed_told:
            self._compressed_told = True
            many = len(compressed) > 1
            log.warning("left out %d compressed tar%s under %s (%s%s): a compressed tar cannot be read by byte range;"
                        " decompress each to a .tar to stream it", len(compressed), "s" if many else "",
                        self.location, min(compressed), ", ..." if many else "")
        return sorted(tars, key=lambda tar: tar.key)

    def __len__(self) -> int:
        return self.counts.total

    def parse_index(self, entry: ShardEntry, data: bytes | memoryview) -> ShardIndex:
        """Check index bytes against the manifest's crc32 (when verifying) and decode them."""
        if self.verify and crc32(data) != entry.index_crc:
            raise CorruptShard(f"shard {entry.name}: index fails its crc32 check", name=entry.name)
        index = ShardIndex.decode(data, data_end=entry.data_end, name=entry.name)
        if len(index) != entry.samples:
            raise CorruptShard(
                f"shard {entry.name}: its index lists {len(index)} samples, the manifest says {entry.samples}",
                name=entry.name,
            )
        return index

    def shard(self, entry: ShardEntry) -> Shard:
        """A shard as requests name it: read through the node's cache, where there is one."""
        return Shard(self.location.key(entry.name), entry.name, entry.size, entry.crc32)

    def index_range(self, entry: ShardEntry) -> tuple[Shard, int, int]:
        """Return ``(object, start, end)`` of the object bytes holding a shard's index: the
        shard, or the index kept apart (a whole object, its crc32 the index's)."""
        holder = self.shard(entry) if not entry.index_name else Shard(
            self.location.key(entry.index_name), entry.index_name, entry.index_size, entry.index_crc)
        return holder, entry.index_offset, entry.index_offset + entry.index_size

    def read_index(self, entry: ShardEntry, session: ReadSession | None = None) -> ShardIndex:
        """Fetch and decode one shard's index with a single ranged GET (retried, and fetched
        again while its bytes fail their checksum).

        The GET also gives the object's size, checked against the manifest's before the
        index is believed: every sample range is then checked to lie inside the real object,
        so no size the manifest or the index claims is fetched or allocated unchecked. An
        index kept apart (a tar indexed in place) costs a HEAD of its tar for that.

        Raises:
            TruncatedShard: The shard or its index is not the size the manifest says.
        """
        session = session or self.session()
        return session.refetch(partial(self._index_bytes, entry, session), partial(self.parse_index, entry),
                               self.index_range(entry)[0])

    def _index_bytes(self, entry: ShardEntry, session: ReadSession) -> bytes | bytearray:
        holder, start, end = self.index_range(entry)
        bucket = self.location.bucket
        try:
            data, size = session.get_range_and_size(bucket, holder, start, end)
        except InvalidRange:
            said = entry.index_size if entry.index_name else entry.size
            raise self.refused(entry.index_name or entry.name, start, end, said, session) from None
        if entry.index_name:
            objects = [
                (entry.index_name, size, entry.index_size),
                (entry.name, session.head(bucket, self.shard(entry)), entry.size),
            ]
        else:
            objects = [(entry.name, size, entry.size)]
        for name, real, said in objects:
            if real != said:
                raise TruncatedShard(
                    f"{'index ' if name != entry.name else ''}{self.location}/{name} is {real:,d}"
                    f" bytes; the manifest says {said:,d}: it was truncated or replaced",
                    name=entry.name,
                )
        return data

    def refused(self, name: str, start: int, end: int, said: int,
                session: ReadSession | None = None) -> RemoteLoaderError:
        """The error for bytes ``[start, end)`` of object ``name`` that the store answered lie
        outside it (416): a shard shorter or longer than the manifest's ``said`` bytes was
        truncated or replaced; one of that very size was not, and the answer is the store's."""
        session = session or self.session()
        try:
            size = session.store.head(self.location.bucket, self.location.key(name))
        except ObjectNotFound:
            size = 0
        if size != said:
            return TruncatedShard(f"{self.location}/{name} is {size:,d} bytes; the manifest says {said:,d}, and bytes"
                                  f" {start}-{end - 1} lie past its end: it was truncated or replaced", name=name)
        return InvalidRange(f"{self.location}/{name}: the store answered that bytes {start}-{end - 1} lie outside"
                            f" the object, yet it is the {size:,d} bytes the manifest says: the store, or a proxy"
                            " before it, answered wrongly", bucket=self.location.bucket, key=self.location.key(name),
                            code="InvalidRange")

    def get(self, name: str) -> bytes:
        """A whole object of the dataset, its GET retried."""
        key = self.location.key(name)
        return self.session().store.get(self.location.bucket, key)

    def _index_of(self, entry: ShardEntry, shard: memoryview) -> ShardIndex:
        """The index of a shard whose bytes are at hand: sliced from them, or fetched if kept apart."""
        if entry.index_name:
            return self.read_index(entry)
        return self.parse_index(entry, shard[entry.index_offset : entry.index_offset + entry.index_size])

    def open_shard(self, entry: ShardEntry) -> ShardView:
        """Fetch a whole shard; its samples are slices of the one buffer."""
        data = self.get(entry.name)
        if len(data) != entry.size:
            raise CorruptShard(
                f"shard {entry.name} is {len(data)} bytes; the manifest says {entry.size}", name=entry.name
            )
        view = memoryview(data)
        index = self._index_of(entry, view)
        if len(index) != entry.samples:
            raise CorruptShard(
                f"shard {entry.name}: index lists {len(index)} samples, manifest {entry.samples}", name=entry.name
            )
        return ShardView(view, index, name=entry.name, verify=self.verify)

    def __iter__(self) -> Iterator[Sample]:
        for entry in self.manifest.shards:
            yield from self.open_shard(entry)

    def check_shard(self, entry: ShardEntry) -> ShardReport:
        """Fetch a shard and check its size, its crc32, its index and every member's crc32."""
        report = ShardReport(entry.name, entry.samples)
        try:
            data = self.get(entry.name)
        except ObjectNotFound:
            report.problems.append("the shard object is missing")
            return report
        if len(data) != entry.size:
            report.problems.append(f"size is {len(data)} bytes, manifest says {entry.size}")
        elif crc32(data) != entry.crc32:
            report.problems.append("object fails its crc32 check")
        try:
            view = ShardView(data, self._index_of(entry, memoryview(data)), name=entry.name, verify=True)
            for i in range(len(view)):
                try:
                    view.sample(i)
                except CorruptSampleError as exc:
                    report.problems.append(f"sample {exc.key!r} field {exc.field!r} fails its crc32 check")
            mismatch = _index_against_tar(view.index, data, entry.name)
            if mismatch:
                report.problems.append(mismatch)
        except (FormatError, ObjectNotFound) as exc:
            report.problems.append(str(exc))
        return report


def _index_against_tar(index: ShardIndex, data: bytes, name: str) -> str | None:
    """What an index says that the shard's own tar headers do not (each member's name, offset
    and size), or None: an index rewritten to point a sample at another's bytes, with
    checksums to match, passes every other check."""
    scanned, _ = scan_tar(lambda start, end: memoryview(data)[start:end], name, len(data))
    if list(scanned.keys) != list(index.keys):
        return "its index lists other samples than its tar members"
    for i, key in enumerate(index.keys):  # field names in any case: one indexed before they were lower-cased
        if {(m[0].lower(), *m[1:3]) for m in index.members(i)} != {(m[0].lower(), *m[1:3]) for m in scanned.members(i)}:
            return f"sample {key!r}: its index points at other bytes than its tar members {key}.*"
    return None
