"""Uploads that meet: two to one prefix, one to a prefix inside another's, two in one process.

At most one upload to a prefix succeeds, the other stops with ``UploadConflict`` and touches
nothing of the winner's, and the dataset left behind is whole.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from remote_loader import DatasetReader, RetryConfig, UploadConflict, UploadError
from remote_loader.storage.local import LocalStore
from remote_loader.testing.synthetic import SyntheticImages
from remote_loader.upload.uploader import _ESTIMATE_SAMPLES
from tests.helpers import PausingImages, WaitingPath, the_other_task, upload

N = _ESTIMATE_SAMPLES + 36  # more than the samples measured before the prefix is claimed


def _upload(client: Any, bucket: str, folder: str, ds: Any, **options: Any) -> Any:
    return upload(client, bucket, folder, ds, maxcount=10, **options)


@contextmanager
def paused_upload(run: Callable[[int], Any]) -> Iterator[dict[str, Any]]:
    """Run ``run(port)`` on a thread until its dataset connects to ``port``; on exit, let it
    go on and wait for it. Yields what it returned or raised, once it has ended."""
    outcome: dict[str, Any] = {}
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)

    def target() -> None:
        try:
            outcome["result"] = run(listener.getsockname()[1])
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    try:
        connection, _ = listener.accept()
    except BaseException:
        listener.close()
        thread.join(60)
        raise
    try:
        yield outcome
    finally:
        connection.close()
        listener.close()
        thread.join(60)
    assert not thread.is_alive()


def _late_index(seed: int) -> int:
    """A sample written after the upload claimed its prefix (not one of the first it measures)."""
    return int(np.random.default_rng(seed).permutation(N)[_ESTIMATE_SAMPLES + 16])


def _samples(client: Any, bucket: str, folder: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for sample in DatasetReader(client, bucket, folder):
        assert sample["__key__"] not in out
        out[sample["__key__"]] = bytes(sample["jpg"])
    return out


def _objects(client: Any, bucket: str, folder: str) -> set[str]:
    return {info.key[len(folder) + 1:] for info in client.list(bucket, folder + "/")}


def test_a_second_upload_to_a_prefix_being_written_is_refused(s3):
    client, bucket = s3
    def first(port):
        return _upload(client, bucket, "d", PausingImages(N, _late_index(1), port, size=(32, 24)), seed=1)

    with paused_upload(first) as outcome:
        with pytest.raises(UploadConflict, match=f"s3://{bucket}/d holds an unfinished upload") as refused:
            _upload(client, bucket, "d", SyntheticImages(N, size=(32, 24)), seed=2)
        assert refused.value.location == f"s3://{bucket}/d"
    assert "error" not in outcome, outcome
    assert outcome["result"].samples == N
    assert len(_samples(client, bucket, "d")) == N


def test_an_upload_overtaken_by_an_overwrite_stops_and_leaves_the_winner_whole(s3):
    client, bucket = s3
    def slow(port):
        return _upload(client, bucket, "d", PausingImages(N, _late_index(1), port, size=(32, 24)), seed=1)

    with paused_upload(slow) as outcome:
        winner = _upload(client, bucket, "d", SyntheticImages(N, size=(32, 24), seed=5), seed=2, overwrite=True)
        expected = _samples(client, bucket, "d")
    assert isinstance(outcome.get("error"), UploadConflict), outcome
    assert f"s3://{bucket}/d" in str(outcome["error"])
    assert winner.samples == N and _samples(client, bucket, "d") == expected
    manifest = DatasetReader(client, bucket, "d").manifest
    names = {manifest.shards[i].name for i in range(len(manifest.shards))}
    assert _objects(client, bucket, "d") == names | {"manifest.msgpack"}  # neither one's leftovers


def test_an_upload_whose_multipart_uploads_are_aborted_while_it_writes_stops_with_a_conflict(tmp_path):
    """A second upload of the same dataset, started while the first writes, takes the first's
    run for an interrupted one, resumes it and aborts its unfinished multipart uploads (as this
    test does by hand, at a known point): the first stopped with the store's NoSuchUpload, a
    StorageError that said nothing of the other upload. The prefix is left to a re-run. A local
    store has the shard's upload under way at the pause (S3's writers start one only when a
    part is full, and an upload overtaken there stops at its switch, tested above)."""
    client, bucket = LocalStore(tmp_path), "local"
    (tmp_path / bucket).mkdir()
    # Sample 86 of the order: the 6th of its task's one shard (tasks of maxcount=10), whose
    # upload is under way with 5 samples in it while the read of the 6th is held.
    mid_shard = int(np.random.default_rng(1).permutation(N)[_ESTIMATE_SAMPLES + 21])

    def first(port):
        return _upload(client, bucket, "d", PausingImages(N, mid_shard, port, size=(32, 24)), seed=1)

    with paused_upload(first) as outcome:
        assert client.abort_uploads(bucket, "d/") >= 1  # that shard's, and any other task's under way
    assert isinstance(outcome.get("error"), UploadConflict), outcome
    said = str(outcome["error"])
    assert said.startswith(f"{outcome['error'].location}: this run's multipart uploads were aborted while it wrote")
    assert "another upload of this dataset is likely running" in said
    again = _upload(client, bucket, "d", SyntheticImages(N, size=(32, 24)), seed=1)
    assert again.samples == N and len(_samples(client, bucket, "d")) == N


_RACER = """
import socket, sys
from remote_loader import UploadConflict, UploadError, make_client, upload_cv_dataset
from remote_loader.testing.synthetic import SyntheticImages
from remote_loader.upload.uploader import _ESTIMATE_SAMPLES
endpoint, key, secret, bucket, port, seed = sys.argv[1:]
client = make_client(endpoint, key, secret)
with socket.create_connection(("127.0.0.1", int(port))) as gate:
    gate.recv(1)  # both racers start together
try:
    upload_cv_dataset(SyntheticImages(150, size=(32, 24), seed=int(seed)), client=client, bucket=bucket,
                      base_folder="race", maxcount=10, workers=0, seed=int(seed), progress=False)
    print("uploaded")
except UploadConflict as exc:
    print("conflict", exc)
except UploadError as exc:
    print("refused", exc)
"""


def test_two_processes_racing_to_one_prefix_leave_one_whole_dataset(s3, seaweed):
    client, bucket = s3
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    port = str(listener.getsockname()[1])
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, seaweed.endpoint_url, seaweed.access_key,
                                seaweed.secret_key, bucket, port, str(seed)], stdout=subprocess.PIPE, text=True)
              for seed in (1, 2)]
    try:
        gates = [listener.accept()[0] for _ in racers]
        for gate in gates:
            gate.sendall(b"go")
            gate.close()
        said = [racer.communicate(timeout=120)[0] for racer in racers]
    finally:
        listener.close()
        for racer in racers:
            racer.kill()
            racer.wait()
    assert sorted(line.split()[0] for line in said) in (["conflict", "uploaded"], ["refused", "uploaded"]), said
    assert all(f"s3://{bucket}/race" in line for line in said if not line.startswith("uploaded"))
    assert len(_samples(client, bucket, "race")) == 150
    manifest = DatasetReader(client, bucket, "race").manifest
    names = {manifest.shards[i].name for i in range(len(manifest.shards))}
    assert _objects(client, bucket, "race") == names | {"manifest.msgpack"}


def test_an_upload_to_a_prefix_does_not_abort_one_to_a_prefix_inside_it(s3):
    client, bucket = s3
    def inner(port):
        return _upload(client, bucket, "a/b", PausingImages(N, _late_index(3), port, size=(32, 24)), seed=3,
                       part_size=5 * 1024 * 1024, maxsize=64 * 1024 * 1024)

    with paused_upload(inner) as outcome:
        writer = client.open_writer(bucket, "a/b/shard-00000000-999999-000.tar", part_size=5 * 1024 * 1024)
        writer.write(b"x" * (5 * 1024 * 1024))  # a multipart upload in flight under a/b
        _upload(client, bucket, "a", SyntheticImages(N, size=(32, 24)), seed=4)
        writer.write(b"y")
        writer.commit()  # fails if the outer upload aborted it
    assert "error" not in outcome, outcome
    assert len(_samples(client, bucket, "a")) == N and len(_samples(client, bucket, "a/b")) == N


def test_two_uploads_in_one_process_on_threads_keep_their_own_samples(s3):
    client, bucket = s3
    sources: list[Any] = [None, SyntheticImages(N, size=(40, 30), seed=12)]

    def first(port: int) -> Any:
        sources[0] = PausingImages(N, _late_index(0), port, size=(32, 24), seed=11)
        return _upload(client, bucket, "p0", sources[0], seed=0)

    with paused_upload(first) as outcome:  # the first is mid-task while the second runs whole
        _upload(client, bucket, "p1", sources[1], seed=1)
    assert "error" not in outcome, outcome
    for i, source in enumerate(sources):
        got = DatasetReader(client, bucket, f"p{i}")
        stored = {int(s["__key__"]): bytes(s["jpg"]) for s in got}
        assert len(stored) == N
        assert all(stored[k] == source.encoded(k) for k in stored), f"upload {i} holds the other's samples"


class _StuckAndBad(SyntheticImages):
    """Sample ``bad``'s image is a path to no file, said once the other task hangs: the first
    item that task reads after ``ds[bad]`` returned stays connected to the test's port until it
    closes, as a task on a hung store does."""

    def __init__(self, n: int, bad: int, port: int) -> None:
        super().__init__(n, size=(32, 24))
        self.bad, self.port = bad, port
        self.bad_read_by: threading.Thread | None = None
        self.hanging = threading.Event()

    def __getitem__(self, index: int):  # type: ignore[override]
        me = threading.current_thread()
        if me.name != "remote-loader-task":  # the size estimate's and the fingerprint's reads
            return super().__getitem__(index)
        if index == self.bad:
            self.bad_read_by = me
            return WaitingPath(lambda: self.hanging.wait(60)), 0
        if self.bad_read_by not in (None, me) and not self.hanging.is_set():
            with socket.create_connection(("127.0.0.1", self.port)) as connection:
                self.hanging.set()
                connection.recv(1)
        return super().__getitem__(index)


def test_an_error_is_raised_by_the_outage_deadline_though_a_sibling_task_is_stuck(s3):
    """The tasks running beside a failed one are waited for (a re-run keeps what they
    finish), but not past RetryConfig.outage_deadline."""
    client, bucket = s3
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    ds = _StuckAndBad(N, bad=_ESTIMATE_SAMPLES + 21, port=listener.getsockname()[1])
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            _upload(client, bucket, "stuck", ds, shuffle=False, retry=RetryConfig(outage_deadline=1))
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    connection, _ = listener.accept()  # the stuck task hangs
    try:
        thread.join(60)
        assert not thread.is_alive(), "the upload waited for its stuck task past the outage deadline"
        error = outcome["error"]
        assert isinstance(error, UploadError) and error.index == _ESTIMATE_SAMPLES + 21, error
    finally:
        connection.close()
        listener.close()
        thread.join(60)


class _SharedHandle:
    """Images packed in one file and read through one open file object, a seek and then a read,
    as many record formats read theirs: not safe to call from two threads at once, as a
    DataLoader never does. Item 3, read by its task, once it has seeked, waits until the other task's thread
    is either reading too (``overlapped``: the bug) or waiting for its turn."""

    def __init__(self, path: Any, count: int) -> None:
        self.blobs = [_png(i) for i in range(count)]
        ends = np.cumsum([len(blob) for blob in self.blobs])
        self.spans = list(zip([0, *ends[:-1]], ends, strict=True))
        path.write_bytes(b"".join(self.blobs))
        self.file = path.open("rb")
        self.overlapped = False

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        start, end = self.spans[index]
        self.file.seek(int(start))
        if index == 3 and threading.current_thread().name == "remote-loader-task":  # not the size estimate's
            self.overlapped = the_other_task(threading.current_thread()) == "reading"
        return self.file.read(int(end - start)), index


def _png(value: int) -> bytes:
    from PIL import Image

    out = __import__("io").BytesIO()
    Image.new("L", (16, 16), value % 256).save(out, "PNG")
    return out.getvalue()


def test_an_upload_calls_ds_getitem_from_one_thread_at_a_time(tmp_path):
    """A process writes two tasks at once, each on a thread: ``ds[i]`` was called from both at
    once, and a dataset that reads through one file object stored some items with another
    item's bytes (5 of 400 in a trial), without a word. It is called by one thread at a time."""
    ds = _SharedHandle(tmp_path / "packed.bin", N)
    store = LocalStore(tmp_path / "store")
    store.create_bucket("b")
    with ds.file:
        upload(store, "b", "d", ds, maxcount=10, shuffle=False)
    assert not ds.overlapped
    stored = {int(sample["__key__"]): bytes(sample["jpg" if "jpg" in sample else "png"])
              for sample in DatasetReader(store, "b", "d")}
    assert [stored[i] == ds.blobs[i] for i in range(N)] == [True] * N
