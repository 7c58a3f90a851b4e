"""The storage contract, run over every backend against real servers (no mocked client calls)."""

from __future__ import annotations

import ast
import inspect
import os
import pickle
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

import numpy as np
import pytest

from remote_loader import (
    AccessDenied,
    BucketNotFound,
    ConfigError,
    EndpointUnreachable,
    InvalidRange,
    ObjectNotFound,
    PreconditionFailed,
    StorageConfig,
    StorageError,
    TransientStorageError,
    make_client,
)
from remote_loader.storage import MinioStore, parse_location, s3_minio
from remote_loader.storage.base import BUCKET_NAME_RULE, check_answer, error_for
from remote_loader.storage.writer import PARTS_IN_FLIGHT
from tests.conftest import new_bucket
from tests.faultproxy import FaultProxy
from tests.tlsproxy import TLSProxy, self_signed_certificate

MiB = 1024 * 1024


def test_put_get_head_and_ranges(store):
    client, bucket, _ = store
    data = os.urandom(100_000)
    client.put(bucket, "a/obj.bin", data)
    assert client.get(bucket, "a/obj.bin") == data
    assert client.head(bucket, "a/obj.bin") == len(data)
    assert client.get_range(bucket, "a/obj.bin", 0, 1) == data[:1]
    assert client.get_range(bucket, "a/obj.bin", 4_321, 65_432) == data[4_321:65_432]
    assert client.get_range(bucket, "a/obj.bin", 99_999, 100_000) == data[-1:]
    assert client.get_range(bucket, "a/obj.bin", 10, 10) == b""
    into = bytearray(61_111)
    client.get_range_into(bucket, "a/obj.bin", 4_321, 65_432, memoryview(into))
    assert into == data[4_321:65_432]
    assert client.get_first_bytes(bucket, "a/obj.bin", 777) == (data[:777], len(data))
    assert client.get_first_bytes(bucket, "a/obj.bin", 200_000) == (data, len(data))
    assert client.exists(bucket, "a/obj.bin") and not client.exists(bucket, "a/other")


@pytest.mark.parametrize("start, end", [(1.5, 3), (True, 3), (1, 3.0), ("1", 3), (-1, 3)])
def test_a_byte_range_that_is_no_pair_of_offsets_is_refused_before_any_request(store, start, end):
    """A float was sent as 'Range: bytes=1.5-2', True read from byte 1."""
    client, bucket, _ = store
    key = "contract/bounds"
    client.put(bucket, key, b"0123456789")
    out = memoryview(bytearray(2))
    for call in (lambda: client.get_range(bucket, key, start, end),
                 lambda: client.get_range_and_size(bucket, key, start, end),
                 lambda: client.get_range_into(bucket, key, start, end, out)):
        with pytest.raises((TypeError, ValueError), match="byte range's (start|end)"):
            call()
    assert client.get_range(bucket, key, np.int64(1), np.int32(3)) == b"12"  # numpy's integers are offsets


def test_a_range_is_received_into_its_buffer_without_a_temporary_copy(store):
    """An 8 MiB temporary per ranged GET stays in a thread's malloc arena once freed: the
    fetcher's 16 threads held ~100 MB that way. A range goes straight into the caller's
    buffer (the servers run in processes of their own: only this process is traced)."""
    client, bucket, _ = store
    data = os.urandom(8 * MiB)
    client.put(bucket, "big", data)
    out = bytearray(6 * MiB)
    client.get_range_into(bucket, "big", 0, 1, memoryview(out)[:1])  # the client made, its models loaded
    tracemalloc.start()
    try:
        for start in (0, MiB, 2 * MiB):
            client.get_range_into(bucket, "big", start, start + len(out), memoryview(out))
            assert out == memoryview(data)[start:start + len(out)]  # a view: no copy to trace
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MiB, f"{peak:,} bytes allocated to receive {len(out):,}"


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_ranges_received_into_buffers_leave_their_connection_for_the_next_request(seaweed, backend):
    """A body read past the SDK's own reads hands its connection back to the pool once read
    whole: one connection serves every GET in turn. One cut short is an outage to retry."""
    proxy = FaultProxy(seaweed.endpoint_url, {})
    try:
        client = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key, backend=backend)
        bucket = new_bucket(client)
        data = os.urandom(3 * MiB)
        client.put(bucket, "obj", data)
        out = bytearray(MiB)
        opened = proxy.connections
        for start in range(0, 3 * MiB, MiB // 2):
            end = min(start + MiB, 3 * MiB)
            client.get_range_into(bucket, "obj", start, end, memoryview(out)[: end - start])
            assert out[: end - start] == data[start:end]
        assert client.get(bucket, "obj") == data
        assert proxy.connections == opened, "a GET opened a connection of its own"
        proxy.rates = {"truncate": 1.0}
        with pytest.raises(TransientStorageError):
            client.get_range_into(bucket, "obj", 0, MiB, memoryview(out))
        client.close()
    finally:
        proxy.close()


def test_ranges_over_https_are_received_into_their_buffers_on_one_connection(seaweed, tmp_path, monkeypatch):
    """AWS S3 speaks HTTPS: a range read past the SDK's own reads comes through TLS whole,
    byte-identical, and its connection serves the next GET."""
    made = self_signed_certificate(tmp_path)
    if made is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = made
    proxy = TLSProxy(int(seaweed.endpoint_url.rsplit(":", 1)[1]), cert, key)
    try:
        monkeypatch.setenv("AWS_CA_BUNDLE", str(cert))  # botocore's own setting for a private CA
        client = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
        bucket = new_bucket(client)
        data = os.urandom(12 * MiB)
        client.put(bucket, "obj", data)
        opened = proxy.connections
        for start in range(0, 12 * MiB, 3 * MiB + 17):
            end = min(start + 5 * MiB, 12 * MiB)
            out = bytearray(end - start)
            client.get_range_into(bucket, "obj", start, end, memoryview(out))
            assert out == data[start:end], f"bytes {start}-{end} differ"
        assert proxy.connections == opened, "a GET opened a connection of its own"
        client.close()
    finally:
        proxy.close()


@pytest.mark.parametrize(("content_range", "start"), [
    ("bytes 1000-1099/25600", 1000), ("Bytes 1000-1099/*", 1000), ("bytes  0-99/100", 0), (None, 0),
])
def test_an_answer_is_taken_when_it_starts_where_the_range_does(content_range, start):
    check_answer("bkt", "obj", start, start + 100, content_range)  # the unit is case-insensitive (RFC 9110)


@pytest.mark.parametrize(("content_range", "answered"), [
    (None, "the whole object"),
    ("bytes 0-99/25600", "Content-Range 'bytes 0-99/25600'"),
    ("bytes 10000-10099/25600", "Content-Range 'bytes 10000-10099/25600'"),
    ("items 1000-1099/25600", "Content-Range 'items 1000-1099/25600'"),
    ("bytes 0-99\n" + "x" * 500, "Content-Range 'bytes 0-99\\n" + "x" * 69 + "'"),  # at most 80 characters of it
])
def test_an_answer_that_starts_elsewhere_is_refused_in_one_line(content_range, answered):
    with pytest.raises(StorageError) as caught:
        check_answer("bkt", "obj", 1000, 1100, content_range)
    message = str(caught.value).splitlines()[0]
    assert message == (f"s3://bkt/obj: a GET of bytes 1000-1099 was answered with {answered}: the server, or a proxy"
                       " before it, ignores HTTP Range requests, which reading a dataset needs")
    assert caught.value.code == "RangeIgnored"


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_a_server_that_ignores_range_is_named_and_its_bytes_never_stand_for_the_range(moto, backend):
    """A server, or a proxy, may answer a ranged GET with the whole object (HTTP allows it).
    Its bytes from byte 0 must never be taken for a range that starts later; what the whole
    object does hold (a range from byte 0, the tail, the first bytes) is taken from it.
    moto checks no signature, so the proxy can drop the Range header on the way."""
    target = moto.target
    assert not target.checks_signatures
    client = make_client(target.endpoint_url, target.access_key, target.secret_key, backend=backend)
    bucket = new_bucket(client)
    data = bytes(range(256)) * 100
    client.put(bucket, "obj", data)
    proxy = FaultProxy(target.endpoint_url, {"ignore_range": 1.0})
    try:
        through = make_client(proxy.endpoint_url, target.access_key, target.secret_key, backend=backend)
        out = bytearray(100)
        reads = {
            "get_range": lambda: through.get_range(bucket, "obj", 1000, 1100),
            "get_range_into": lambda: through.get_range_into(bucket, "obj", 1000, 1100, memoryview(out)),
            "get_range_and_size": lambda: through.get_range_and_size(bucket, "obj", 1000, 1100),
        }
        for name, read in reads.items():
            with pytest.raises(StorageError, match=r"obj: a GET of bytes 1000-1099 was answered with the whole object"
                                                   r": .* ignores HTTP Range requests") as caught:
                read()
            error = caught.value
            assert (error.code, error.key, type(error)) == ("RangeIgnored", "obj", StorageError), name
        assert out == bytearray(100), "the object's first bytes were written where bytes 1000-1099 belong"
        assert through.get_range(bucket, "obj", 0, 100) == data[:100]
        through.get_range_into(bucket, "obj", 0, 100, memoryview(out))
        assert out == data[:100]
        assert through.get_range_and_size(bucket, "obj", 0, 100) == (data[:100], len(data))
        assert through.get_first_bytes(bucket, "obj", 100) == (data[:100], len(data))
        assert proxy.injected["ignore_range"] >= 7
        through.close()
    finally:
        proxy.close()
        client.close()


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_a_body_that_stops_coming_is_a_read_timeout_to_retry(seaweed, backend):
    """A server that stops sending half-way through a range: the read times out after
    ``read_timeout`` as an outage to retry, not an error of another kind."""
    proxy = FaultProxy(seaweed.endpoint_url, {}, delay=60)
    try:
        config = StorageConfig(endpoint_url=proxy.endpoint_url, access_key=seaweed.access_key,
                               secret_key=seaweed.secret_key, read_timeout=0.5)
        client = make_client(backend=backend, config=config)
        bucket = new_bucket(client)
        client.put(bucket, "obj", os.urandom(MiB))
        proxy.rates = {"stall_mid_body": 1.0}
        with pytest.raises(TransientStorageError, match="Timeout"):
            client.get_range_into(bucket, "obj", 0, MiB, memoryview(bytearray(MiB)))
        client.close()
    finally:
        proxy.close()


def test_the_first_bytes_come_with_the_objects_size(store):
    client, bucket, _ = store
    data = os.urandom(100_000)
    client.put(bucket, "a/obj.bin", data)
    client.put(bucket, "a/empty", b"")
    assert client.get_first_bytes(bucket, "a/obj.bin", 777) == (data[:777], len(data))
    assert client.get_first_bytes(bucket, "a/obj.bin", 100_000) == (data, len(data))
    assert client.get_first_bytes(bucket, "a/obj.bin", 200_000) == (data, len(data))
    assert client.get_first_bytes(bucket, "a/obj.bin", 0) == (b"", len(data))
    assert client.get_first_bytes(bucket, "a/empty", 0) == (b"", 0)
    assert client.get_first_bytes(bucket, "a/empty", 777) == (b"", 0)
    with pytest.raises(ObjectNotFound) as missing:
        client.get_first_bytes(bucket, "a/other", 777)
    assert missing.value.key == "a/other"


def test_a_range_comes_with_the_objects_size_and_one_past_its_end_is_an_invalid_range(store):
    client, bucket, _ = store
    data = os.urandom(10_000)
    client.put(bucket, "a/obj.bin", data)
    assert client.get_range_and_size(bucket, "a/obj.bin", 100, 2_000) == (data[100:2_000], 10_000)
    assert client.get_range_and_size(bucket, "a/obj.bin", 5, 5) == (b"", 10_000)
    # A whole answer with fewer bytes than asked for: the object ends first. Not a fault to
    # retry (TransientStorageError) but InvalidRange, on every path that reads a range.
    for read in (lambda: client.get_range(bucket, "a/obj.bin", 9_000, 12_000),
                 lambda: client.get_range_into(bucket, "a/obj.bin", 9_000, 12_000, memoryview(bytearray(3_000))),
                 lambda: client.get_range_and_size(bucket, "a/obj.bin", 9_000, 12_000),
                 lambda: client.get_range(bucket, "a/obj.bin", 20_000, 20_010)):
        with pytest.raises(InvalidRange) as short:
            read()
        assert short.value.key == "a/obj.bin" and not isinstance(short.value, TransientStorageError)


def test_put_replaces_and_empty_objects(store):
    client, bucket, _ = store
    client.put(bucket, "k", b"first")
    client.put(bucket, "k", b"second")
    client.put(bucket, "empty", b"")
    assert client.get(bucket, "k") == b"second"
    assert client.get(bucket, "empty") == b"" and client.head(bucket, "empty") == 0


def test_conditional_puts_refuse_to_create_twice_or_replace_a_changed_object(store):
    client, bucket, _ = store
    client.put(bucket, "state", b"first", if_none_match=True)
    with pytest.raises(PreconditionFailed) as refused:
        client.put(bucket, "state", b"second", if_none_match=True)
    assert refused.value.key == "state"
    data, tag = client.get_versioned(bucket, "state")
    assert data == b"first" and tag
    client.put(bucket, "state", b"third", if_match=tag)
    with pytest.raises(PreconditionFailed):
        client.put(bucket, "state", b"fourth", if_match=tag)  # the tag of a version that is gone
    assert client.get_versioned(bucket, "state")[0] == b"third"
    with pytest.raises(ObjectNotFound):
        client.get_versioned(bucket, "missing")


def test_concurrent_creates_let_exactly_one_writer_win(store):
    client, bucket, _ = store

    def create(n: int) -> bool:
        try:
            client.put(bucket, "lock", str(n).encode(), if_none_match=True)
        except PreconditionFailed:
            return False
        return True

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(create, range(16)))
    assert won.count(True) == 1
    assert client.get(bucket, "lock") == str(won.index(True)).encode()


def test_streaming_multipart_put_is_byte_identical(store):
    client, bucket, _ = store
    chunks = [os.urandom(777_777) for _ in range(40)]  # 31 MB in odd-sized writes -> 6 parts, 4 sent at once
    with client.open_writer(bucket, "big/obj", part_size=5 * MiB) as writer:
        for chunk in chunks:
            writer.write(chunk)
    assert client.get(bucket, "big/obj") == b"".join(chunks)
    assert client.head(bucket, "big/obj") == sum(map(len, chunks))


def test_a_write_of_a_typed_buffer_is_its_bytes(store):
    # Parts were cut by the view's items, not its bytes: a float32 view made parts 4 times
    # part_size, and the local store, which places each part at its number's offset, kept
    # 20 of 24 MiB, overlapping.
    client, bucket, _ = store
    values = np.arange(6 * MiB, dtype=np.float32)  # 24 MiB
    writer = client.open_writer(bucket, "typed/obj", part_size=5 * MiB)
    writer.write(memoryview(values))
    writer.commit()
    assert client.get(bucket, "typed/obj") == values.tobytes()


def test_a_write_larger_than_a_part_is_cut_into_parts_not_buffered_whole(store):
    """A shard's member larger than a part (a 300 MB array) was appended whole to the writer's
    buffer before parts were cut from it, a copy beside the caller's: its upload peaked at
    1,218 MB of RSS. Parts are cut from the caller's bytes, so one write holds what any
    writes do, the parts being sent and the one filling (``PARTS_IN_FLIGHT + 1``); the
    object is the bytes written, the first part cut across two writes."""
    client, bucket, _ = store
    head, data = os.urandom(1000), os.urandom(64 * MiB)
    writer = client.open_writer(bucket, "big/one", part_size=5 * MiB)
    writer.write(head)
    tracemalloc.start()
    try:
        writer.write(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    writer.commit()
    assert client.get(bucket, "big/one") == head + data
    assert peak < (PARTS_IN_FLIGHT + 3) * 5 * MiB, f"{peak:,} bytes allocated to write {len(data):,} in parts of 5 MiB"


def test_failed_writer_leaves_no_object_and_no_upload(store):
    client, bucket, _ = store
    with pytest.raises(RuntimeError), client.open_writer(bucket, "broken/obj", part_size=5 * MiB) as writer:
        writer.write(os.urandom(6 * MiB))  # one part already sent
        raise RuntimeError("producer failed")
    assert not client.exists(bucket, "broken/obj")
    assert client.abort_uploads(bucket, "broken/") == 0


def test_a_part_sent_while_the_next_fills_fails_the_writer_and_leaves_no_object(store):
    """Parts go out on the writer's thread; one that fails (its upload was aborted under
    it, by another process's clean-up) raises in the caller by commit, which leaves nothing."""
    client, bucket, _ = store
    threads = set(threading.enumerate())
    writer = client.open_writer(bucket, "cut/obj", part_size=5 * MiB)
    writer.write(os.urandom(6 * MiB))  # the upload is being created, part 1 waits for it
    deadline = time.monotonic() + 10
    while not client.abort_uploads(bucket, "cut/") and time.monotonic() < deadline:
        pass  # the create is on the writer's thread: abort the upload once it exists
    with pytest.raises(StorageError):
        writer.write(os.urandom(5 * MiB))  # part 2: raises here if part 1 failed already
        writer.commit()
    with pytest.raises(StorageError, match="cannot be committed: a part failed"):
        writer.commit()  # again, after the error was caught: never a silent success
    assert not client.exists(bucket, "cut/obj")
    assert client.abort_uploads(bucket, "cut/") == 0
    assert not [t for t in set(threading.enumerate()) - threads if t.name.startswith("remote-loader-part")]


def test_abort_uploads_finds_abandoned_multipart_uploads(store):
    client, bucket, _ = store
    writer = client.open_writer(bucket, "abandoned/obj", part_size=5 * MiB)
    writer.write(os.urandom(6 * MiB))  # a part was sent; the writer is then dropped, as a killed process would
    assert client.abort_uploads(bucket, "other/") == 0
    deadline = time.monotonic() + 10
    aborted = 0
    while not aborted and time.monotonic() < deadline:  # the upload is created on the writer's thread
        aborted = client.abort_uploads(bucket, "abandoned/")
    assert aborted == 1
    assert client.abort_uploads(bucket, "abandoned/") == 0
    assert not client.exists(bucket, "abandoned/obj")
    with suppress(StorageError):
        writer.abort()  # releases the local backend's file handle; the upload itself is gone


def test_list_is_complete_sorted_and_paginated(store):
    client, bucket, _ = store
    keys = [f"p/{i:03d}" for i in range(11)] + ["q/0", "p/sub/deep"]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: client.put(bucket, k, k.encode()), keys))
    client.list_page_size = 4
    listed = list(client.list(bucket, "p/"))
    assert [o.key for o in listed] == sorted(k for k in keys if k.startswith("p/"))
    assert all(o.size == len(o.key) for o in listed)
    assert [o.key for o in client.list(bucket, "nothing/")] == []
    after = [o.key for o in client.list(bucket, "p/", start_after="p/004")]  # where a failed listing goes on
    assert after == sorted(k for k in keys if k.startswith("p/") and k > "p/004")
    assert [o.key for o in client.list(bucket, "p/", start_after="p/zzz")] == []


def test_a_ranged_read_naming_the_listed_version_is_refused_once_the_object_is_written_again(store):
    client, bucket, _ = store
    client.put(bucket, "v/obj", b"a" * 1000)
    (listed,) = client.list(bucket, "v/")
    assert listed.etag  # every store here lists a version tag
    out = bytearray(10)
    client.get_range_into(bucket, "v/obj", 100, 110, memoryview(out), if_match=listed.etag)
    assert out == b"a" * 10
    client.put(bucket, "v/obj", b"b" * 1000)  # the same size: only the version tells the two apart
    with pytest.raises(PreconditionFailed, match="v/obj"):
        client.get_range_into(bucket, "v/obj", 100, 110, memoryview(out), if_match=listed.etag)
    (again,) = client.list(bucket, "v/")
    assert again.etag != listed.etag
    client.get_range_into(bucket, "v/obj", 100, 110, memoryview(out), if_match=again.etag)
    assert out == b"b" * 10


def test_a_range_read_with_its_size_naming_the_listed_version_is_refused_once_the_object_is_written_again(store):
    client, bucket, _ = store
    client.put(bucket, "v/obj", b"a" * 1000)
    (listed,) = client.list(bucket, "v/")
    assert client.get_range_and_size(bucket, "v/obj", 100, 110, if_match=listed.etag) == (b"a" * 10, 1000)
    assert client.get_range_and_size(bucket, "v/obj", 5, 5, if_match=listed.etag) == (b"", 1000)
    client.put(bucket, "v/obj", b"b" * 1000)  # the same size: only the version tells the two apart
    with pytest.raises(PreconditionFailed, match="v/obj"):
        client.get_range_and_size(bucket, "v/obj", 100, 110, if_match=listed.etag)
    (again,) = client.list(bucket, "v/")
    assert client.get_range_and_size(bucket, "v/obj", 100, 110, if_match=again.etag) == (b"b" * 10, 1000)


def test_list_past_one_thousand_keys(store):
    client, bucket, target = store
    if target is None or target.name != "seaweedfs":
        pytest.skip("one server is enough for the 1,000-key page boundary")
    keys = [f"many/{i:05d}" for i in range(1003)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: client.put(bucket, k, b"x"), keys))
    assert [o.key for o in client.list(bucket, "many/")] == keys


def test_delete_is_idempotent(store):
    client, bucket, _ = store
    client.put(bucket, "gone", b"1")
    client.delete(bucket, "gone")
    client.delete(bucket, "gone")
    assert not client.exists(bucket, "gone")


def test_missing_object_bucket_and_range_raise_our_types(store):
    client, bucket, _ = store
    client.put(bucket, "small", b"0123456789")
    with pytest.raises(ObjectNotFound) as info:
        client.get(bucket, "no/such/key")
    assert info.value.key == "no/such/key" and "no/such/key" in str(info.value)
    with pytest.raises(ObjectNotFound):
        client.head(bucket, "no/such/key")
    with pytest.raises(ObjectNotFound):
        client.get_range(bucket, "no/such/key", 0, 5)
    with pytest.raises(ObjectNotFound):
        client.get_range_into(bucket, "no/such/key", 0, 5, memoryview(bytearray(5)))
    with pytest.raises(BucketNotFound) as info:
        client.get("no-such-bucket-" + bucket, "k")
    assert info.value.bucket == "no-such-bucket-" + bucket
    with pytest.raises(InvalidRange):
        client.get_range(bucket, "small", 20, 30)


def test_store_pickles_and_works_after(store):
    client, bucket, _ = store
    client.put(bucket, "k", b"v")
    clone = pickle.loads(pickle.dumps(client))
    assert clone.get(bucket, "k") == b"v"
    clone.put(bucket, "k2", b"w", if_none_match=True)  # requests the minio backend presigns, too
    with pytest.raises(PreconditionFailed):
        clone.put(bucket, "k2", b"x", if_none_match=True)
    assert clone.get(bucket, "k2") == b"w"


def test_the_minio_backend_uses_only_the_public_api_of_minio():
    # minio 7.2 keeps conditional PUTs and the steps of multipart uploads private; the
    # backend presigns those requests instead of calling the private methods.
    tree = ast.parse(inspect.getsource(s3_minio))
    sdk = {"minio", "Minio", "client", "_sdk", "_sdk_client", "response", "upload"}
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value.func if isinstance(node.value, ast.Call) else node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in sdk:
                private.append(f"line {node.lineno}: .{node.attr}")
    assert not private
    assert all(not alias.name.startswith("_") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and (node.module or "").startswith("minio") for alias in node.names)


def test_wrong_secret_is_access_denied_without_leaking_it(store):
    client, bucket, target = store
    if target is None or not target.checks_signatures:
        pytest.skip("this server does not check signatures")
    secret = "WRONG-SECRET-0123456789abcdef"
    backend = "minio" if isinstance(client, MinioStore) else "boto3"
    bad = make_client(target.endpoint_url, target.access_key, secret, backend=backend)
    with pytest.raises(AccessDenied) as info:
        bad.get(bucket, "anything")
    assert secret not in str(info.value) and secret not in repr(info.value)
    assert secret not in repr(bad) and target.secret_key not in repr(client)
    assert info.value.code in ("SignatureDoesNotMatch", "AccessDenied", "InvalidAccessKeyId")


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_unreachable_endpoint(backend):
    config = StorageConfig(endpoint_url="http://127.0.0.1:9", access_key="k", secret_key="s", max_attempts=1)
    client = make_client(config=config, backend=backend)
    with pytest.raises(EndpointUnreachable) as info:
        client.get("bucket", "key")
    assert "127.0.0.1:9" in str(info.value) and "\n" not in str(info.value)


def test_errors_are_storage_errors_with_one_line_messages(store):
    client, bucket, _ = store
    with pytest.raises(StorageError) as info:
        client.get(bucket, "missing")
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
    assert info.value.__cause__ is None  # the SDK's exception is not chained into the user's traceback


def test_the_minio_backend_takes_keys_from_an_aws_profile_when_none_are_given(seaweed, tmp_path):
    # boto3 reads AWS_PROFILE through its own credential chain; the minio client did not.
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n"
                           f"[loader]\naws_access_key_id = {seaweed.access_key}\n"
                           f"aws_secret_access_key = {seaweed.secret_key}\n")
    config = StorageConfig.from_env({"AWS_ENDPOINT_URL": seaweed.endpoint_url, "AWS_PROFILE": "loader",
                                     "AWS_SHARED_CREDENTIALS_FILE": str(credentials)})
    assert config.access_key is None and config.profile == "loader"
    seaweed.client().create_bucket("profiles")
    client = make_client(config=config, backend="minio")
    client.put("profiles", "k", b"v")  # before: an anonymous request, AccessDenied
    assert client.get("profiles", "k") == b"v"
    client.close()


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_small_bodies_go_at_once_and_large_ones_after_100_continue(seaweed, backend):
    """Waiting for ``100 Continue`` costs a round trip: a task record, the upload state or a
    small shard is sent at once; a body of 2 MiB or more may wait, so a refused one is not sent."""
    proxy = FaultProxy(seaweed.endpoint_url, {})
    try:
        client = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key, backend=backend)
        bucket = new_bucket(client)
        client.put(bucket, "small", b"x" * 1000)
        client.put(bucket, "state", b"claimed", if_none_match=True)
        client.put(bucket, "almost", b"x" * (2 * MiB - 1))
        with client.open_writer(bucket, "big", part_size=5 * MiB) as writer:
            writer.write(os.urandom(5 * MiB + 10))
        assert client.get(bucket, "state") == b"claimed" and client.head(bucket, "big") == 5 * MiB + 10
        client.close()
    finally:
        proxy.close()
    waited = {length: expect for method, length, expect in proxy.bodies if method == "PUT"}
    assert waited[1000] is waited[7] is waited[2 * MiB - 1] is waited[10] is False, proxy.bodies
    assert set(waited) >= {1000, 7, 2 * MiB - 1, 5 * MiB, 10}



def test_boto3_sends_bodies_unhashed_on_http_and_a_server_that_checks_signatures_takes_them(seaweed):
    """On http botocore would SHA-256 every byte sent into the request's signature: a quarter
    of an upload's CPU. The boto3 backend sends bodies as UNSIGNED-PAYLOAD (crc32s check the
    data on read), which SeaweedFS, checking every signature, takes; a wrong secret is still
    refused."""
    proxy = FaultProxy(seaweed.endpoint_url, {})
    try:
        client = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
        bucket = new_bucket(client)
        small, big = os.urandom(1000), os.urandom(5 * MiB + 10)
        client.put(bucket, "small", small)
        client.put(bucket, "state", b"claimed", if_none_match=True)
        with client.open_writer(bucket, "big", part_size=5 * MiB) as writer:
            writer.write(big)
        assert (client.get(bucket, "small"), client.get(bucket, "big")) == (small, big)
        client.close()
        wrong = make_client(proxy.endpoint_url, seaweed.access_key, "not-the-secret")
        with pytest.raises(AccessDenied):
            wrong.put(bucket, "small", small)
        wrong.close()
    finally:
        proxy.close()
    sent = [(method, length, digest) for (method, length, _), digest in zip(proxy.bodies, proxy.payload_hashes,
                                                                            strict=True)]
    puts = [(length, digest) for method, length, digest in sent if method == "PUT"]
    assert {length for length, _ in puts} >= {1000, 7, 5 * MiB, 10}, sent
    assert all(digest == "UNSIGNED-PAYLOAD" for _, digest in puts), sent


@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_a_writer_whose_upload_cannot_be_created_fails_with_the_stores_error(seaweed, backend):
    """The create goes out on the writer's thread: its error (here, a wrong secret) reaches
    the caller by commit, and the writer stays failed."""
    threads = set(threading.enumerate())
    client = make_client(seaweed.endpoint_url, seaweed.access_key, "wrong-" + seaweed.secret_key, backend=backend)
    writer = client.open_writer("refused", "obj", part_size=5 * MiB)
    with pytest.raises(AccessDenied) as refused:
        writer.write(os.urandom(6 * MiB))
        writer.write(os.urandom(5 * MiB))
        writer.commit()
    assert refused.value.key == "obj" and "\n" not in str(refused.value) and "wrong-" not in str(refused.value)
    with pytest.raises(StorageError, match="cannot be committed: a part failed"):
        writer.commit()
    client.close()
    assert not [t for t in set(threading.enumerate()) - threads if t.name.startswith("remote-loader-part")]


def test_ranges_go_on_presigned_urls_that_are_signed_anew_when_refused(seaweed):
    """boto3's ranged GETs go on a URL presigned per object, through the client's own pool;
    one the server refuses (expired, or signed with keys since replaced) is signed anew once,
    and a store whose keys are wrong gets AccessDenied naming neither its secret nor a URL."""
    client = seaweed.client()
    bucket = new_bucket(client)
    data = os.urandom(3 * MiB)
    client.put(bucket, "obj", data)
    out = bytearray(MiB)
    client.get_range_into(bucket, "obj", MiB, 2 * MiB, memoryview(out))
    assert out == data[MiB : 2 * MiB]
    secret = "WRONG-SECRET-0123456789abcdef"
    wrong = make_client(seaweed.endpoint_url, seaweed.access_key, secret)
    stale = wrong._sdk().generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "obj"})
    client._urls[(bucket, "obj")] = (stale, time.monotonic() + 3600)  # as kept, but refused now
    client.get_range_into(bucket, "obj", 0, MiB, memoryview(out))
    assert out == data[:MiB]
    with pytest.raises(AccessDenied) as info:
        wrong.get_range_into(bucket, "obj", 0, MiB, memoryview(out))
    message = f"{info.value} {info.value!r} {info.value.args}"
    assert secret not in message and "X-Amz-Signature" not in message and "\n" not in str(info.value)
    with pytest.raises(ObjectNotFound) as missing:
        client.get_range_into(bucket, "no/such/key", 0, 5, memoryview(out)[:5])
    assert missing.value.code == "NoSuchKey" and "X-Amz" not in str(missing.value)
    client.close()


@pytest.mark.parametrize(
    "url, problem",
    [
        ("s3://data[sets/x", "holds '['"),
        ("s3://da\ttasets/x", "holds '\\t'"),  # urlsplit would drop the tab: another bucket
        ("s3://ab\x01c/x", "holds '\\x01'"),
        ("s3://my bucket/x", "holds ' '"),
        ("s3://bkt\n/x", "holds '\\n'"),
    ],
)
def test_a_dataset_url_whose_bucket_no_store_allows_is_refused_in_one_line_naming_it(url, problem):
    """Not a ValueError from urlsplit, nor a bucket the URL does not name: a ConfigError that
    shows the URL escaped and says what is wrong with its bucket."""
    with pytest.raises(ConfigError) as info:
        parse_location(url)
    message = str(info.value)
    assert repr(url) in message and problem in message and BUCKET_NAME_RULE in message, message
    assert message.isprintable(), message


@pytest.mark.parametrize("url, prefix", [("s3://bkt/a\tb", "a\tb"), ("s3://bkt/a?b#c", "a?b#c")])
def test_a_dataset_urls_prefix_is_taken_whole_or_refused_never_changed(url, prefix):
    """What follows the bucket is the prefix as written: a query or fragment is part of it,
    and a control character is refused, where urlsplit would drop them silently."""
    if prefix.isprintable():
        assert parse_location(url).base_folder == prefix
    else:
        with pytest.raises(ConfigError, match="control character") as info:
            parse_location(url)
        assert str(info.value).isprintable() and repr(url) in str(info.value)


@pytest.mark.parametrize("bucket", ["ab\x01c", "my bucket", "abc\x1b[31mred"])
def test_a_bucket_name_the_sdk_refuses_is_explained_by_the_bucket_rule_in_one_printable_line(bucket):
    """boto3 refuses such a name before sending (its regex, with the name raw in it); the
    message is the project's own: the name escaped, what is wrong with it, the rule."""
    config = StorageConfig(endpoint_url="http://127.0.0.1:9", access_key="k", secret_key="s", max_attempts=1)
    client = make_client(config=config)
    with pytest.raises(StorageError) as info:
        client.get(bucket, "key")
    message = str(info.value)
    assert repr(bucket) in message and BUCKET_NAME_RULE in message and message.isprintable(), message
    assert "regex" not in message and info.value.bucket == bucket


@pytest.mark.parametrize("code, status", [("InvalidBucketName", 400), ("NoSuchKey", 404), ("AccessDenied", 403),
                                          ("InternalError", 500), ("Weird", 400)])
def test_a_stores_error_shows_a_bucket_or_key_with_control_characters_escaped(code, status):
    """Each message names the object on one printable line, whatever its bucket and key hold."""
    error = error_for(code, status, operation="GET", bucket="abc\n", key="k\x1b[31m", endpoint="http://h:1")
    assert str(error).isprintable() and "\\n" in str(error), str(error)


def test_creating_a_bucket_whose_name_ends_in_a_newline_fails_in_one_line(s3):
    """botocore's bucket regex lets a trailing newline through (``$``); the server's refusal
    names the bucket escaped."""
    client, _ = s3
    with pytest.raises(StorageError) as info:
        client.create_bucket("abc\n")
    assert str(info.value).isprintable() and "abc\\n" in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "endpoint, problem",
    [
        ("http://127.0.0.1:9000?X-Amz-Signature=SECRET", "must not have a query"),
        ("http://127.0.0.1:9000/?X-Amz-Signature=SECRET", "must not have a query"),
        ("http://127.0.0.1:9000/bkt?X-Amz-Signature=SECRET", "must not have a path"),
        ("ftp://127.0.0.1:9000?X-Amz-Signature=SECRET", "is not a valid URL"),
        ("http://[::1?X-Amz-Signature=SECRET", "is not an http(s)://host[:port] URL"),
        ("http://127.0.0.1:9\t000?X-Amz-Signature=SECRET", "control character"),
    ],
)
def test_an_endpoint_that_is_no_host_and_port_is_refused_without_echoing_its_query(endpoint, problem):
    """A query may hold a presigned URL's signature: the message names the endpoint up to it,
    and says what is wrong (a query is not a path)."""
    with pytest.raises(ConfigError) as info:
        make_client(endpoint, "k", "s")
    message = str(info.value)
    assert problem in message and "SECRET" not in message and endpoint.split("//")[1][:4] in message, message
    assert message.isprintable(), message
