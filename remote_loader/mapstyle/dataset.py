"""``RemoteMapDataset``: random access to any sample, one ranged GET per sample or per run of them."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from remote_loader.checks import as_index, require_int
from remote_loader.checksum import crc32
from remote_loader.config import CacheConfig, FetchConfig, fetch_config
from remote_loader.errors import ConfigError, CorruptSampleError, FormatError
from remote_loader.format import Sample, ShardIndex
from remote_loader.read import DatasetReader, Metrics
from remote_loader.read.shards import DAMAGE, IndexCache, read_cached, read_run
from remote_loader.storage import Store, check_connection, open_location
from remote_loader.storage.daemon import map_on_daemon_threads


class RemoteMapDataset(Dataset):
    """``ds[i]`` for any sample of an uploaded dataset, fetched with one ranged GET.

    ``ds[i]`` is the sample dict the streaming pipeline gives before decoding
    (``__key__``, ``__shard__``, one ``bytes`` value per field), passed through
    ``transform`` if given. ``ds.__getitems__(indices)`` (used by DataLoader for batches)
    fetches a batch concurrently and merges samples of one shard that lie within
    ``merge_gap`` bytes of each other into one GET. Shard indexes are fetched on first
    use and kept in an LRU cache of ``cache_shards``; so are the pages of a manifest read by
    pages (version 3: ``cache_pages`` of them, each the numbers of 4,096 shards), so memory
    follows those caches, not the number of shards or samples. A shard whose page is not
    cached costs one more ranged GET the first time.

    Args:
        client: A store, a boto3 S3 client or ``minio.Minio`` of your own, or an ``s3://bucket/prefix`` URL.
        bucket: The bucket (omit with a URL).
        base_folder: The dataset's prefix (omit with a URL).
        transform: Applied to each sample dict.
        cache_shards: Shard indexes kept in memory.
        cache_pages: Manifest pages kept in memory (version 3; about 60 kB each): 256 hold
            every page of a million shards.
        merge_gap: Largest gap in bytes bridged when merging ranges of one shard.
        fetch: Concurrency (``concurrency`` GETs at once for a batch), checksum refetches, and
            in ``fetch.retry`` how requests are retried.
        verify: Check member crc32s.
        cache_dir: A directory on a local disk where shards are kept whole once a sample of
            theirs is read, and read from again (docs/cache.md); default
            ``REMOTE_LOADER_CACHE_DIR``, none without it.
        cache_bytes: The most bytes the cache holds (an int, or ``"500G"``); default
            ``REMOTE_LOADER_CACHE_BYTES``, else what leaves a tenth of the disk free.
        cache_verify: Check every member read from the cache against its crc32, every epoch
            (default ``REMOTE_LOADER_CACHE_VERIFY``, else off: a shard is checked whole as it
            enters the cache and read as it is while its file is unchanged; docs/cache.md).
            It implies ``verify``: the store's bytes are checked too.
        **connection: ``endpoint_url``, ``access_key``, ... with a URL.
    """

    def __init__(
        self,
        client: Store | str | Any,
        bucket: str | None = None,
        base_folder: str | None = None,
        *,
        transform: Callable[[Sample], Any] | None = None,
        cache_shards: int = 64,
        cache_pages: int = 256,
        merge_gap: int = 256 * 1024,
        fetch: FetchConfig | None = None,
        verify: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int | str | None = None,
        cache_verify: bool | None = None,
        **connection: Any,
    ) -> None:
        if "views" in connection:
            raise ConfigError("views is RemoteDataset's: RemoteMapDataset gives each member as bytes")
        check_connection(RemoteMapDataset, connection, isinstance(client, str))
        if isinstance(client, str):
            client, location = open_location(client, **connection)
            bucket, base_folder = location.bucket, location.base_folder
        if bucket is None or base_folder is None:
            raise ConfigError("RemoteMapDataset needs (client, bucket, base_folder) or an s3:// URL")
        cache_shards = require_int("cache_shards", cache_shards, 1)
        cache_pages = require_int("cache_pages", cache_pages, 1)
        merge_gap = require_int("merge_gap", merge_gap, 0)
        if transform is not None and not callable(transform):
            raise ConfigError(f"transform must be callable (applied to each sample), got {type(transform).__name__}")
        self.fetch = fetch_config(fetch)
        self.reader = DatasetReader(client, bucket, base_folder, verify=verify, fetch=self.fetch,
                                    cache_pages=cache_pages,
                                    cache=CacheConfig.of(cache_dir, cache_bytes, verify_reads=cache_verify))
        self.reader.after_change = ("this dataset's length and indices are the old upload's: make a new"
                                    " RemoteMapDataset (and a new sampler and DataLoader over it) to read the new one")
        self.transform, self.cache_shards, self.merge_gap = transform, cache_shards, merge_gap
        self.metrics = Metrics()
        self._total = len(self.reader)  # the manifest, fetched now: a missing or damaged dataset fails here
        self._positions: np.ndarray | None = None  # by source index, once asked (position_of)
        self._reset()

    def _reset(self) -> None:
        """Per-process state: a forked child must not use a lock a parent thread may have
        held at the fork."""
        self._pid = os.getpid()
        self._session = self.reader.session(self.metrics)
        self._indexes = IndexCache(self.reader, self._session, keep=self.cache_shards)

    def position_of(self, source: int) -> int:
        """The position ``i`` of the sample the upload read as ``ds[source]`` (``self[i]`` is
        it). Positions follow the upload's shuffled order; this computes that order from its
        recorded seed once, 8 bytes a sample (ImageNet: 10 MB). IndexError for an index the
        upload skipped or never had; ConfigError for a dataset whose order is not recorded
        (tars indexed in place, more skipped samples than the manifest lists)."""
        if self._positions is None:
            self._positions = self._source_positions()
        if not isinstance(source, (int, np.integer)) or isinstance(source, bool):
            raise TypeError(f"a source index is an int, got {type(source).__name__}")
        if not 0 <= source < len(self._positions):
            raise IndexError(f"source index {source} out of range for the {len(self._positions)} items uploaded")
        position = int(self._positions[source])
        if position < 0:
            raise IndexError(f"ds[{source}] was skipped at upload (on_error='skip'): no sample holds it")
        return position

    def by_source_index(self, source: int) -> Any:
        """The sample the upload read as ``ds[source]`` (with ``transform`` applied), where
        ``self[source]`` is the ``source``-th of the upload's shuffled order."""
        shard, j = self.locate(self.position_of(source))
        sample = self._fetch_run(shard, [j])[0]
        key = str(sample.get("__key__", ""))
        if not key.isdigit() or int(key) != source:
            raise FormatError(f"{self.reader.location}: the sample at position {self.position_of(source)} is"
                              f" {key!r}, not ds[{source}]: its shards are not in the order recorded")
        return self._apply(sample)

    def members_of(self, source: int) -> tuple[str, dict[str, tuple[int, int]]]:
        """The key of the sample the upload read as ``ds[source]``, and each of its fields'
        size in bytes and crc32, read from its shard's index (no member is fetched)."""
        shard, j, index = self._source_sample(source)
        return index.keys[j], {field: (size, crc) for field, _, size, crc in index.members(j)}

    def read_member(self, source: int, field: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of field ``field`` of the sample the upload read as
        ``ds[source]`` (the whole member by default), with one ranged GET: a part of a
        large member (a long video) without the rest. The whole member is checked against
        its crc32 (CorruptSampleError where it differs); a part cannot be."""
        shard, j, index = self._source_sample(source)
        found = [(offset, size, crc) for name, offset, size, crc in index.members(j) if name == field]
        if not found:
            raise KeyError(f"sample {index.keys[j]!r} has no field {field!r}")
        offset, size, crc = found[0]
        start = as_index(start, "read_member's start")  # True was taken for 1, 1.5 failed deep in a slice
        end = size if end is None else as_index(end, "read_member's end")
        if not 0 <= start <= end <= size:
            raise ValueError(f"bytes [{start}, {end}) are not within field {field!r}'s {size}")
        if start == end:
            return b""
        entry = self.reader.manifest.shards[shard]
        shard_object = self.reader.shard(entry)

        def fetch() -> bytes:
            return bytes(self._session.get_range(self.reader.location.bucket, shard_object, offset + start,
                                                 offset + end))

        def check(data: bytes) -> bytes:
            if (start, end) == (0, size) and self.reader.verify and crc32(data) != crc:
                raise CorruptSampleError(f"field {field!r} of sample {index.keys[j]!r} in {entry.name} does not"
                                         " match its crc32", name=entry.name, key=index.keys[j], field=field)
            return data

        try:
            return self._session.refetch(fetch, check, shard_object)  # damaged bytes fetched again, as a sample's are
        except DAMAGE as error:  # a shard gone, or bytes still damaged: DatasetChanged where it was replaced
            self.reader.check_unchanged(error)
            raise

    def _source_sample(self, source: int) -> tuple[int, int, ShardIndex]:
        """The shard, the position in it and the shard's index of ``ds[source]``'s sample."""
        shard, j = self.locate(self.position_of(source))
        index = self._index(shard)
        key = index.keys[j]
        if not key.isdigit() or int(key) != source:
            raise FormatError(f"{self.reader.location}: the sample at position {self.position_of(source)} is"
                              f" {key!r}, not ds[{source}]: its shards are not in the order recorded")
        return shard, j, index

    def _source_positions(self) -> np.ndarray:
        manifest = self.reader.manifest
        upload = manifest.params.get("upload")
        if not isinstance(upload, dict) or not {"samples", "seed", "shuffle"} <= set(upload):
            raise ConfigError(f"{self.reader.location} records no upload order (tars indexed in place):"
                              " find a sample by its __key__")
        num = int(upload["samples"])
        if manifest.skipped > len(manifest.skipped_indices):
            raise ConfigError(f"{self.reader.location} skipped {manifest.skipped} samples at upload and lists the"
                              f" first {len(manifest.skipped_indices)}: the positions after them are not known")
        order = np.random.default_rng(upload["seed"]).permutation(num) if upload["shuffle"] else np.arange(num)
        kept = order[~np.isin(order, np.asarray(manifest.skipped_indices, dtype=np.int64))]
        positions = np.full(num, -1, dtype=np.int64)
        positions[kept] = np.arange(len(kept))
        return positions

    def _own(self) -> None:
        if self._pid != os.getpid():
            self._reset()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_indexes", "_session", "_pid"):
            state.pop(name)
        state["_positions"] = None  # computed again where asked
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        return f"RemoteMapDataset({self.reader.location}, samples={len(self)})"

    @property
    def classes(self) -> list[str]:
        """The class names recorded at upload (class ``i`` is ``classes[i]``), empty where none were."""
        return self.reader.classes

    def __len__(self) -> int:
        return self._total

    def locate(self, i: int) -> tuple[int, int]:
        """Return ``(shard position, sample position in the shard)`` of sample ``i``."""
        i = as_index(i, "a sample index")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for {n} samples")
        shards, samples = self.reader.counts.locate(np.array([i % n], dtype=np.int64))
        return int(shards[0]), int(samples[0])

    def _index(self, shard: int) -> ShardIndex:
        self._own()
        return self._indexes.get(shard)

    def _fetch_run(self, shard: int, positions: list[int], index: ShardIndex | None = None,
                   cached: bool = True) -> list[Sample]:
        """One GET covering samples ``positions`` (sorted) of one shard; fetched again if its
        bytes fail their checksums, up to ``fetch.refetch_attempts``. From a shard the node's
        cache holds whole, each member read from the file into its bytes (unless ``cached`` is
        false: the caller looked already)."""
        index = index if index is not None else self._index(shard)
        found = self._cached_run(shard, positions, index) if cached else None
        return found if found is not None else read_run(self.reader, shard, index, positions, self._session)

    def _cached_run(self, shard: int, positions: list[int], index: ShardIndex) -> list[Sample] | None:
        """Samples ``positions`` (sorted) of a shard the node's cache holds whole, each member
        read from the file into its bytes; None without a cache, or where it lacks the shard."""
        if not self.reader.cache:
            return None
        return read_cached(self.reader, shard, index, positions, self._session)

    def _runs(self, located: list[tuple[int, int]]) -> list[tuple[int, list[int], ShardIndex]]:
        """Group sample positions into runs of one shard whose byte ranges lie within ``merge_gap``,
        each with its shard's index (fetched now where it is not kept)."""
        by_shard: dict[int, list[int]] = {}
        for shard, j in located:
            by_shard.setdefault(shard, []).append(j)
        # The indexes of a batch's shards, fetched at once (a cold batch of 20 shards takes
        # one round trip, not 20), on daemon threads: Ctrl-C does not wait for a hung store.
        self._own()
        indexes = {shard: self._indexes.cached(shard) for shard in by_shard}
        missing = [shard for shard, index in indexes.items() if index is None]
        indexes.update(zip(missing, map_on_daemon_threads(self._indexes.get, missing, self.fetch.concurrency,
                                                          "remote-loader-map"), strict=True))
        runs = []
        for shard, positions in by_shard.items():
            index = indexes[shard]
            assert index is not None
            positions = sorted(set(positions))
            run = [positions[0]]
            for j in positions[1:]:
                if index.start(j, j + 1) - index.extent(run[-1], run[-1] + 1) <= self.merge_gap:
                    run.append(j)
                else:
                    runs.append((shard, run, index))
                    run = [j]
            runs.append((shard, run, index))
        return runs

    def _apply(self, sample: Sample) -> Any:
        return self.transform(sample) if self.transform else sample

    def __getitem__(self, i: int) -> Any:
        shard, j = self.locate(i)
        return self._apply(self._fetch_run(shard, [j])[0])

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Fetch a batch: samples of one shard close together share a GET; runs go in parallel."""
        located = [self.locate(i) for i in indices]
        runs = self._runs(located)  # makes this process's caches its own, as a forked worker needs
        fetched: dict[tuple[int, int], Sample] = {}
        remote = []
        for shard, positions, index in runs:  # what the node's cache holds whole is read here: threads would cost
            cached = self._cached_run(shard, positions, index)
            if cached is None:
                remote.append((shard, positions, index))
            else:
                fetched.update(((shard, j), s) for j, s in zip(positions, cached, strict=True))
        # On daemon threads that last the batch: Ctrl-C on a store that hangs does not wait for them.
        for (shard, positions, _), samples in zip(remote, map_on_daemon_threads(
                lambda run: self._fetch_run(*run, cached=False), remote, self.fetch.concurrency, "remote-loader-map"),
                strict=True):
            fetched.update(((shard, j), s) for j, s in zip(positions, samples, strict=True))
        asked = Counter(located)  # an index asked twice gets a sample of its own each time, as ds[i] twice would
        samples = [fetched[where] if asked[where] == 1 else dict(fetched[where]) for where in located]
        return [self._apply(sample) for sample in samples]  # copied before a transform may change one

    def close(self) -> None:
        """Nothing to end: a batch's threads end with the batch. Kept for code that calls it."""
