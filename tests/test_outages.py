"""Storage that goes away: a server killed and restarted, a server that hangs (SIGSTOP),
Ctrl-C while waiting on it. Every sample arrives exactly once, or a clear error comes
within the outage deadline; closing never waits on a hung request."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import pytest
from torch.utils.data import DataLoader

from remote_loader import (
    DatasetReader,
    EndpointUnreachable,
    FetchConfig,
    RemoteDataset,
    RemoteMapDataset,
    RetryConfig,
    StorageConfig,
    make_client,
)
from remote_loader.format import pages as paging
from remote_loader.testing.server import EmbeddedS3
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload

N = 1200
# Small ranges and a small budget: most of the epoch is still to be fetched when the server goes away.
SLOW_FETCH = dict(part_size=32 * 1024, range_bytes=32 * 1024, prefetch_bytes=64 * 1024, concurrency=2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of this module's own: its tests kill and stop it."""
    server = EmbeddedS3(data_dir=str(tmp_path_factory.mktemp("outage-s3")), buckets=["outages"])
    server.start()
    client = server.client()
    upload(client, "outages", "d", SyntheticImages(N, size=(64, 48)), maxcount=60)
    client.close()
    yield server
    if server.pid is not None:
        os.killpg(server.pid, signal.SIGCONT)
    server.stop()


def _client(server, read_timeout=20.0):
    return make_client(config=StorageConfig(endpoint_url=server.endpoint_url, access_key=server.access_key,
                                            secret_key=server.secret_key, read_timeout=read_timeout))


def _loader_threads(before=frozenset()):
    """Loader threads that were not there ``before`` (other tests' threads may still be ending)."""
    return [t.name for t in set(threading.enumerate()) - before if t.name.startswith("remote-loader-")]


def _wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling for threads to end, not synchronising on time
    return True


@pytest.mark.parametrize("workers", [0, 2])
def test_server_killed_and_restarted_mid_epoch_loses_nothing(server, workers, caplog):
    dataset = RemoteDataset(_client(server), "outages", "d", fetch=FetchConfig(**SLOW_FETCH), seed=workers)
    keys = []
    restart = None
    failures: list[BaseException] = []

    def start_again() -> None:
        try:
            server.start()
        except BaseException as exc:  # reported by the test, not lost in a thread
            failures.append(exc)

    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        for sample in DataLoader(dataset, batch_size=None, num_workers=workers):
            keys.append(sample["__key__"])
            if len(keys) == 200:
                server.kill()
                restart = threading.Timer(3.0, start_again)  # a 3 s outage, then the same port and data
                restart.start()
    assert restart is not None
    restart.join()
    assert not failures
    assert Counter(keys) == Counter(f"{i:06d}" for i in range(N))
    if workers == 0:  # log records of worker processes do not reach caplog
        messages = [r.getMessage() for r in caplog.records]
        assert any("is failing" in m for m in messages) and any("answers again" in m for m in messages), messages


def test_manifest_pages_are_read_through_a_server_restart(server, monkeypatch):
    """A dataset whose manifest keeps its pages apart, opened from its head; the server is
    killed before any page is read and comes back 3 s later: the pages' GETs are retried."""
    monkeypatch.setattr(paging, "PAGE_ROWS", 4)
    monkeypatch.setattr(paging, "INLINE_BYTES", 0)
    client = _client(server)
    upload(client, "outages", "paged", SyntheticImages(240, size=(16, 12)), maxcount=12)  # 20 shards, 5 pages
    mapped = RemoteMapDataset(client, "outages", "paged")  # its head only
    failures: list[BaseException] = []

    def start_again() -> None:
        try:
            server.start()
        except BaseException as exc:  # reported by the test, not lost in a thread
            failures.append(exc)

    server.kill()
    restart = threading.Timer(3.0, start_again)  # a 3 s outage, then the same port and data
    restart.start()
    try:
        keys = [mapped[i]["__key__"] for i in range(0, 240, 12)]  # a sample of every shard: every page
    finally:
        restart.join()
    assert not failures
    assert len(set(keys)) == 20 and mapped.reader.manifest.shards.pages_read == 5


def test_server_killed_as_a_shard_completes_beside_encoding_loses_nothing(server):
    """A task's shard is completed on a thread while the process's other task encodes. The
    server is killed just as the first shard's upload is being completed and comes back 3 s
    later: the tasks that failed are written again, and the dataset holds every sample once,
    byte-identical, with no multipart upload of the failed attempts left unfinished."""
    client = _client(server)
    ds = SyntheticImages(240)  # ~110 KB each: a shard of 60 is a 5 MiB part and a tail
    killed, failures, restart = threading.Event(), [], []
    open_writer = client.open_writer

    def start_again() -> None:
        try:
            server.start()
        except BaseException as exc:  # reported by the test, not lost in a thread
            failures.append(exc)

    def killing_at_completion(bucket, key, *, part_size):
        writer = open_writer(bucket, key, part_size=part_size)
        complete = writer._complete

        def kill_then_complete() -> None:
            if not killed.is_set():
                killed.set()
                server.kill()
                restart.append(threading.Timer(3.0, start_again))  # a 3 s outage, then the same port and data
                restart[0].start()
            complete()

        writer._complete = kill_then_complete
        return writer

    client.open_writer = killing_at_completion
    summary = upload(client, "outages", "killed-at-completion", ds, maxcount=60, part_size=5 * 1024 * 1024)
    restart[0].join()
    assert killed.is_set() and not failures
    assert (summary.samples, summary.shards) == (240, 4)
    seen = Counter()
    for sample in DatasetReader(client, "outages", "killed-at-completion"):
        index = int(sample["__key__"])
        seen[index] += 1
        assert (bytes(sample["jpg"]), int(bytes(sample["cls"]))) == ds[index]
    assert seen == Counter(range(240))
    unfinished = client._sdk().list_multipart_uploads(Bucket="outages", Prefix="killed-at-completion/")
    assert unfinished.get("Uploads", []) == []
    # No "is failing" notice is asked for: on a loaded machine the task encoding again may take
    # longer than the outage, and no request then fails for the second a notice needs (the
    # notice has a test of its own above).


def test_hung_server_gives_endpoint_unreachable_within_the_deadline(server):
    before = frozenset(threading.enumerate())
    dataset = RemoteDataset(_client(server, read_timeout=2), "outages", "d",
                            fetch=FetchConfig(**SLOW_FETCH, retry=RetryConfig(outage_deadline=10)))
    stream = iter(dataset)
    for _ in range(100):
        next(stream)
    os.killpg(server.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        with pytest.raises(EndpointUnreachable) as caught:
            for _ in stream:
                pass
        waited = time.monotonic() - stopped
    finally:
        os.killpg(server.pid, signal.SIGCONT)
    # The deadline and one read timeout, with as much again for a loaded machine: without the deadline
    # (RetryConfig's default: 300 s) it would go on far longer.
    assert waited < 2 * (10 + 2), waited
    print(f"\nSIGSTOP to EndpointUnreachable (outage_deadline=10, read_timeout=2): {waited:.1f} s")
    assert server.endpoint_url in str(caught.value) and "outage_deadline" in str(caught.value)
    assert _wait_for(lambda: not _loader_threads(before), 10), _loader_threads(before)


def test_the_outage_deadline_of_the_environment_holds_through_the_python_api(server, monkeypatch):
    monkeypatch.setenv("REMOTE_LOADER_OUTAGE_DEADLINE", "3")
    dataset = RemoteDataset(_client(server, read_timeout=2), "outages", "d", fetch=FetchConfig(**SLOW_FETCH))
    assert dataset.fetch.retry.outage_deadline == 3  # as the CLI reads it (it was read by the CLI only)
    stream = iter(dataset)
    for _ in range(100):
        next(stream)
    os.killpg(server.pid, signal.SIGSTOP)
    try:
        with pytest.raises(EndpointUnreachable, match=r"gave up at RetryConfig.outage_deadline=3 s"):
            for _ in stream:
                pass
    finally:
        os.killpg(server.pid, signal.SIGCONT)


def test_closing_an_iterator_on_a_hung_server_returns_at_once(server):
    """``close()`` does not wait for the GETs in flight: they time out after 600 s, and the
    close is given 60."""
    before = frozenset(threading.enumerate())
    dataset = RemoteDataset(_client(server, read_timeout=600), "outages", "d", fetch=FetchConfig(**SLOW_FETCH))
    stream = iter(dataset)
    for _ in range(100):
        next(stream)
    os.killpg(server.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        closer = threading.Thread(target=stream.close, daemon=True)
        closer.start()
        closer.join(60)
        closing = time.monotonic() - started
    finally:
        os.killpg(server.pid, signal.SIGCONT)
    assert not closer.is_alive(), "close() waited for the hung GETs"
    print(f"\nclosing the iterator on a hung server: {closing:.2f} s")
    # Threads that were stuck in a GET end once it returns: none is left behind.
    assert _wait_for(lambda: not _loader_threads(before), 15), _loader_threads(before)


_CTRL_C = textwrap.dedent("""
    import sys
    from remote_loader import FetchConfig, RemoteDataset, StorageConfig, make_client
    endpoint, key, secret = sys.argv[1:4]
    client = make_client(config=StorageConfig(endpoint_url=endpoint, access_key=key, secret_key=secret,
                                                connect_timeout=600, read_timeout=600))
    fetch = FetchConfig(part_size=32768, range_bytes=32768, prefetch_bytes=65536, concurrency=2)
    stream = iter(RemoteDataset(client, "outages", "d", fetch=fetch))
    for _ in range(100):
        next(stream)
    try:
        # Inside the try: a Ctrl-C that lands as soon as the line is out is caught too.
        print("streaming", flush=True)
        for _ in stream:
            pass
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise
""")


def _ctrl_c_while_the_server_hangs(server, script: str, ready: str, *args: str, itself: bool = False) -> float:
    """Run ``script``; once it prints ``ready``, stop the server and press Ctrl-C (or, if the
    script interrupts ``itself``, tell it on stdin that the server is stopped): the seconds
    until the process has ended with KeyboardInterrupt. The scripts' requests time out after
    600 s, so a process that waited for one would not end within the 120 s given here, however
    loaded the machine."""
    process = subprocess.Popen([sys.executable, "-c", script, server.endpoint_url, server.access_key, server.secret_key,
                                *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout is not None and process.stdin is not None
        assert process.stdout.readline().strip() == ready
        os.killpg(server.pid, signal.SIGSTOP)
        if itself:
            process.stdin.write("stopped\n")
            process.stdin.flush()
        else:
            process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, err = process.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        os.killpg(server.pid, signal.SIGCONT)
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "interrupted" in out and "KeyboardInterrupt" in err, err[-2000:]
    return took


def test_ctrl_c_gets_through_while_the_server_hangs(server):
    took = _ctrl_c_while_the_server_hangs(server, _CTRL_C, "streaming")
    print(f"\nCtrl-C to exit: {took:.2f} s")


_CTRL_C_UPLOAD = textwrap.dedent("""
    import sys
    from remote_loader import StorageConfig, make_client, upload_cv_dataset
    from remote_loader.testing.synthetic import SyntheticImages
    endpoint, key, secret = sys.argv[1:4]

    class Telling(SyntheticImages):
        def __getitem__(self, index):
            if index == 150:  # ~16 MB encoded: parts are on their way
                print("uploading", flush=True)
            return super().__getitem__(index)

    client = make_client(config=StorageConfig(endpoint_url=endpoint, access_key=key, secret_key=secret,
                                                connect_timeout=600, read_timeout=600))
    try:
        upload_cv_dataset(Telling(2000), client=client, bucket="outages", base_folder="ctrl-c-upload", workers=0,
                          part_size=5 * 1024 * 1024, progress=False)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise
""")


def test_ctrl_c_gets_through_an_upload_whose_parts_hang(server):
    """Parts go out on the writer's threads: a Ctrl-C while they hang on a stopped server
    ends the process at once (the next upload of that prefix aborts what was left)."""
    took = _ctrl_c_while_the_server_hangs(server, _CTRL_C_UPLOAD, "uploading")
    print(f"\nCtrl-C to exit, parts in flight: {took:.2f} s")


_INTERRUPT = textwrap.dedent("""
    import os, signal, sys, threading

    def interrupt_once_waiting_in(name, innermost=None):
        # SIGINT to this process once the main thread is inside ``name`` (and, if given, in ``innermost``).
        def waiting():
            frame = sys._current_frames().get(threading.main_thread().ident)
            if frame is None or innermost is not None and frame.f_code.co_name != innermost:
                return False
            while frame is not None and frame.f_code.co_name != name:
                frame = frame.f_back
            return frame is not None

        def watch():
            while not waiting():
                threading.Event().wait(0.01)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=watch, daemon=True).start()
""")

_CTRL_C_WRITER = _INTERRUPT + textwrap.dedent("""
    from remote_loader import StorageConfig, make_client
    endpoint, key, secret, where = sys.argv[1:5]
    client = make_client(config=StorageConfig(endpoint_url=endpoint, access_key=key, secret_key=secret,
                                                connect_timeout=600, read_timeout=600))
    part = 5 * 1024 * 1024
    try:
        with client.open_writer("outages", "ctrl-c-writer", part_size=part) as writer:
            writer.write(os.urandom(part + 1))  # the upload is being created, part 1 on its way after it
            print("writing", flush=True)
            sys.stdin.readline()  # the server is stopped now
            # The writer waits for the oldest of PARTS_IN_FLIGHT hung parts before sending another.
            interrupt_once_waiting_in("_sent")
            if where == "write":
                writer.write(os.urandom(8 * part))  # blocks once PARTS_IN_FLIGHT parts hang
            else:
                writer.write(os.urandom(3 * part))  # PARTS_IN_FLIGHT parts on their way; commit waits for them
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise
""")


@pytest.mark.parametrize("where", ["write", "commit"])
def test_ctrl_c_gets_through_a_writer_waiting_for_hung_parts(server, where):
    """The caller waits for a part to finish before sending another, and commit for all of
    them; Ctrl-C there returns at once instead of waiting for the parts, then for the abort."""
    took = _ctrl_c_while_the_server_hangs(server, _CTRL_C_WRITER, "writing", where, itself=True)
    print(f"\nCtrl-C while {where} waits for hung parts, to exit: {took:.2f} s")


_CTRL_C_WAITING_IN = _INTERRUPT + textwrap.dedent("""
    from remote_loader import RemoteMapDataset, RetryConfig, StorageConfig, make_client
    from remote_loader.storage.retrying import Retry, RetryingStore
    from remote_loader.upload import claim
    endpoint, key, secret, where = sys.argv[1:5]
    client = make_client(config=StorageConfig(endpoint_url=endpoint, access_key=key, secret_key=secret,
                                                connect_timeout=600, read_timeout=600))
    if where == "__getitems__":
        ds = RemoteMapDataset(client, "outages", "d")
        call = lambda: ds.__getitems__(list(range(0, len(ds), 3)))  # every index cold: GETs on the batch's threads
    else:
        keys = [f"ctrl-c-delete/{i}" for i in range(40)]
        for k in keys:
            client.put("outages", k, b"x")
        store = RetryingStore(client, Retry(RetryConfig(), client.endpoint))
        call = lambda: claim.delete_all(store, "outages", keys)  # an upload's clean-up

    try:
        print("ready", flush=True)
        sys.stdin.readline()  # the server is stopped now
        interrupt_once_waiting_in(where, "wait")  # threading's wait, for the requests on threads
        call()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise
""")


@pytest.mark.parametrize("where", ["__getitems__", "delete_all"])
def test_ctrl_c_gets_through_requests_on_a_batchs_threads(server, where):
    """A map-style batch and an upload's clean-up send their requests on threads; Ctrl-C
    while those hang on a stopped server ends the process at once."""
    took = _ctrl_c_while_the_server_hangs(server, _CTRL_C_WAITING_IN, "ready", where, itself=True)
    print(f"\nCtrl-C while {where} waits for hung requests, to exit: {took:.2f} s")
