"""Uploads on a real dask.distributed cluster: a LocalCluster of 2 worker processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from remote_loader import ConfigError, DatasetReader, ImageFolder, LocalStore, UploadError, upload_cv_dataset
from tests import helpers

distributed = pytest.importorskip("distributed")
dask = pytest.importorskip("dask")

ROOT = Path(__file__).resolve().parents[2]


def start_cluster() -> tuple[object, object, list[int]]:
    # The scheduler's HTTP server binds a free loopback port; the dashboard is off.
    # Dask's memory manager drops extra replicas of data every 2 s by default; every 50 ms here,
    # so an upload whose dataset travelled as data would see it dropped and sent again.
    with dask.config.set({"distributed.scheduler.active-memory-manager.interval": "50ms"}):
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                           protocol="tcp://", dashboard_address="127.0.0.1:0",
                                           scheduler_kwargs={"dashboard": False})
    client = distributed.Client(cluster)
    pids = [pid for pid in client.run(os.getpid).values()]
    return cluster, client, pids


def stop_cluster(cluster, client, pids: list[int]) -> None:
    client.close()
    cluster.close()
    for pid in pids:  # every worker process ends, whatever the cluster did
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def dask_client() -> Iterator[object]:
    cluster, client, pids = start_cluster()
    yield client
    stop_cluster(cluster, client, pids)


def read_back(client, bucket, folder) -> dict[int, tuple[bytes, int]]:
    got: dict[int, tuple[bytes, int]] = {}
    for sample in DatasetReader(client, bucket, folder):
        index = int(sample["__key__"])
        assert index not in got, f"sample {index} stored twice"
        got[index] = (bytes(sample["jpg"]), int(bytes(sample["cls"])))
    return got


def test_round_trip_with_the_dataset_sent_once_per_worker(dask_client, s3):
    store, bucket = s3
    ds = helpers.CountedImages(400, num_classes=5, size=(64, 48))
    summary = upload_cv_dataset(ds, client=store, bucket=bucket, base_folder="d", maxcount=25,
                                executor=dask_client.get_executor(), progress=False)
    assert summary.samples == 400 and summary.shards >= 8
    assert read_back(store, bucket, "d") == {i: ds[i] for i in range(400)}
    # 16+ tasks ran on 2 workers; each worker unpickled the dataset at most once.
    assert all(n <= 1 for n in dask_client.run(helpers.unpickled_count).values())


def test_a_source_spec_is_built_once_on_each_worker_and_matches_the_local_pool(dask_client, s3):
    store, bucket = s3
    before = dask_client.run(helpers.small_images_count)
    summary = upload_cv_dataset("tests.helpers:small_images", client=store, bucket=bucket, base_folder="spec",
                                maxcount=30, executor=dask_client.get_executor(), progress=False)
    local = upload_cv_dataset(helpers.small_images(), client=store, bucket=bucket, base_folder="local",
                              maxcount=30, workers=2, progress=False)
    assert summary.samples == local.samples == 300
    assert read_back(store, bucket, "spec") == read_back(store, bucket, "local")
    after = dask_client.run(helpers.small_images_count)
    built = [after[worker] - before.get(worker, 0) for worker in after]
    assert set(built) <= {0, 1} and sum(built) >= 1  # built from the spec on the workers, once each


def test_skip_bad_samples_on_the_cluster(dask_client, s3):
    store, bucket = s3
    ds = helpers.FlakyImages(120, bad={3, 77}, size=(32, 32))
    summary = upload_cv_dataset(ds, client=store, bucket=bucket, base_folder="skip", maxcount=20, on_error="skip",
                                executor=dask_client.get_executor(), progress=False)
    assert summary.skipped == 2 and summary.samples == 118
    manifest = DatasetReader(store, bucket, "skip").manifest
    assert sorted(manifest.skipped_indices) == [3, 77]
    assert set(read_back(store, bucket, "skip")) == set(range(120)) - {3, 77}


def test_a_bad_sample_fails_the_dask_upload_naming_it_and_writes_no_manifest(dask_client, s3):
    store, bucket = s3
    with pytest.raises(UploadError, match="sample 5"):
        upload_cv_dataset(helpers.FlakyImages(60, bad={5}, size=(32, 32)), client=store, bucket=bucket,
                          base_folder="bad", maxcount=20, executor=dask_client.get_executor(), progress=False)
    assert not DatasetReader(store, bucket, "bad").has_manifest()


def test_resumes_after_its_cluster_is_closed_mid_upload(s3):
    store, bucket = s3
    n = 240
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(120)
    port = listener.getsockname()[1]
    cluster, client, pids = start_cluster()
    failure: list[BaseException] = []

    def upload() -> None:
        try:
            upload_cv_dataset(helpers.BlockingImages(n, n - 1, port, size=(32, 32)), client=store, bucket=bucket,
                              base_folder="r", maxcount=20, shuffle=False, executor=client.get_executor(),
                              progress=False)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            failure.append(exc)

    thread = threading.Thread(target=upload)
    try:
        thread.start()
        connection, _ = listener.accept()  # the last task reached its last sample
        stop_cluster(cluster, client, pids)
        thread.join(60)
        connection.close()
    finally:
        listener.close()
    assert not thread.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], UploadError), failure
    assert "run the same upload again" in str(failure[0])
    assert not DatasetReader(store, bucket, "r").has_manifest()  # written last, so not yet

    cluster, client, pids = start_cluster()
    try:
        ds = helpers.BlockingImages(n, None, port, size=(32, 32))
        summary = upload_cv_dataset(ds, client=store, bucket=bucket, base_folder="r", maxcount=20, shuffle=False,
                                    executor=client.get_executor(), progress=False)
    finally:
        stop_cluster(cluster, client, pids)
    assert summary.kept_shards >= 1 and summary.samples == n
    assert read_back(store, bucket, "r") == {i: ds[i] for i in range(n)}


def test_cli_upload_on_a_dask_scheduler(dask_client, seaweed, s3):
    store, bucket = s3
    env = {**os.environ, **seaweed.env(), "PYTHONPATH": str(ROOT)}
    address = dask_client.scheduler.address
    result = subprocess.run([sys.executable, "-m", "remote_loader.cli", "upload", "--dask", address, "--json",
                             "--maxcount", "50", "tests.helpers:small_images", f"s3://{bucket}/cli"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["samples"] == 300
    assert read_back(store, bucket, "cli") == {i: helpers.small_images()[i] for i in range(300)}


def test_cli_names_an_unreachable_scheduler(seaweed, s3):
    _, bucket = s3
    with socket.create_server(("127.0.0.1", 0)) as unused:
        port = unused.getsockname()[1]
    env = {**os.environ, **seaweed.env(), "PYTHONPATH": str(ROOT), "REMOTE_LOADER_FIRST_CONTACT_DEADLINE": "2"}
    result = subprocess.run([sys.executable, "-m", "remote_loader.cli", "upload", "--dask", f"tcp://127.0.0.1:{port}",
                             "tests.helpers:small_images", f"s3://{bucket}/x"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode != 0
    assert f"cannot reach the Dask scheduler at tcp://127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_failed_dask_upload_runs_again_on_the_same_client(dask_client, s3):
    store, bucket = s3
    run = dict(client=store, bucket=bucket, base_folder="again", maxcount=20, executor=dask_client.get_executor(),
               progress=False)
    Path(helpers.FLAKY_MARK).touch()
    try:
        with pytest.raises(UploadError, match="sample 5"):
            upload_cv_dataset("tests.helpers:marked_images", **run)
    finally:
        Path(helpers.FLAKY_MARK).unlink()
    # The same arguments again: before, Dask named the tasks by them and handed back the failures.
    summary = upload_cv_dataset("tests.helpers:marked_images", **run)
    assert summary.samples == 60 and len(read_back(store, bucket, "again")) == 60


def test_a_rerun_on_the_cluster_reads_every_kept_item_there(dask_client, s3):
    """The kept items are read again on the cluster's workers; item 3 turned into bytes no
    image reader takes, which the sampled fingerprint lets pass (an item that cannot be
    encoded matches any), is caught by its digest."""
    store, bucket = s3
    args = dict(client=store, bucket=bucket, base_folder="again", maxcount=20, executor=dask_client.get_executor(),
                progress=False)
    upload_cv_dataset(helpers.FlakyImages(120, bad=set(), size=(32, 32)), **args)
    again = upload_cv_dataset(helpers.FlakyImages(120, bad=set(), size=(32, 32)), **args)
    assert (again.uploaded_samples, again.compared) == (0, 120)
    with pytest.raises(UploadError, match=r"but ds\[3\] is not the item uploaded from it"):
        upload_cv_dataset(helpers.FlakyImages(120, bad={3}, size=(32, 32)), **args)


def draw_folder(folder: Path, n: int, shade: int) -> None:
    """An image folder of ``n`` small JPEGs in classes ``a`` and ``b``, image ``i`` filled with ``shade + i``."""
    for i in range(n):
        os.makedirs(folder / "ab"[i % 2], exist_ok=True)
        Image.fromarray(np.full((8, 8, 3), shade + i, np.uint8)).save(folder / "ab"[i % 2] / f"{i:03d}.jpg")


def stored_items(store: LocalStore, bucket: str, prefix: str) -> dict[int, tuple[bytes, int]]:
    return {int(sample["__key__"]): (bytes(sample["jpg"]), int(bytes(sample["cls"])))
            for sample in DatasetReader(store, bucket, prefix)}


def folder_items(folder: Path) -> dict[int, tuple[bytes, int]]:
    return {i: (Path(path).read_bytes(), label) for i, (path, label) in enumerate(ImageFolder(folder).samples)}


def test_each_upload_of_a_source_spec_builds_it_again_on_the_workers(dask_client, tmp_path):
    """A folder changed between two uploads on one cluster is read anew by its workers. They
    kept the first upload's dataset for good: overwrite=True wrote its labels again, and a
    folder that grew failed with ds[n] raising IndexError."""
    folder, store = tmp_path / "folder", LocalStore(tmp_path / "store")
    store.create_bucket("b")
    run = dict(client=store, bucket="b", base_folder="f", maxcount=5, executor=dask_client.get_executor(),
               progress=False)
    draw_folder(folder, 20, 0)
    upload_cv_dataset(str(folder), **run)
    assert stored_items(store, "b", "f") == folder_items(folder)

    os.mkdir(folder / "0")  # a class sorted first, empty so far: every label is one more
    upload_cv_dataset(str(folder), overwrite=True, **run)
    assert stored_items(store, "b", "f") == folder_items(folder)
    assert {label for _, label in stored_items(store, "b", "f").values()} == {1, 2}

    draw_folder(folder, 26, 100)  # every image redrawn, and 6 more
    summary = upload_cv_dataset(str(folder), overwrite=True, **run)
    assert summary.samples == 26 and stored_items(store, "b", "f") == folder_items(folder)
    again = upload_cv_dataset(str(folder), **run)  # unchanged now: kept, every item read again on the workers
    assert (again.uploaded_samples, again.compared) == (0, 26)


def test_a_dask_client_passed_as_the_executor_is_refused(dask_client, tmp_path):
    store = LocalStore(tmp_path)
    store.create_bucket("b")
    with pytest.raises(ConfigError, match=r"executor=.*Client.*client\.get_executor\(\)"):
        upload_cv_dataset(helpers.FlakyImages(10, bad=set(), size=(8, 8)), client=store, bucket="b",
                          base_folder="c", executor=dask_client, progress=False)
    assert not DatasetReader(store, "b", "c").has_manifest()
