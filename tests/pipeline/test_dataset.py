"""RemoteDataset against the embedded S3 server: coverage, order, workers and the chain."""

from __future__ import annotations

import gc
import threading
import time
import tracemalloc
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from remote_loader import ConfigError, DatasetReader
from remote_loader.config import FetchConfig
from remote_loader.pipeline.dataset import RemoteDataset
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload, upload_to_new_bucket


@pytest.fixture(scope="module")
def uploaded(seaweed):
    client = seaweed.client()
    bucket, ds = "pipeline-tests", SyntheticImages(97, size=(40, 30), num_classes=5)
    upload_to_new_bucket(client, bucket, "few", ds, maxcount=20)
    yield client, bucket, ds
    client.close()


def keys(dataset, num_workers):
    loader = DataLoader(dataset.map(lambda s: s["__key__"]), batch_size=None, num_workers=num_workers)
    return list(loader)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_every_sample_exactly_once(uploaded, world_size, num_workers):
    client, bucket, ds = uploaded
    seen = Counter()
    for rank in range(world_size):
        dataset = RemoteDataset(client, bucket, "few", rank=rank, world_size=world_size, equalize=False)
        got = keys(dataset, num_workers)
        assert len(got) == len(dataset)
        seen.update(got)
    assert seen == Counter(f"{i:06d}" for i in range(97))


def test_equalize_gives_every_rank_the_same_count(uploaded):
    client, bucket, _ = uploaded
    counts = [len(keys(RemoteDataset(client, bucket, "few", rank=r, world_size=3, equalize=True), 2)) for r in range(3)]
    assert counts == [33, 33, 33]


def test_order_is_seeded_per_epoch(uploaded):
    client, bucket, _ = uploaded
    dataset = RemoteDataset(client, bucket, "few", seed=5).shuffle(30)
    first = keys(dataset, 0)
    assert first == keys(dataset, 0)
    dataset.set_epoch(1)
    assert first != keys(dataset, 0) and sorted(first) == sorted(keys(dataset, 0))


def test_decode_to_tuple_map_tuple_batched_in_workers(uploaded):
    client, bucket, ds = uploaded
    dataset = (
        RemoteDataset(client, bucket, "few")
        .decode("pil")
        .to_tuple("jpg;png", "cls")
        .map_tuple(lambda im: torch.tensor(im.size), lambda x: x)
        .batched(16)
    )
    batches = list(DataLoader(dataset, num_workers=2, batch_size=None))
    sizes, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert len(labels) == 97 and sorted(Counter(labels.tolist()).values()) == sorted(
        Counter(ds.label(i) for i in range(97)).values()
    )
    assert sizes.shape == (97, 2)
    short = [len(b[1]) for b in batches if len(b[1]) != 16]
    assert len(short) <= 2 and all(0 < n < 16 for n in short)  # at most one partial batch per worker


def test_bytes_only_samples_cross_worker_processes(uploaded):
    client, bucket, ds = uploaded
    samples = list(DataLoader(RemoteDataset(client, bucket, "few"), batch_size=None, num_workers=2))
    assert len(samples) == 97
    for sample in samples[:10]:
        assert sample["jpg"] == ds[int(sample["__key__"])][0]


def all_keys(dataset, num_workers):
    """Keys in DataLoader order, flattening batches of keys."""
    out = []
    for item in DataLoader(dataset, batch_size=None, num_workers=num_workers):
        out.extend(item if isinstance(item, list) else [item])
    return out


def keyed(client, bucket, **kwargs):
    return RemoteDataset(client, bucket, "few", **kwargs).shuffle(30).map(lambda s: s["__key__"])


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("consumed", [0, 1, 4, 7])
def test_resume_yields_exactly_what_was_not_consumed(uploaded, num_workers, consumed):
    client, bucket, _ = uploaded
    epoch = keyed(client, bucket, seed=3).batched(8, collation_fn=list)
    epoch.set_epoch(2)
    batches = list(DataLoader(epoch, batch_size=None, num_workers=num_workers))
    state = epoch.state_dict(consumed=consumed, num_workers=num_workers)

    resumed = keyed(client, bucket, seed=3).batched(8, collation_fn=list)
    resumed.load_state_dict(state)
    rest = list(DataLoader(resumed, batch_size=None, num_workers=num_workers))
    # The same batches, with the same contents; a resumed DataLoader starts its round-robin
    # at worker 0 again, so with workers the batches may come in another interleaving.
    assert sorted(map(tuple, rest)) == sorted(map(tuple, batches[consumed:]))
    if num_workers == 0:
        assert rest == batches[consumed:]
    resumed.set_epoch(3)  # the next epoch is whole again
    assert sum(len(b) for b in DataLoader(resumed, batch_size=None, num_workers=num_workers)) == 97


def test_resume_refuses_a_chain_it_cannot_count(uploaded):
    client, bucket, _ = uploaded
    with pytest.raises(ConfigError, match="select"):
        RemoteDataset(client, bucket, "few").shuffle(10).select(lambda s: True).state_dict(consumed=1)


def test_the_shuffle_buffer_sits_at_the_source_whatever_its_place_among_per_sample_stages(uploaded):
    client, bucket, _ = uploaded
    base = RemoteDataset(client, bucket, "few", seed=4)
    before = base.shuffle(20).map(lambda s: s["__key__"])
    after = base.map(lambda s: s["__key__"]).shuffle(20)  # the same order: the map treats each sample alone
    assert list(before) == list(after) and sorted(before) == sorted(base.map(lambda s: s["__key__"]))
    with pytest.raises(ConfigError, match="put it before select and batched"):
        base.select(lambda s: True).shuffle(20)
    with pytest.raises(ConfigError, match="put it before select and batched"):
        base.batched(4).shuffle(20)
    with pytest.raises(ConfigError, match=r"shuffles already \(shuffle\(20\)\): give shuffle once"):
        base.shuffle(20).decode("pil").shuffle(100)


def test_prefetch_budget_is_never_exceeded(uploaded):
    client, bucket, _ = uploaded
    shard_bytes = max(e.size for e in DatasetReader(client, bucket, "few").manifest.shards)
    budget = 2 * shard_bytes
    dataset = RemoteDataset(
        client, bucket, "few", fetch=FetchConfig(prefetch_bytes=budget, part_size=4096, concurrency=4)
    )
    assert sorted(s["__key__"] for s in dataset) == [f"{i:06d}" for i in range(97)]
    peak = dataset.metrics.peak_buffered
    assert 0 < peak <= budget
    assert dataset.metrics.gets > len(DatasetReader(client, bucket, "few").manifest.shards)
    # A budget smaller than one shard still reads everything, one shard at a time.
    tiny = RemoteDataset(client, bucket, "few", fetch=FetchConfig(prefetch_bytes=1000, part_size=4096))
    assert len(list(tiny)) == 97 and tiny.metrics.peak_buffered <= shard_bytes


def test_metrics_count_gets_bytes_and_samples(uploaded):
    client, bucket, _ = uploaded
    dataset = RemoteDataset(client, bucket, "few", fetch=FetchConfig(part_size=8192))
    total = sum(len(s["jpg"]) for s in dataset)
    m = dataset.metrics.as_dict()
    assert m["samples"] == 97 and m["bytes"] >= total and m["gets"] >= 10 and m["retries"] == 0


def test_threads_end_when_iteration_is_abandoned(uploaded):
    client, bucket, _ = uploaded
    before = threading.active_count()
    iterator = iter(RemoteDataset(client, bucket, "few", fetch=FetchConfig(prefetch_bytes=10_000)))
    next(iterator)
    assert threading.active_count() > before
    iterator.close()
    # close() joins the pipeline's threads but not a daemon thread finishing its request (it
    # never waits on a store that may hang): those end on their own, soon.
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)  # polling for threads to end, not synchronising on time
    assert threading.active_count() == before


def test_an_abandoned_iteration_frees_its_ranges_without_the_garbage_collector(seaweed):
    # The fetcher's ranges not yet handed out held it (each its check) and it held them: an
    # abandoned iteration left its shards' bytes to the garbage collector, which seldom runs
    # where the bytes are not Python's (~3.5 MB an abandoned pass in a persistent DataLoader worker).
    client = seaweed.client()
    upload_to_new_bucket(client, "abandoned-ranges", "d", SyntheticImages(80, size=(256, 256)), maxcount=20)
    ds = RemoteDataset(client, "abandoned-ranges", "d")
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        traced = []
        for _ in range(6):  # the first a warm-up: threads and caches that live on
            iterator = iter(ds)
            next(iterator)
            del iterator
            _join_passing_threads()
            traced.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
        gc.enable()
        client.close()
    # A pass that leaves its ranges adds a shard (~800 kB) or more every time; what a loaded
    # machine makes live on once (1.1 MB from the third pass on, in a CI run beside two busy
    # loops) adds once: most passes add less than half a shard.
    added = np.diff(traced[1:])
    assert np.median(added) < 400_000, traced


def _join_passing_threads():
    """Wait for the fetch threads an abandoned pass left to end their requests."""
    for thread in threading.enumerate():
        if thread.name.startswith(("remote-loader-fetch", "remote-loader-locate")):
            thread.join(60)


def test_decode_min_size_uses_reduced_jpeg_decoding(seaweed):
    client = seaweed.client()
    bucket = "pipeline-draft"
    client.create_bucket(bucket)
    upload(client, bucket, "big", SyntheticImages(6, size=(640, 480)))
    full = [s["jpg"].size for s in RemoteDataset(client, bucket, "big", shuffle_shards=False).decode("pil")]
    small = [
        s["jpg"].size for s in RemoteDataset(client, bucket, "big", shuffle_shards=False).decode("pil", min_size=100)
    ]
    for (fw, fh), (sw, sh) in zip(full, small, strict=True):
        # libjpeg's DCT scaling: the largest of 1/2, 1/4, 1/8 that keeps the shorter side >= 100 px
        k = max(f for f in (2, 4, 8) if -(-min(fw, fh) // f) >= 100)
        assert (sw, sh) == (-(-fw // k), -(-fh // k)), ((fw, fh), (sw, sh), k)


def preproc(image):
    """Stands in for torchvision's RandomResizedCrop + ToTensor: PIL image -> float CxHxW tensor."""
    return torch.from_numpy(np.asarray(image.resize((32, 32)), dtype=np.float32) / 255).permute(2, 0, 1)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # 2 cores here
def test_the_cortx_example_runs_unchanged(uploaded):
    client, bucket, _ = uploaded
    folder = "few"
    ds = (
        RemoteDataset(client, bucket, folder)
        .decode("pil")
        .to_tuple("jpg;png", "cls")
        .map_tuple(preproc, lambda x: x)
        .batched(64)
    )
    seen = 0
    for images, labels in DataLoader(ds, num_workers=3, batch_size=None):
        assert images.shape[1:] == (3, 32, 32) and images.dtype == torch.float32 and labels.dtype == torch.int64
        seen += len(labels)
    assert seen == 97


def test_dataset_from_a_url(uploaded, seaweed):
    _, bucket, _ = uploaded
    ds = RemoteDataset(
        f"s3://{bucket}/few",
        endpoint_url=seaweed.endpoint_url,
        access_key=seaweed.access_key,
        secret_key=seaweed.secret_key,
    )
    assert len(ds) == 97 and len(list(ds)) == 97


def test_range_memory_stays_within_the_documented_sum(seaweed):
    """Instrumented: the bytes of live range buffers never exceed prefetch_bytes +
    (open_shards + 2) ranges, each at most range_bytes plus one sample, rounded up to a MiB."""
    client = seaweed.client()
    upload_to_new_bucket(client, "memory-tests", "d", SyntheticImages(240), maxcount=60)
    entries = DatasetReader(client, "memory-tests", "d").manifest.shards
    assert sum(e.size for e in entries) > 8 << 20  # several times the bound below
    fetch = FetchConfig(part_size=1 << 20, range_bytes=1 << 20, prefetch_bytes=2 << 20)
    dataset = RemoteDataset(client, "memory-tests", "d", open_shards=2, fetch=fetch)
    assert len(list(dataset)) == 240
    largest_sample = max(e.size / e.samples for e in entries) * 2  # generous: sizes vary about the mean
    per_range = -(-(fetch.range_bytes + largest_sample) // (1 << 20)) * (1 << 20)
    bound = fetch.prefetch_bytes + (2 + 2) * per_range
    assert 0 < dataset.metrics.peak_range_memory <= bound < sum(e.size for e in entries), (
        dataset.metrics.peak_range_memory,
        bound,
    )
    client.close()


class _MixedSizes:
    """40 samples per shard of 10 kB, but for a run of four of 4 MB in each: a shard's
    average sample (~410 kB) says nothing of its largest."""

    LARGE = 4_000_000

    def __len__(self) -> int:
        return 160

    JPEG = SyntheticImages(1, size=(16, 16)).encoded(0)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        size = self.LARGE if 10 <= i % 40 < 14 else 10_000
        return self.JPEG + np.random.default_rng(i).bytes(size - len(self.JPEG)), i  # a JPEG, padded


def test_range_memory_holds_for_any_mix_of_sample_sizes(seaweed):
    """Ranges are cut from the index's own offsets, so a run of a shard's largest samples
    never makes a range larger than range_bytes or one sample: range_memory() holds."""
    client = seaweed.client()
    upload_to_new_bucket(client, "memory-mixed", "d", _MixedSizes(), maxcount=40, shuffle=False)
    fetch = FetchConfig(part_size=1 << 20, range_bytes=1 << 20, prefetch_bytes=2 << 20)
    dataset = RemoteDataset(client, "memory-mixed", "d", open_shards=2, fetch=fetch).to_tuple("cls")
    assert sorted(int(label) for (label,) in dataset) == list(range(160))
    bound = fetch.range_memory(open_shards=2, largest_sample=_MixedSizes.LARGE)
    assert 0 < dataset.metrics.peak_range_memory <= bound, (dataset.metrics.peak_range_memory, bound)
    client.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_metrics_of_every_worker_reach_the_main_process(uploaded, num_workers):
    client, bucket, _ = uploaded
    dataset = RemoteDataset(client, bucket, "few").batched(10, collation_fn=len)
    loader = iter(DataLoader(dataset, batch_size=None, num_workers=num_workers))
    taken = next(loader)
    during = dataset.metrics  # read while the epoch runs
    assert during.samples >= taken and during.gets > 0
    assert sum(loader) + taken == 97
    after = dataset.metrics.as_dict()
    assert after["samples"] == 97 and after["bytes"] > 0 and after["gets"] >= 5
    assert after["peak_range_memory"] > 0


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # 2 cores here
@pytest.mark.parametrize("partial", [True, False])
@pytest.mark.parametrize("world_size, num_workers", [(1, 0), (1, 2), (1, 3), (2, 2), (3, 1)])
def test_len_is_what_iteration_yields_after_batching(uploaded, world_size, num_workers, partial):
    client, bucket, _ = uploaded
    seen = Counter()
    for rank in range(world_size):
        dataset = (
            RemoteDataset(client, bucket, "few", rank=rank, world_size=world_size, equalize=False)
            .map(lambda s: s["__key__"])
            .shuffle(10)
            .batched(8, collation_fn=list, partial=partial)
        )
        batches = list(DataLoader(dataset, batch_size=None, num_workers=num_workers))
        assert len(batches) == len(dataset)  # before: len() counted samples, and workers split batches
        assert all(len(b) == 8 for b in batches[:-1]) and (partial or len(batches[-1]) == 8)
        seen.update(k for b in batches for k in b)
    if partial:
        assert seen == Counter(f"{i:06d}" for i in range(97))


def test_len_is_absent_where_it_cannot_be_known(uploaded):
    client, bucket, _ = uploaded
    with pytest.raises(TypeError, match="select"):
        len(RemoteDataset(client, bucket, "few").select(lambda s: True).batched(4))
    assert len(RemoteDataset(client, bucket, "few").batched(10)) == 10
    assert len(RemoteDataset(client, bucket, "few").batched(10, partial=False)) == 9


def test_to_tuple_takes_webdatasets_single_string_form(uploaded):
    client, bucket, _ = uploaded
    spaced = list(RemoteDataset(client, bucket, "few", seed=1).to_tuple("jpg;png cls"))
    separate = list(RemoteDataset(client, bucket, "few", seed=1).to_tuple("jpg;png", "cls"))
    assert len(spaced) == 97 and all(len(t) == 2 for t in spaced)
    assert [(bytes(a), bytes(b)) for a, b in spaced] == [(bytes(a), bytes(b)) for a, b in separate]
    with pytest.raises(ConfigError, match="hold spaces"):
        RemoteDataset(client, bucket, "few").to_tuple("jpg cls", "txt")


def test_range_memory_with_samples_larger_than_a_range_stays_within_the_documented_sum(seaweed):
    """Samples of 3 MB with 1 MiB ranges: each range is one sample, and the bound counts ranges
    of that size (the formula with range_bytes alone, 8 MiB here, did not hold)."""
    import io

    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (1000, 1000, 3), dtype=np.uint8)).save(
        out, format="PNG", compress_level=0
    )
    big = out.getvalue()

    class Large:
        def __len__(self) -> int:
            return 24

        def __getitem__(self, i: int) -> tuple[bytes, int]:
            return big, i % 3

    client = seaweed.client()
    upload_to_new_bucket(client, "memory-large", "d", Large(), maxcount=6)
    fetch = FetchConfig(part_size=1 << 20, range_bytes=1 << 20, prefetch_bytes=4 << 20)
    dataset = RemoteDataset(client, "memory-large", "d", open_shards=2, fetch=fetch)
    assert len(list(dataset)) == 24
    bound = fetch.range_memory(open_shards=2, largest_sample=len(big))
    assert bound == (4 + 4 * 3 + 8) << 20
    assert 0 < dataset.metrics.peak_range_memory <= bound, dataset.metrics
    client.close()


def test_metrics_count_the_samples_delivered_not_those_prefetched(uploaded):
    client, bucket, _ = uploaded
    dataset = RemoteDataset(client, bucket, "few").shuffle(50).batched(10, collation_fn=len)
    stream = iter(dataset)
    assert next(stream) == 10
    assert dataset.metrics.samples == 10  # the shuffle buffer holds 50 more, read but not delivered
    assert sum(stream) == 87 and dataset.metrics.samples == 97


def _first_byte(sample: dict) -> dict:
    return {**sample, "jpg": sample["jpg"][:1]}  # a function of the user's, run on every sample


def _labels_and_fetch(batch: list) -> tuple[list[int], int, int]:
    """A batch's labels, and the range size and budget its worker's stream fetches with."""
    from torch.utils.data import get_worker_info

    fetch = get_worker_info().dataset._live.session.config
    return [int(x) for (x,) in batch], fetch.range_bytes, fetch.prefetch_bytes, fetch.free_ranges


@pytest.mark.parametrize("decodes, given, budget", [(True, False, (32 << 20, 0)), (False, False, (128 << 20, 2)),
                                                    (True, True, (128 << 20, 2))])
def test_a_worker_that_runs_functions_fetches_under_a_smaller_budget_unless_fetch_is_given(
        uploaded, decodes, given, budget):
    """A DataLoader worker that decodes or runs the user's functions takes samples no faster
    than it runs them: it fetches under a budget of at most 32 MiB and keeps no free range
    buffer (``FetchConfig.for_decoding``); a worker that only streams bytes keeps the
    defaults, and so does one given a ``fetch`` (its settings are the user's). Ranges keep
    their size."""
    client, bucket, _ = uploaded
    dataset = RemoteDataset(client, bucket, "few", fetch=FetchConfig() if given else None)
    dataset = (dataset.map(_first_byte) if decodes else dataset).to_tuple("cls").batched(20, _labels_and_fetch)
    batches = list(DataLoader(dataset, batch_size=None, num_workers=1))
    assert sorted(label for labels, *_ in batches for label in labels) == sorted(
        int(label) for (label,) in RemoteDataset(client, bucket, "few").to_tuple("cls"))
    assert {(range_bytes, (held, free)) for _, range_bytes, held, free in batches} == {(8 << 20, budget)}


def test_a_decoding_fetch_is_smaller_and_keeps_what_was_smaller_already():
    from remote_loader.read.reach import Reach

    decoding = FetchConfig().for_decoding()
    assert decoding == FetchConfig(prefetch_bytes=32 << 20, free_ranges=0)
    assert FetchConfig(prefetch_bytes=4 << 20).for_decoding() == FetchConfig(prefetch_bytes=4 << 20, free_ranges=0)
    assert decoding.range_memory(4) == 72 << 20 and FetchConfig().range_memory(4) == 184 << 20
    # The fetcher starts with a quarter of its ceiling: 8 MiB there, 32 MiB by default.
    assert Reach(16, decoding.prefetch_bytes).bytes == 8 << 20 and Reach(16, 128 << 20).bytes == 32 << 20


def test_a_stage_that_cannot_take_the_samples_the_chain_makes_is_refused_when_chained(uploaded):
    """Each of these was accepted, then failed deep inside at the first sample, or gave wrong
    items without a word: ``map_tuple`` on dict samples iterated each dict's field names, and
    ``decode`` after ``batched`` decoded nothing."""
    client, bucket, _ = uploaded
    base = RemoteDataset(client, bucket, "few", seed=4)
    pairs = base.to_tuple("jpg", "cls")
    refused = {
        "decode decodes the fields of dict samples: .* here the samples are tuples of 2": lambda: pairs.decode("pil"),
        "decode .* here the samples are batches": lambda: base.batched(4).decode("pil"),
        "to_tuple picks fields of dict samples.* here the samples are tuples of 2": lambda: pairs.to_tuple("jpg"),
        "to_tuple .* here the samples are tuples of 2": lambda: pairs.map_tuple(None, len).to_tuple("cls"),
        "map_tuple applies 4 functions .* here the samples are dicts": lambda: base.map_tuple(None, None, None, None),
        "map_tuple applies 1 functions .* here the samples are tuples of 2": lambda: pairs.map_tuple(len),
    }
    for message, chain in refused.items():
        with pytest.raises(ConfigError, match=message):
            chain()
    # what a function makes is not known before it runs: left to the stage, as before
    as_pairs = base.map(lambda s: (s["__key__"], s["cls"])).map_tuple(None, int)
    assert sorted(as_pairs) == sorted((s["__key__"], int(s["cls"])) for s in base)
    assert list(base.batched(4).to_tuple("__key__"))  # a batch of dicts collates to a dict: its fields by name


def test_set_epoch_takes_the_epochs_a_saved_state_may_hold(uploaded):
    """An epoch past 2**62 was taken (then refused by ``load_state_dict`` in the state saved
    of it), and one past 2**63 raised torch's overflow from a tensor's assignment."""
    import numpy as np

    client, bucket, _ = uploaded
    ds = RemoteDataset(client, bucket, "few", seed=4)
    for bad in (2**62 + 1, 2**63, 10**30):
        with pytest.raises(ConfigError, match=r"epoch must be an integer in 0\.\.4611686018427387904"):
            ds.set_epoch(bad)
    ds.set_epoch(np.int64(2))
    ds.set_epoch(2**62)
    state = ds.state_dict(consumed=0, num_workers=0)
    RemoteDataset(client, bucket, "few", seed=4).load_state_dict(state)
