"""Read an uploaded dataset shard by shard: the manifest, each shard's index, its samples.

This is where bytes from storage meet the format; the streaming and map-style datasets and
the CLI build on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

from remote_loader.format.checksum import crc32
from remote_loader.errors import CorruptSampleError, CorruptShard, FormatError, ObjectNotFound, TransientStorageError
from remote_loader.format import MANIFEST_NAME, Manifest, Sample, ShardEntry, ShardIndex, ShardView
from remote_loader.storage import Location, Store


_MANIFEST_ATTEMPTS = 5


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
        client: The store.
        bucket: The bucket.
        base_folder: The dataset's key prefix.
        verify: Check crc32s of indexes and sample members as they are read.

    Example:
        >>> reader = DatasetReader(client, "bucket", "imagenet-val")  # doctest: +SKIP
        >>> for sample in reader:  # doctest: +SKIP
        ...     sample["__key__"], bytes(sample["jpg"])[:2]
    """

    def __init__(self, client: Store, bucket: str, base_folder: str, *, verify: bool = True) -> None:
        self.client = client
        self.location = Location(bucket=bucket, prefix=base_folder.strip("/"))
        self.verify = verify

    def __repr__(self) -> str:
        return f"DatasetReader({self.location}, client={self.client!r})"

    @cached_property
    def manifest(self) -> Manifest:
        """The dataset's manifest, fetched on first use (again, if its bytes arrive damaged)."""
        key = self.location.key(MANIFEST_NAME)
        for attempt in range(1, _MANIFEST_ATTEMPTS + 1):
            try:
                data = self.client.get(self.location.bucket, key)
                return Manifest.decode(data, name=f"{self.location}/{MANIFEST_NAME}")
            except ObjectNotFound as exc:
                raise ObjectNotFound(
                    f"no dataset at {self.location}: {MANIFEST_NAME} is missing", bucket=exc.bucket, key=key, code=exc.code
                ) from None
            except (TransientStorageError, CorruptShard):
                if attempt == _MANIFEST_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def has_manifest(self) -> bool:
        """Whether the dataset has a manifest (fetching it if not yet fetched)."""
        try:
            self.manifest
        except ObjectNotFound:
            return False
        return True

    def list_tars(self) -> list[tuple[str, int]]:
        """``(name, size)`` of every ``.tar`` object under the prefix, in name order."""
        prefix = self.location.key("")
        return sorted((o.key[len(prefix) :], o.size) for o in self.client.list(self.location.bucket, prefix) if o.key.endswith(".tar"))

    def __len__(self) -> int:
        return self.manifest.num_samples

    def parse_index(self, entry: ShardEntry, data: bytes | memoryview) -> ShardIndex:
        """Check index bytes against the manifest's crc32 (when verifying) and decode them."""
        if self.verify and crc32(data) != entry.index_crc:
            raise CorruptShard(f"shard {entry.name}: index fails its crc32 check", name=entry.name)
        return ShardIndex.decode(data, data_end=entry.data_end, name=entry.name)

    def index_range(self, entry: ShardEntry) -> tuple[str, int, int]:
        """Return ``(key, start, end)`` of the object bytes holding a shard's index."""
        name = entry.index_name or entry.name
        return self.location.key(name), entry.index_offset, entry.index_offset + entry.index_size

    def read_index(self, entry: ShardEntry) -> ShardIndex:
        """Fetch and decode one shard's index with a single ranged GET."""
        key, start, end = self.index_range(entry)
        return self.parse_index(entry, self.client.get_range(self.location.bucket, key, start, end))

    def _index_of(self, entry: ShardEntry, shard: memoryview) -> ShardIndex:
        """The index of a shard whose bytes are at hand: sliced from them, or fetched if kept apart."""
        if entry.index_name:
            return self.read_index(entry)
        return self.parse_index(entry, shard[entry.index_offset : entry.index_offset + entry.index_size])

    def open_shard(self, entry: ShardEntry) -> ShardView:
        """Fetch a whole shard; its samples are slices of the one buffer."""
        data = self.client.get(self.location.bucket, self.location.key(entry.name))
        if len(data) != entry.size:
            raise CorruptShard(f"shard {entry.name} is {len(data)} bytes; the manifest says {entry.size}", name=entry.name)
        view = memoryview(data)
        index = self._index_of(entry, view)
        if len(index) != entry.samples:
            raise CorruptShard(f"shard {entry.name}: index lists {len(index)} samples, manifest {entry.samples}", name=entry.name)
        return ShardView(view, index, name=entry.name, verify=self.verify)

    def __iter__(self) -> Iterator[Sample]:
        for entry in self.manifest.shards:
            yield from self.open_shard(entry)

    def check_shard(self, entry: ShardEntry) -> ShardReport:
        """Fetch a shard and check its size, its crc32, its index and every member's crc32."""
        report = ShardReport(entry.name, entry.samples)
        data = self.client.get(self.location.bucket, self.location.key(entry.name))
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
        except FormatError as exc:
            report.problems.append(str(exc))
        return report
