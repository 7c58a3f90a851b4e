"""A boto3 S3 client or a minio.Minio of the user's own, where the API takes a client: used
as it is in the user's process; a worker process makes its own for the same endpoint with
its environment's credentials, or says clearly why it cannot."""

from __future__ import annotations

import pickle
from collections import Counter

import boto3
import pytest
from minio import Minio
from torch.utils.data import DataLoader

from remote_loader import ConfigError, RemoteDataset, RemoteMapDataset, upload_cv_dataset
from remote_loader.storage import Boto3Store, as_store
from remote_loader.testing.synthetic import SyntheticImages
from tests.conftest import new_bucket
from tests.helpers import upload


def _boto3(seaweed):
    return boto3.client("s3", endpoint_url=seaweed.endpoint_url, aws_access_key_id=seaweed.access_key,
                        aws_secret_access_key=seaweed.secret_key, region_name="us-east-1")


def _minio(seaweed):
    return Minio(seaweed.endpoint_url.removeprefix("http://"), access_key=seaweed.access_key,
                 secret_key=seaweed.secret_key, secure=False)


def _no_credentials_in_the_environment(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "MINIO_ACCESS_KEY", "MINIO_SECRET_KEY",
                 "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("kind", ["boto3", "minio"])
def test_a_users_own_client_uploads_streams_and_reads_in_this_process(seaweed, kind, monkeypatch, tmp_path):
    _no_credentials_in_the_environment(monkeypatch, tmp_path)  # only the user's client holds the keys
    bucket = new_bucket(seaweed.client())
    client = _boto3(seaweed) if kind == "boto3" else _minio(seaweed)
    sent = []
    if kind == "boto3":
        client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.method))
    summary = upload(client, bucket, "own", SyntheticImages(30, size=(16, 16)), maxcount=10)
    assert summary.samples == 30
    keys = [s["__key__"] for s in RemoteDataset(client, bucket, "own")]
    assert Counter(keys) == Counter(f"{i:06d}" for i in range(30))
    ds = RemoteMapDataset(client, bucket, "own")
    assert bytes(ds[7]["jpg"])[:2] == b"\xff\xd8"
    ds.reader.client.close()  # the store lets go; the client is still the user's, and works
    assert ds[8]["__key__"]
    if kind == "boto3":
        assert sent and "PUT" in sent and "GET" in sent  # the requests went through the user's client
        client.list_objects_v2(Bucket=bucket)
    else:
        assert client.bucket_exists(bucket)


@pytest.mark.parametrize("kind", ["boto3", "minio"])
def test_in_a_worker_process_the_client_is_remade_with_the_environments_credentials(seaweed, kind, monkeypatch):
    bucket = new_bucket(seaweed.client())
    upload(seaweed.client(), bucket, "w", SyntheticImages(24, size=(16, 16)), maxcount=6)
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    client = _boto3(seaweed) if kind == "boto3" else _minio(seaweed)
    loader = DataLoader(RemoteDataset(client, bucket, "w").to_tuple("__key__"), batch_size=None, num_workers=2)
    assert Counter(k for (k,) in loader) == Counter(f"{i:06d}" for i in range(24))
    summary = upload_cv_dataset(SyntheticImages(24, size=(16, 16)), client=client, bucket=bucket, base_folder="up",
                                maxcount=6, workers=2, progress=False)
    assert summary.samples == 24 and summary.shards == 4


@pytest.mark.parametrize("kind", ["boto3", "minio"])
def test_without_credentials_in_a_workers_environment_the_error_says_what_to_do(seaweed, kind, monkeypatch, tmp_path):
    bucket = new_bucket(seaweed.client())
    upload(seaweed.client(), bucket, "w", SyntheticImages(12, size=(16, 16)), maxcount=6)
    _no_credentials_in_the_environment(monkeypatch, tmp_path)
    client = _boto3(seaweed) if kind == "boto3" else _minio(seaweed)
    loader = DataLoader(RemoteDataset(client, bucket, "w"), batch_size=None, num_workers=1)
    with pytest.raises(ConfigError, match=r"client passed to remote_loader was made in another process.*make_client"):
        list(loader)


def test_what_is_not_an_s3_client_is_refused_by_name():
    with pytest.raises(ConfigError, match="a boto3 client for 'sqs' is not an S3 client"):
        as_store(boto3.client("sqs", region_name="us-east-1"), "bkt")
    with pytest.raises(ConfigError, match="client must be a store from remote_loader.make_client.*got builtins.dict"):
        RemoteDataset({"endpoint": "x"}, "bkt", "d")  # type: ignore[arg-type]


def test_a_boto3_client_on_aws_keeps_its_endpoint_and_addressing_in_workers(seaweed, monkeypatch):
    # A worker's environment may name another endpoint (a local server with a bucket of the
    # same name): the store's copy there must still go where the user's client goes.
    store = as_store(boto3.client("s3", region_name="eu-west-1"), "bkt")
    assert isinstance(store, Boto3Store) and store.config.region == "eu-west-1"
    assert store.endpoint == "AWS S3 (https://s3.eu-west-1.amazonaws.com)"
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)  # AWS_ENDPOINT_URL and keys of the local server
    copy = pickle.loads(pickle.dumps(store))  # as a spawned worker gets it
    assert copy._sdk().meta.endpoint_url == "https://s3.eu-west-1.amazonaws.com" != seaweed.endpoint_url
    assert copy._sdk().meta.config.s3["addressing_style"] == "auto"  # virtual-hosted, as AWS wants
