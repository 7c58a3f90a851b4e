"""The retry layer: every request of a ``RetryingStore`` rides out the faults a real store
throws (through a fault-injecting proxy in front of SeaweedFS), and the settings that
drive it have one home, ``RetryConfig``."""

from __future__ import annotations

import threading

import pytest

from remote_loader import ConfigError, FetchConfig, RetryConfig, TransientStorageError, make_client, upload_cv_dataset
from remote_loader.storage import Store
from remote_loader.storage.retrying import Cancelled, Retry, RetryingStore
from remote_loader.testing.synthetic import SyntheticImages
from tests.faultproxy import FaultProxy

FAULTS = {"error_500": 0.3, "slow_down_503": 0.2, "reset_before": 0.2}
METHODS = ("GET", "PUT", "POST", "DELETE", "HEAD")
PART = 5 * 1024 * 1024


def _every_request(store: Store, bucket: str) -> list[object]:
    """One of each request a store makes, with what each returned."""
    big = bytes(range(256)) * (PART // 256) + b"tail"
    store.create_bucket(bucket)
    store.put(bucket, "a/one", b"0123456789")
    with store.open_writer(bucket, "a/big", part_size=PART) as writer:
        writer.write(big)
    _, tag = store.get_versioned(bucket, "a/one")
    store.put(bucket, "a/one", b"abcdefghij", if_match=tag)
    results: list[object] = [
        bytes(store.get(bucket, "a/one")),
        bytes(store.get_range(bucket, "a/one", 2, 5)),
        store.get_range_and_size(bucket, "a/one", 7, 10),
        store.get_first_bytes(bucket, "a/big", 4),
        store.head(bucket, "a/big"),
        store.exists(bucket, "a/none"),
        [info.key for info in store.list(bucket, "a/")],
        bytes(store.get(bucket, "a/big")) == big,
    ]
    out = bytearray(4)
    store.get_range_into(bucket, "a/big", PART, PART + 4, memoryview(out))
    results.append(bytes(out))
    store.delete(bucket, "a/one")
    results.append(store.abort_uploads(bucket, "a/"))
    results.append([info.key for info in store.list(bucket, "a/")])
    return results


EXPECTED = [
    b"abcdefghij",
    b"cde",
    (b"hij", 10),
    (bytes(range(4)), PART + 4),
    PART + 4,
    False,
    ["a/big", "a/one"],
    True,
    b"tail",
    0,
    ["a/big"],
]


def test_every_request_of_a_retrying_store_rides_out_faults(seaweed):
    proxy = FaultProxy(seaweed.endpoint_url, FAULTS, seed=4, methods=METHODS)
    retries = []
    try:
        raw = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
        store = RetryingStore(
            raw, Retry(RetryConfig(backoff=0.001, max_backoff=0.01), raw.endpoint, on_retry=lambda: retries.append(1))
        )
        assert _every_request(store, "retrying-layer") == EXPECTED
    finally:
        proxy.close()
    assert sum(proxy.injected.values()) >= 5 and len(retries) == sum(proxy.injected.values())


def test_the_same_requests_without_the_layer_fail(seaweed):
    proxy = FaultProxy(seaweed.endpoint_url, FAULTS, seed=4, methods=METHODS)
    try:
        raw = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
        with pytest.raises(TransientStorageError):
            _every_request(raw, "retrying-layer-raw")
    finally:
        proxy.close()


def test_a_cancelled_retry_stops_before_the_next_attempt(seaweed):
    cancel = threading.Event()
    cancel.set()
    store = RetryingStore(seaweed.client(), Retry(RetryConfig(), seaweed.endpoint_url, cancel))
    with pytest.raises(Cancelled):
        store.get("any", "key")


def test_the_retry_settings_live_in_retry_config_and_nowhere_else():
    config = FetchConfig(range_bytes=1 << 20, refetch_attempts=3, retry=RetryConfig(outage_deadline=9))
    assert (config.retry.outage_deadline, config.refetch_attempts, config.range_bytes) == (9, 3, 1 << 20)
    for name in ("max_attempts", "outage_deadline", "backoff"):
        with pytest.raises(TypeError, match=repr(name)):
            FetchConfig(**{name: 2})
        assert not hasattr(config, name)
    with pytest.raises(TypeError, match="'outage'"):
        FetchConfig(outage=3)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="retry must be a RetryConfig"):
        FetchConfig(retry={"outage_deadline": 3})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="range_bytes"):
        FetchConfig(range_bytes=0)
    with pytest.raises(ConfigError, match="backoff"):
        RetryConfig(backoff=-1)


def test_an_upload_takes_its_retry_settings_as_a_retry_config(seaweed):
    client = seaweed.client()
    client.create_bucket("retry-config")
    with pytest.raises(TypeError, match="'fetch'"):
        upload_cv_dataset(SyntheticImages(4), client=client, bucket="retry-config", base_folder="d", workers=0,
                          progress=False, fetch=FetchConfig())  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="retry must be a RetryConfig"):
        upload_cv_dataset(SyntheticImages(4), client=client, bucket="retry-config", base_folder="e", workers=0,
                          progress=False, retry=5)  # type: ignore[arg-type]


def test_a_listing_rides_out_faults_between_its_pages_and_stays_lazy(seaweed):
    bucket = "retrying-listing"
    client = seaweed.client()
    client.create_bucket(bucket)
    expected = [f"k/{i:03d}" for i in range(30)]
    for key in expected:
        client.put(bucket, key, b"x")
    for rates, seed in ((FAULTS, 7), ({}, 0)):
        proxy = FaultProxy(seaweed.endpoint_url, rates, seed=seed, methods=("GET",))
        try:
            raw = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key)
            raw.list_page_size = 4  # 8 pages: faults land between them
            store = RetryingStore(raw, Retry(RetryConfig(backoff=0.001, max_backoff=0.01), raw.endpoint))
            assert [info.key for info in store.list(bucket, "k/")] == expected  # none twice, none lost
            if not rates:
                before = proxy.requests
                assert next(iter(store.list(bucket, "k/"))).key == "k/000"
                assert proxy.requests - before == 1  # the first key needs the first page only
            else:
                assert sum(proxy.injected.values()) >= 2
        finally:
            proxy.close()


@pytest.mark.parametrize("fault", ["short_answer", "flip"])
@pytest.mark.parametrize("backend", ["boto3", "minio"])
def test_a_listing_page_answered_short_or_garbled_is_asked_again(seaweed, backend, fault):
    """A page whose XML ends short (a proxy cutting the answer, the length cut with it) or
    is garbled is a fault to retry, not an error from inside the client's XML parser."""
    bucket = f"retrying-{fault.replace('_', '-')}-page-{backend}"
    client = seaweed.client()
    client.create_bucket(bucket)
    expected = [f"k/{i:03d}" for i in range(6)]
    for key in expected:
        client.put(bucket, key, b"x")
    proxy = FaultProxy(seaweed.endpoint_url, {fault: 1.0}, methods=("GET",), first_only="request")
    try:
        raw = make_client(proxy.endpoint_url, seaweed.access_key, seaweed.secret_key, backend=backend)
        store = RetryingStore(raw, Retry(RetryConfig(backoff=0.001, max_backoff=0.01), raw.endpoint))
        assert [info.key for info in store.list(bucket, "k/")] == expected
        assert proxy.injected[fault] >= 1
    finally:
        proxy.close()
        client.close()
