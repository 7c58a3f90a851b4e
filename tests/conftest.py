"""Session-wide S3 servers on loopback and per-test buckets on them."""

from __future__ import annotations

import itertools
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from remote_loader import LocalStore, Store, make_client
from remote_loader.testing.server import EmbeddedS3
from tests.servers import LocalBucketServer, MotoServer, S3Target, external_target, remove_bucket

_counter = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    """The Ctrl-C tests send SIGINT to this process and to the ones it starts, which inherit
    how it handles it. A shell starts a background job (``make test &``) with SIGINT
    ignored, and Python then installs no KeyboardInterrupt for it: put Python's back."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedS3]:
    server = EmbeddedS3(data_dir=str(tmp_path_factory.mktemp("seaweedfs")), secret_key="test-" + uuid.uuid4().hex)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed_target(seaweed: EmbeddedS3) -> S3Target:
    return S3Target("seaweedfs", seaweed.endpoint_url, seaweed.access_key, seaweed.secret_key)


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def localbucket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBucketServer]:
    server = LocalBucketServer(tmp_path_factory.mktemp("localbucket"))
    yield server
    server.stop()


def new_bucket(store: Store) -> str:
    bucket = f"test-{next(_counter)}-{uuid.uuid4().hex[:8]}"
    store.create_bucket(bucket)
    return bucket


_STORES = [
    "seaweedfs-boto3",
    "seaweedfs-minio",
    "moto-boto3",
    "moto-minio",
    "external-boto3",
    "external-minio",
    "local",
]


def _target(request: pytest.FixtureRequest, server: str) -> S3Target:
    if server == "seaweedfs":
        return request.getfixturevalue("seaweed_target")
    if server == "moto":
        return request.getfixturevalue("moto").target
    target = external_target()
    if target is None:
        pytest.skip("set REMOTE_LOADER_TEST_ENDPOINT to test an external S3 server")
    return target


@pytest.fixture(params=_STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Store, str, S3Target | None]]:
    """The storage contract's subjects: each S3 backend on each S3 server, and a local directory.

    Yields (store, fresh bucket, the S3 server or None for the local directory).
    """
    target = None
    if request.param == "local":
        client: Store = LocalStore(tmp_path)
    else:
        server, backend = request.param.split("-")
        target = _target(request, server)
        client = make_client(target.endpoint_url, target.access_key, target.secret_key, backend=backend)  # type: ignore[arg-type]
    bucket = new_bucket(client)
    yield client, bucket, target
    client.close()
    if target is not None and target.name == "external":  # a server the tests do not own keeps nothing of theirs
        remove_bucket(target, bucket)


@pytest.fixture
def s3(seaweed: EmbeddedS3) -> Iterator[tuple[Store, str]]:
    """A boto3 store on the embedded SeaweedFS server and a fresh bucket."""
    store = seaweed.client()
    yield store, new_bucket(store)
    store.close()


@pytest.fixture(params=["seaweedfs", "external"])
def roundtrip_s3(request: pytest.FixtureRequest) -> Iterator[tuple[Store, str]]:
    """SeaweedFS, and the external endpoint when one is configured."""
    target = _target(request, request.param)
    store = make_client(target.endpoint_url, target.access_key, target.secret_key)
    bucket = new_bucket(store)
    yield store, bucket
    store.close()
    if target.name == "external":
        remove_bucket(target, bucket)
