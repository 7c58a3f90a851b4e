"""Uploads to a real S3 server, read back through the format layer."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import boto3
import numpy as np
import pytest
from PIL import Image

from remote_loader import (
    ConfigError,
    DatasetReader,
    EndpointUnreachable,
    RemoteDataset,
    RetryConfig,
    UploadConflict,
    UploadError,
    make_client,
    restore,
    upload_cv_dataset,
)
from remote_loader.format import INDEX_MEMBER
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import FlakyImages, WaitingPath, alive, upload, upload_to_new_bucket
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


def read_back(client, bucket, folder):
    """{source index: (image field, image bytes, label)} and how often each index was seen."""
    got, seen = {}, Counter()
    for sample in DatasetReader(client, bucket, folder):
        index = int(sample["__key__"])
        seen[index] += 1
        field = "jpg" if "jpg" in sample else "png"
        got[index] = (field, bytes(sample[field]), int(bytes(sample["cls"])))
    return got, seen


def test_round_trip_of_jpeg_and_png_with_two_workers(roundtrip_s3):
    client, bucket = roundtrip_s3
    ds = SyntheticImages(520, num_classes=13, size=(96, 72), formats=("jpeg", "png"))
    summary = upload_cv_dataset(
        ds, client=client, bucket=bucket, base_folder="rt", maxcount=60, workers=2, progress=False
    )
    assert summary.samples == 520 and summary.skipped == 0 and summary.shards >= 9
    got, seen = read_back(client, bucket, "rt")
    assert set(seen) == set(range(520)) and set(seen.values()) == {1}
    for i in range(520):
        data, label = ds[i]
        assert got[i] == ("jpg" if i % 2 == 0 else "png", data, label)


def test_shards_open_with_tarfile_and_respect_limits(s3):
    client, bucket = s3
    ds = SyntheticImages(200, size=(64, 48))
    upload_cv_dataset(
        ds, client=client, bucket=bucket, base_folder="tf", maxcount=50, maxsize=200_000, workers=0, progress=False
    )
    reader = DatasetReader(client, bucket, "tf")
    for entry in reader.manifest.shards:
        data = client.get(bucket, f"tf/{entry.name}")
        assert len(data) == entry.size <= 200_000 and entry.samples <= 50
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            names = tar.getnames()
        keys = [n.split(".")[0] for n in names[:-1]]
        assert names[-1] == INDEX_MEMBER
        assert names[:-1] == [f"{k}.{f}" for k in dict.fromkeys(keys) for f in ("jpg", "cls")]
        assert len(set(keys)) == entry.samples
    assert reader.manifest.num_samples == 200


def test_class_ordered_data_is_shuffled_at_write_time(s3):
    client, bucket = s3
    ds = SyntheticImages(600, num_classes=10, size=(32, 24))
    upload(client, bucket, "shuf", ds, maxcount=100)
    labels = [int(bytes(s["cls"])) for s in DatasetReader(client, bucket, "shuf")]
    adjacent_equal = np.mean(np.diff(labels) == 0)
    # Written in class order this is 0.985; a uniform shuffle of 10 classes gives about 0.1.
    assert adjacent_equal < 0.2
    assert len(set(labels[:100])) == 10  # the first shard holds every class


def test_same_seed_same_shards_other_seed_other_order(s3):
    client, bucket = s3
    ds = SyntheticImages(120, size=(32, 24))
    for folder, seed in (("a", 1), ("b", 1), ("c", 2)):
        upload_cv_dataset(
            ds, client=client, bucket=bucket, base_folder=folder, seed=seed, maxcount=40, workers=0, progress=False
        )
    keys = {f: [s["__key__"] for s in DatasetReader(client, bucket, f)] for f in "abc"}
    assert keys["a"] == keys["b"] != keys["c"]
    assert sorted(keys["a"]) == sorted(keys["c"])
    first = {f: DatasetReader(client, bucket, f).manifest.shards[0].name for f in "ab"}
    assert client.get(bucket, f"a/{first['a']}") == client.get(bucket, f"b/{first['b']}")


def test_bad_sample_raises_naming_its_index(s3):
    client, bucket = s3
    with pytest.raises(UploadError, match="sample 17: image bytes is not an image") as info:
        upload_cv_dataset(
            FlakyImages(40, {17}, size=(32, 24)),
            client=client,
            bucket=bucket,
            base_folder="bad",
            workers=2,
            progress=False,
        )
    assert info.value.index == 17
    assert not client.exists(bucket, "bad/manifest.msgpack")


def test_skip_counts_bad_samples_in_manifest_and_summary(s3):
    client, bucket = s3
    ds = FlakyImages(80, {3, 40, 41}, size=(32, 24))
    summary = upload_cv_dataset(
        ds, client=client, bucket=bucket, base_folder="skip", maxcount=20, on_error="skip", workers=2, progress=False
    )
    assert summary.skipped == 3 and summary.samples == 77
    reader = DatasetReader(client, bucket, "skip")
    assert reader.manifest.skipped == 3 and reader.manifest.skipped_indices == (3, 40, 41)
    assert sorted(int(s["__key__"]) for s in reader) == sorted(set(range(80)) - {3, 40, 41})


class _TwoLineFailure(SyntheticImages):
    def __getitem__(self, index):
        if index == 3:
            raise RuntimeError("line one\nline two\x1b[31m")
        return super().__getitem__(index)


def test_an_items_error_of_several_lines_is_reported_on_one_line_each_place(s3, caplog):
    """The user's message keeps its text, its newline and escape sequence shown escaped: in
    skip_reasons, the WARNING record and the UploadError."""
    client, bucket = s3
    ds = _TwoLineFailure(10, size=(16, 16))
    with caplog.at_level("WARNING", logger="remote_loader"):
        summary = upload_cv_dataset(ds, client=client, bucket=bucket, base_folder="lines", on_error="skip",
                                    workers=0, progress=False)
    expected = "ds[3] raised RuntimeError: line one\\nline two\\x1b[31m"
    assert len(summary.skip_reasons) == 1 and expected in summary.skip_reasons[0], summary.skip_reasons
    warnings = [r.getMessage() for r in caplog.records if "skipped a sample" in r.getMessage()]
    assert len(warnings) == 1 and expected in warnings[0] and warnings[0].isprintable(), warnings
    with pytest.raises(UploadError) as info:
        upload_cv_dataset(ds, client=client, bucket=bucket, base_folder="lines2", workers=0, progress=False)
    assert expected in str(info.value) and str(info.value).isprintable(), str(info.value)


def test_in_memory_images_round_trip_pixels(s3):
    client, bucket = s3
    ds = SyntheticImages(30, size=(40, 30), output="pil")
    upload(client, bucket, "pil", ds, image_format="png")
    for sample in DatasetReader(client, bucket, "pil"):
        index = int(sample["__key__"])
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(bytes(sample["png"])))), np.asarray(ds.image(index)))


def test_callers_executor_runs_the_tasks(s3):
    client, bucket = s3
    ds = SyntheticImages(90, size=(32, 24))
    with ThreadPoolExecutor(3) as pool:
        summary = upload_cv_dataset(
            ds, client=client, bucket=bucket, base_folder="ex", maxcount=10, executor=pool, progress=False
        )
    assert summary.shards == 9
    _, seen = read_back(client, bucket, "ex")
    assert set(seen) == set(range(90)) and set(seen.values()) == {1}


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"ds": SyntheticImages(0)}, UploadError, "empty"),
        ({"maxsize": 5000}, UploadError,
         r"too large for a shard of maxsize=5000 bytes \(a shard of it alone is \d+ with its tar headers and index\)"),
        ({"maxsize": 100}, ConfigError, "maxsize"),
        ({"on_error": "ignore"}, ConfigError, "on_error"),
        ({"image_format": "bmp"}, ConfigError, "image_format"),
        ({"ds": [(b"x", 1)] * 3}, UploadError, r"sample \d: image bytes is not an image"),
        ({"ds": [1, 2]}, UploadError, "expected an \\(image, target\\) pair"),
    ],
)
def test_bad_arguments(s3, kwargs, error, message):
    client, bucket = s3
    args = {"ds": SyntheticImages(10, size=(64, 48)), "workers": 0, "progress": False}
    args.update(kwargs)
    with pytest.raises(error, match=message):
        upload_cv_dataset(client=client, bucket=bucket, base_folder="args", **args)


def test_rerun_keeps_a_finished_dataset_and_refuses_other_parameters(s3):
    client, bucket = s3
    ds = SyntheticImages(30, size=(32, 24))
    first = upload_cv_dataset(
        ds, client=client, bucket=bucket, base_folder="re", maxcount=10, workers=0, progress=False
    )
    again = upload_cv_dataset(
        ds, client=client, bucket=bucket, base_folder="re", maxcount=10, workers=0, progress=False
    )
    assert again.kept_shards == first.shards == 3
    with pytest.raises(UploadError, match="other parameters"):
        upload_cv_dataset(ds, client=client, bucket=bucket, base_folder="re", maxcount=15, workers=0, progress=False)
    old = {s.name for s in DatasetReader(client, bucket, "re").manifest.shards}
    replaced = upload_cv_dataset(
        ds, client=client, bucket=bucket, base_folder="re", maxcount=15, workers=0, overwrite=True, progress=False
    )
    assert replaced.shards == 2
    names = [s.name for s in DatasetReader(client, bucket, "re").manifest.shards]
    assert len(names) == 2 and not set(names) & old  # written beside the old dataset, never over it
    # The old dataset's shards are gone once the new manifest is in place; only the new ones remain.
    assert sorted(o.key for o in client.list(bucket, "re/")) == sorted(
        ["re/manifest.msgpack", *(f"re/{n}" for n in names)]
    )


def test_upload_killed_mid_shard_resumes(seaweed, s3, tmp_path):
    """SIGKILL a real upload while a multipart shard is half sent; the re-run completes it."""
    client, bucket = s3
    n, per_shard = 300, 60  # 60 x ~110 KB: each shard spans two 5 MiB parts
    ds = SyntheticImages(n)
    order = np.random.default_rng(0).permutation(n)
    # Deep inside the fifth shard, after its first part: the last task, which its process
    # writes alone (the four before it went two at a time, and are finished).
    kill_at = int(order[4 * per_shard + 55])
    script = tmp_path / "upload.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(ROOT)!r})
            from remote_loader import make_client, upload_cv_dataset
            from tests.helpers import KillingImages
            client = make_client()
            upload_cv_dataset(KillingImages({n}, kill_at={kill_at}), client=client, bucket={bucket!r},
                              base_folder="killed", maxcount={per_shard}, maxsize=1e9, workers=1,
                              part_size=5 * 1024 * 1024, progress=False)
            """
        )
    )
    env = {**os.environ, **seaweed.env()}
    process = subprocess.run(
        [sys.executable, str(script)], env=env, start_new_session=True, capture_output=True, timeout=300
    )
    assert process.returncode == -9, process.stderr.decode()[-2000:]
    assert not client.exists(bucket, "killed/manifest.msgpack")
    raw = boto3.client(
        "s3",
        endpoint_url=seaweed.endpoint_url,
        aws_access_key_id=seaweed.access_key,
        aws_secret_access_key=seaweed.secret_key,
        region_name="us-east-1",
    )
    unfinished = raw.list_multipart_uploads(Bucket=bucket, Prefix="killed/").get("Uploads", [])
    assert len(unfinished) == 1 and re.fullmatch(r"killed/shard-[0-9a-f]{8}-000004-000\.tar", unfinished[0]["Key"])

    def rerun():
        return upload_cv_dataset(ds, client=client, bucket=bucket, base_folder="killed", maxcount=per_shard,
                                 maxsize=1e9, workers=2, part_size=5 * 1024 * 1024, progress=False)

    summary = rerun()
    assert summary.kept_shards == 4 and summary.shards == 5 and summary.samples == n
    # What this call did, apart from what it kept: its rate is over what it uploaded.
    assert (summary.kept_samples, summary.uploaded_samples, summary.uploaded_shards) == (240, 60, 1)
    assert summary.samples_per_s == pytest.approx(60 / summary.writing_seconds)
    assert str(summary).startswith("uploaded 60 samples in 1 shard (") and "kept 4 shards (240 samples)" in str(summary)
    again = rerun()
    assert (again.uploaded_samples, again.samples_per_s, again.mb_per_s) == (0, 0.0, 0.0)
    assert "already holds this dataset, 300 samples in 5 shards" in str(again) and "nothing to upload" in str(again)
    assert raw.list_multipart_uploads(Bucket=bucket, Prefix="killed/").get("Uploads", []) == []
    reader = DatasetReader(client, bucket, "killed")
    assert all(reader.check_shard(entry).ok for entry in reader.manifest.shards)
    _, seen = read_back(client, bucket, "killed")
    assert set(seen) == set(range(n)) and set(seen.values()) == {1}
    assert not [o.key for o in client.list(bucket, "killed/_upload/")]


class CountingImages(SyntheticImages):
    """Records which process read each item."""

    def __init__(self, n: int, **kwargs) -> None:
        super().__init__(n, **kwargs)
        self.readers: list[int] = []

    def __getitem__(self, index):
        self.readers.append(os.getpid())
        return super().__getitem__(index)


def test_workers_zero_encodes_in_this_process(s3):
    client, bucket = s3
    ds = CountingImages(25, size=(32, 24))
    upload_cv_dataset(ds, client=client, bucket=bucket, base_folder="inline", maxcount=10, workers=0, progress=False)
    # All 25 read for the fingerprint (up to 128 are), planning the task size (up to 64), then writing; all here.
    assert len(ds.readers) == 25 + 25 + 25 and set(ds.readers) == {os.getpid()}


def test_round_trip_on_a_store_without_multipart_listing(localbucket):
    """localbucket answers NotImplemented to ListMultipartUploads: the upload goes on and reads back exactly."""
    target = localbucket.target
    client = make_client(target.endpoint_url, target.access_key, target.secret_key)
    ds = SyntheticImages(30, size=(48, 32))
    upload_to_new_bucket(client, "plain", "ds", ds, maxcount=8)
    stored = sorted(bytes(s["jpg"]) for s in DatasetReader(client, "plain", "ds"))
    assert stored == sorted(ds[i][0] for i in range(len(ds)))
    client.close()


def test_an_upload_to_a_dead_endpoint_gives_up_at_its_outage_deadline():
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = make_client(endpoint, "key", "secret")
    with pytest.raises(EndpointUnreachable, match=r"outage_deadline=0\.5 s") as caught:
        upload_cv_dataset(
            SyntheticImages(4, size=(8, 8)),
            client=client,
            bucket="b",
            base_folder="d",
            workers=0,
            progress=False,
            retry=RetryConfig(outage_deadline=0.5, backoff=0.01),
        )
    assert endpoint in str(caught.value) and "secret" not in str(caught.value)
    client.close()


def test_a_task_record_whose_shard_is_missing_is_written_again(s3):
    """A task's record goes out while its last shard's upload completes, so a record may
    land for a shard that never appeared: a resumed upload trusts a record only for shards
    listed at their recorded sizes, and writes that task again."""
    client, bucket = s3
    args = dict(maxcount=10, shuffle=False)
    with pytest.raises(UploadError, match="sample 35"):
        # tasks 0-2 finished, task 3 stopped
        upload(client, bucket, "half", FlakyImages(40, {35}, size=(32, 24)), **args)
    records = sorted(o.key for o in client.list(bucket, "half/_upload/") if "/task-" in o.key)
    assert [r.rsplit("/", 1)[1] for r in records] == [
        "task-000000.msgpack",
        "task-000001.msgpack",
        "task-000002.msgpack",
    ]
    (shard,) = [o.key for o in client.list(bucket, "half/shard-") if "-000001-" in o.key]
    client.delete(bucket, shard)  # task 1's record is there, its shard is not
    summary = upload(client, bucket, "half", SyntheticImages(40, size=(32, 24)), **args)
    assert summary.kept_shards == 2 and summary.shards == 4 and summary.samples == 40
    samples, seen = read_back(client, bucket, "half")
    assert set(seen) == set(range(40)) and set(seen.values()) == {1}
    assert client.exists(bucket, shard)
    upload(client, bucket, "whole", SyntheticImages(40, size=(32, 24)), **args)
    assert samples == read_back(client, bucket, "whole")[0]  # byte for byte what one clean run writes


def _within(seconds: float, condition) -> bool:
    """Whether ``condition()`` holds within ``seconds``, checked every 50 ms (a bound on a
    process's exit, which nothing here can be notified of)."""
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_upload_workers_end_when_the_upload_is_killed(seaweed, s3, tmp_path, start_method):
    client, bucket = s3
    script = textwrap.dedent(f"""
        import multiprocessing
        from remote_loader import make_client, upload_cv_dataset
        from tests.helpers import StuckInWorkers

        if __name__ == "__main__":
            multiprocessing.set_start_method({start_method!r})
            client = make_client({seaweed.endpoint_url!r}, {seaweed.access_key!r}, {seaweed.secret_key!r})
            upload_cv_dataset(StuckInWorkers(64, {str(tmp_path)!r}, size=(16, 16)), client=client, bucket={bucket!r},
                              base_folder="killed", maxcount=8, workers=2, progress=False)
    """)
    (tmp_path / "upload.py").write_text(script)
    upload = subprocess.Popen(
        [sys.executable, str(tmp_path / "upload.py")],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    workers: list[int] = []
    try:
        assert _within(120, lambda: len(os.listdir(tmp_path)) >= 3), "the upload's two workers never started a task"
        workers = [int(name) for name in os.listdir(tmp_path) if name.isdigit()]
        assert len(workers) == 2 and all(alive(pid) for pid in workers)
        upload.kill()  # SIGKILL: no clean-up runs in the upload's process
        upload.wait(30)
        assert _within(10, lambda: not any(alive(pid) for pid in workers)), "orphaned workers kept running"
    finally:
        if upload.poll() is None:
            upload.kill()
        for pid in workers:
            if alive(pid):
                os.kill(pid, 9)


def test_a_run_stopped_at_a_bad_sample_is_finished_by_a_run_that_skips_it(s3, capsys):
    client, bucket = s3
    ds = FlakyImages(40, {37}, size=(16, 16))
    with pytest.raises(UploadError, match="sample 37"):
        upload_cv_dataset(
            ds, client=client, bucket=bucket, base_folder="f", maxcount=10, workers=0, progress=False, shuffle=False
        )
    summary = upload_cv_dataset(
        ds,
        client=client,
        bucket=bucket,
        base_folder="f",
        maxcount=10,
        workers=0,
        progress=False,
        shuffle=False,
        on_error="skip",
    )
    assert summary.skipped == 1 and summary.samples == 39 and summary.kept_shards == 3  # the tasks before it stay
    again = upload_cv_dataset(
        ds,
        client=client,
        bucket=bucket,
        base_folder="f",
        maxcount=10,
        workers=0,
        progress=False,
        shuffle=False,
        on_error="skip",
    )
    assert again.uploaded_samples == 0
    with pytest.raises(UploadError, match="other parameters"):
        upload_cv_dataset(
            ds, client=client, bucket=bucket, base_folder="f", maxcount=10, workers=0, progress=False, shuffle=False
        )


def test_another_runs_parameters_are_named_in_the_refusal(s3):
    client, bucket = s3
    ds = FlakyImages(40, {37}, size=(16, 16))
    with pytest.raises(UploadError):
        upload_cv_dataset(ds, client=client, bucket=bucket, base_folder="g", maxcount=10, workers=0, progress=False)
    with pytest.raises(
        UploadError,
        match=r"unfinished upload with other parameters \(run [0-9a-f]{8}: seed=0 there,"
        r" 3 here\)",
    ):
        upload_cv_dataset(
            ds, client=client, bucket=bucket, base_folder="g", maxcount=10, workers=0, progress=False, seed=3
        )


@pytest.mark.parametrize("workers", [0, 2])
def test_the_progress_bar_ends_at_its_total_and_agrees_with_the_summary(s3, capsys, workers):
    """The bar's bytes are the shards' (tar headers and indexes too) and its rate the average
    over the span the summary's writing rate covers: the two say the same."""
    client, bucket = s3
    summary = upload_cv_dataset(
        SyntheticImages(100, size=(16, 16)),
        client=client,
        bucket=bucket,
        base_folder=f"p{workers}",
        maxcount=10,
        workers=workers,
        progress=True,
    )
    final = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "100/100" in final, final
    rate, megabytes = re.search(r"([\d.]+)img/s, ([\d.]+) MB,", final).groups()  # type: ignore[union-attr]
    assert f"{summary.bytes / 1e6:.1f}" == megabytes
    assert float(rate) == pytest.approx(summary.samples_per_s, rel=0.01)
    assert 0 < summary.writing_seconds <= summary.seconds
    said = f"of which {summary.writing_seconds:.1f} s reading ds[i], encoding and writing at"
    assert f"{said} {summary.samples_per_s:,.0f} samples/s" in str(summary)


def test_an_unguarded_script_under_spawn_is_told_to_guard_its_upload(seaweed, s3, tmp_path):
    """What a README snippet pasted into a file does on macOS or Windows (spawn): each worker
    imports the script again; the error names the guard, and advises no resume."""
    _, bucket = s3
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(f"""
        import multiprocessing
        multiprocessing.set_start_method("spawn", force=True)
        from remote_loader import make_client, upload_cv_dataset
        from remote_loader.testing.synthetic import SyntheticImages
        client = make_client({seaweed.endpoint_url!r}, {seaweed.access_key!r}, {seaweed.secret_key!r})
        upload_cv_dataset(SyntheticImages(40, size=(16, 16)), client=client, bucket={bucket!r}, base_folder="u",
                          maxcount=10, workers=2, progress=False)
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "UploadError" in last and 'if __name__ == "__main__":' in last and "resume" not in last, out.stderr[-3000:]
    assert "upload_cv_dataset was called while a worker process was starting" in out.stderr  # the workers' own error


def _holding_first_commit(tmp_path):
    """A LocalStore whose first shard's commit waits (up to 10 s) until another shard is
    opened; ``store.held`` says whether one was, ``store.shards`` the shards in the order opened."""
    from remote_loader import LocalStore

    class Holding(LocalStore):
        def open_writer(self, bucket, key, *, part_size=16 << 20):
            writer = super().open_writer(bucket, key, part_size=part_size)
            if "/shard-" not in key:
                return writer
            self.shards.append(key)
            if len(self.shards) == 1:
                commit = writer.commit

                def held_commit() -> None:
                    self.held.append(self.other_opened.wait(10))  # False: no other shard opened meanwhile
                    commit()

                writer.commit = held_commit
            else:
                self.other_opened.set()
            return writer

    store = Holding(tmp_path)
    store.held, store.shards, store.other_opened = [], [], threading.Event()
    store.create_bucket("b")
    return store


def test_a_full_shard_commits_while_the_next_one_fills(tmp_path):
    """The encoder does not wait for a full shard's last parts and the request completing it:
    here the first shard's commit is held until the task's next shard opens, which happens
    only if that commit runs beside the encoding. Every sample still arrives, byte-identical."""
    from remote_loader.storage import Location
    from remote_loader.upload.encode import EncodeOptions
    from remote_loader.upload.tasks import TaskSpec, write_task

    store = _holding_first_commit(tmp_path)
    ds = SyntheticImages(40, size=(32, 32))
    spec = TaskSpec(store=store, location=Location("b", "d", store.path_of("b", "d")), options=EncodeOptions(),
                    maxsize=1 << 30, maxcount=10, on_error="raise", part_size=16 << 20, key_width=2, run="r")
    result = write_task(spec, 0, list(range(40)), ds)
    assert store.held == [True]
    assert [e.samples for e in result.entries] == [10, 10, 10, 10]
    keys = []
    for entry, key in zip(result.entries, store.shards, strict=True):
        data = store.get("b", key)
        assert len(data) == entry.size
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".cls")}
        keys += [int(name.split(".")[0]) for name in members]
        assert all(int(v) == ds[int(n.split(".")[0])][1] for n, v in members.items())
    assert sorted(keys) == list(range(40))


def test_a_process_writes_two_tasks_at_once(tmp_path):
    """A task's last shard is committed while the process's other task encodes, instead of
    the process idling between tasks: here the first shard's commit is held until another
    task opens a shard, which happens only if two tasks run at once. Every sample still
    arrives once, byte-identical."""
    store = _holding_first_commit(tmp_path)
    ds = SyntheticImages(40, size=(32, 32))
    summary = upload(store, "b", "d", ds, maxcount=10)
    assert store.held == [True] and summary.shards == 4
    got, seen = read_back(store, "b", "d")
    assert set(seen) == set(range(40)) and set(seen.values()) == {1}
    assert all(got[i] == ("jpg", *ds[i]) for i in range(40))


@pytest.mark.parametrize("tasks, processes, sizes", [(8, 2, [2, 2, 2, 2]), (5, 2, [2, 2, 1]), (4, 4, [1, 1, 1, 1]),
                                                     (6, 4, [1] * 6), (3, 1, [2, 1]), (1, 8, [1])])
def test_tasks_go_in_pairs_only_when_every_process_still_gets_work(tasks, processes, sizes):
    """A pair is written by one process, whose encoding holds one GIL: with fewer tasks than
    two per process, pairs would leave processes idle beside busy ones."""
    from remote_loader.upload.executors import task_groups

    pending = [(t, np.arange(3)) for t in range(tasks)]
    groups = task_groups(pending, processes)
    assert [len(g) for g in groups] == sizes
    assert [t for g in groups for t, _ in g] == list(range(tasks))


def test_ctrl_c_stops_the_task_running_beside_it(tmp_path):
    """Ctrl-C while two tasks run: the other task stops at its next sample and writes
    nothing more (no shard, no task record), instead of encoding and uploading for nobody."""
    import _thread

    from remote_loader import LocalStore

    interrupted, release = threading.Event(), threading.Event()
    read_after: list[int] = []
    image = tmp_path / "image.png"
    image.write_bytes(SyntheticImages(1, size=(32, 32))[0][0])

    class Interrupting(SyntheticImages):
        def __getitem__(self, index):
            if threading.current_thread().name == "remote-loader-task":  # not the main thread's size estimate
                if interrupted.is_set():
                    read_after.append(index)
                    release.wait(10)  # until the caller has had its KeyboardInterrupt
                elif index >= 10:  # the other tasks: held as they encode until the Ctrl-C, so none finishes before it
                    return WaitingPath(lambda: interrupted.wait(10), image), index
                elif index == 5:  # the first task's sixth sample
                    interrupted.set()
                    _thread.interrupt_main()
                    release.wait(10)
            return super().__getitem__(index)

    store = LocalStore(tmp_path)
    store.create_bucket("b")
    with pytest.raises(KeyboardInterrupt):
        upload(store, "b", "d", Interrupting(40, size=(32, 32)), maxcount=10, shuffle=False)
    release.set()
    for thread in [t for t in threading.enumerate() if t.name == "remote-loader-task"]:
        thread.join(10)
        assert not thread.is_alive()
    assert len(read_after) <= 1  # the other task's sample under way when Ctrl-C came, then nothing
    assert [o.key for o in store.list("b", "d/") if "/shard-" in o.key or "/task-" in o.key] == []


def test_a_new_upload_spends_no_round_trip_it_can_save(tmp_path):
    """Across a network each request made in sequence costs a round trip. Before its first
    shard a new upload makes only the requests its claim needs (the manifest and the state
    read at once, then the state written): its run id was just drawn, so it has nothing to
    list or abort. At the end it lists its leftovers beside the manifest's switch: here the
    switch is held until the listing has gone out."""
    from remote_loader import LocalStore

    calls: list[str] = []
    listed = threading.Event()
    held: list[bool] = []

    class Recording(LocalStore):
        def get_versioned(self, bucket, key):
            calls.append(f"get {key.split('/', 1)[1]}")
            return super().get_versioned(bucket, key)

        def put(self, bucket, key, data, **conditions):
            calls.append(f"put {key.split('/', 1)[1]}")
            if key.endswith("/manifest.msgpack"):
                held.append(listed.wait(10))  # False: the listing waited for the switch
            return super().put(bucket, key, data, **conditions)

        def list(self, bucket, prefix="", **kw):
            calls.append(f"list {prefix.split('/', 1)[1]}")
            listed.set()
            return super().list(bucket, prefix, **kw)

        def abort_uploads(self, bucket, prefix=""):
            calls.append("abort uploads")
            return super().abort_uploads(bucket, prefix)

        def open_writer(self, bucket, key, *, part_size=16 << 20):
            calls.append("shard")
            return super().open_writer(bucket, key, part_size=part_size)

    store = Recording(tmp_path)
    ds = SyntheticImages(40, size=(32, 32))
    upload_to_new_bucket(store, "b", "d", ds, maxcount=10)
    before_shards = calls[: calls.index("shard")]
    assert sorted(before_shards[:2]) == ["get _upload/state.msgpack", "get manifest.msgpack"]
    assert before_shards[2:] == ["put _upload/state.msgpack"]
    assert held == [True]
    got, seen = read_back(store, "b", "d")
    assert set(seen) == set(range(40)) and set(seen.values()) == {1}
    assert [o.key for o in store.list("b", "d/_upload/")] == []


def test_tasks_are_sized_from_enough_samples_to_leave_no_sliver_shards(tmp_path):
    """Photographs' sizes vary by about a third. Judged from 16 samples, their mean came out
    up to 12% low, and every task spilled its last samples into a shard of its own, a few
    hundred KB beside shards of maxsize. No shard but one may be under half of maxsize."""
    from remote_loader import LocalStore

    # Sizes whose first 16 in the upload's order average 16% under the mean (64 of them: 2%).
    sizes = np.random.default_rng(37).lognormal(np.log(11_000), 0.33, 4000).astype(int)
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="JPEG")
    tiny = out.getvalue()  # a JPEG, then bytes after its end, as large as the photograph

    class Photos:
        def __len__(self) -> int:
            return len(sizes)

        def __getitem__(self, i: int) -> tuple[bytes, int]:
            return tiny + bytes(max(0, int(sizes[i]) - len(tiny))), i % 10

    store = LocalStore(tmp_path)
    store.create_bucket("b")
    upload(store, "b", "d", Photos(), maxsize=8_000_000)
    shards = sorted(int(e.size) for e in DatasetReader(store, "b", "d").manifest.shards)
    assert sum(s < 4_000_000 for s in shards) <= 1, shards


class Masks:
    """A segmentation dataset whose masks are ``value`` (fixed masks: another value)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int):
        return Image.new("RGB", (16, 12), (index, 90, 30)), Image.new("L", (16, 12), self.value)


def _masks(client, bucket, folder):
    return {int(s["__key__"]): int(np.asarray(restore(s)[1]).max()) for s in RemoteDataset(client, bucket, folder)}


def test_a_different_dataset_with_the_same_length_and_settings_is_refused_then_replaced_never_kept(s3):
    client, bucket = s3
    upload(client, bucket, "seg", Masks(1), maxcount=4)
    with pytest.raises(UploadError, match=r"holds another dataset uploaded with these parameters: other items"
                                          r" \(ds\[0\] differs\); pass overwrite=True \(--overwrite\)"):
        upload(client, bucket, "seg", Masks(2), maxcount=4)
    assert set(_masks(client, bucket, "seg").values()) == {1}  # refused: nothing of it changed
    summary = upload(client, bucket, "seg", Masks(2), maxcount=4, overwrite=True)
    assert summary.kept_samples == 0 and set(_masks(client, bucket, "seg").values()) == {2}
    again = upload(client, bucket, "seg", Masks(2), maxcount=4)  # the same data again: kept, nothing sent
    assert again.kept_samples == 12 and again.uploaded_samples == 0


def test_a_refusal_over_a_dataset_of_another_length_says_the_lengths_differ_not_that_items_went_unrecorded(s3):
    """Both uploads recorded their items; a dataset of another length is told by its length."""
    client, bucket = s3
    with pytest.raises(UploadError, match="sample 9"):
        upload(client, bucket, "len", FlakyImages(12, {9}, size=(16, 12)), maxcount=4, shuffle=False)
    with pytest.raises(UploadConflict, match=r"unfinished upload") as unfinished:
        upload(client, bucket, "len", SyntheticImages(8, size=(16, 12)), maxcount=4, shuffle=False)
    upload(client, bucket, "done", SyntheticImages(12, size=(16, 12)), maxcount=4)
    with pytest.raises(UploadError, match="other parameters") as finished:
        upload(client, bucket, "done", SyntheticImages(8, size=(16, 12)), maxcount=4)
    for message in (str(unfinished.value), str(finished.value)):
        assert "samples=12 there, 8 here" in message and "before uploads recorded" not in message, message


def test_an_interrupted_upload_is_not_finished_with_other_items(s3):
    client, bucket = s3
    with pytest.raises(UploadError, match="sample 9"):
        upload(client, bucket, "half", FlakyImages(12, {9}, size=(16, 12)), maxcount=4, shuffle=False)
    # Item 9 could not be encoded: the run may be finished by a dataset that fixed it ...
    assert upload(client, bucket, "half", SyntheticImages(12, size=(16, 12)), maxcount=4, shuffle=False).kept_samples
    with pytest.raises(UploadError, match="sample 9"):
        upload(client, bucket, "other", FlakyImages(12, {9}, size=(16, 12)), maxcount=4, shuffle=False)
    # ... not by other items
    with pytest.raises(UploadConflict, match=r"unfinished upload .*other items \(ds\[0\] differs\)"):
        upload(client, bucket, "other", SyntheticImages(12, size=(16, 12), seed=5), maxcount=4, shuffle=False)


def test_an_error_of_several_lines_from_an_item_or_an_executor_is_quoted_on_one_line():
    """An item whose content raises while it is read for its digest, and an executor that
    fails, quote the error's text on one line, its newline escaped."""
    from collections.abc import Mapping
    from concurrent.futures import Future

    from remote_loader.upload.executors import _result
    from remote_loader.upload.fingerprint import item_digest

    class Unreadable(Mapping):
        def __getitem__(self, key):
            raise ValueError("line one\nline two")

        def __iter__(self):
            return iter(["a"])

        def __len__(self):
            return 1

    with pytest.raises(UploadError) as unreadable:
        item_digest(Unreadable(), lambda image: None, 7)
    failed: Future = Future()
    failed.set_exception(RuntimeError("the cluster said\nno"))
    with pytest.raises(UploadError) as executor:
        _result(failed, "task 3", None)
    for raised in (unreadable.value, executor.value):
        message = str(raised).split("\nremote_loader facts:")[0]
        assert "\n" not in message and "\\n" in message, message


class _NoLength:
    def __getitem__(self, index: int):
        return b"x", index


class _LengthFails(_NoLength):
    def __len__(self) -> int:
        raise ValueError("the index file\nis missing")


def test_a_dataset_without_len_or_whose_len_fails_is_named_in_one_line(tmp_path):
    from remote_loader import ConfigError, LocalStore, upload_cv_dataset

    store = LocalStore(str(tmp_path))
    store.create_bucket("b")
    with pytest.raises(ConfigError, match=r"^the dataset \(_NoLength\) has no len\(\): the upload reads a map-style"):
        upload_cv_dataset(_NoLength(), client=store, bucket="b", base_folder="x", progress=False, workers=0)
    with pytest.raises(UploadError, match=r"^len\(ds\) raised ValueError: the index file.*is missing$") as info:
        upload_cv_dataset(_LengthFails(), client=store, bucket="b", base_folder="x", progress=False, workers=0)
    assert isinstance(info.value.__cause__, ValueError) and "\n" not in str(info.value)


class _LosingExecutor(ThreadPoolExecutor):
    """Loses every other job: its future is done, with no results."""

    submitted = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        if self.submitted % 2 == 0:
            lost: Future = Future()
            lost.set_result([])
            return lost
        return super().submit(fn, *args, **kwargs)


def test_an_executor_that_loses_tasks_gets_no_manifest_written(s3):
    """An executor whose futures end with no result for some tasks: the upload published a
    manifest of the tasks it got back and said so as a success ('uploaded 60 samples' of 100)."""
    client, bucket = s3
    with _LosingExecutor(2) as executor, pytest.raises(UploadError, match="the executor returned no result for"):
        upload(client, bucket, "lost", SyntheticImages(100, size=(16, 16)), maxcount=10, executor=executor)
    assert not DatasetReader(client, bucket, "lost").has_manifest()
