"""The public surface: exported names, configuration from the environment, secrets kept out."""

from __future__ import annotations

import pickle

import pytest

import remote_loader
from remote_loader import ConfigError, StorageConfig, UploadError, make_client
from remote_loader.storage import Boto3Store, LocalStore, MinioStore, parse_location

EXPECTED = {
    "AccessDenied", "BucketNotFound", "ConfigError", "CorruptSampleError", "CorruptShard", "DatasetChanged", "DatasetNotFound", "DatasetReader",
    "DecodeError", "EndpointUnreachable", "FetchConfig", "Metrics", "RandomResizedCrop", "RemoteDataset", "RemoteMapDataset", "LocalitySampler", "FormatError", "ImageFolder", "IndexOutOfBounds", "InvalidRange",
    "LocalStore", "ObjectNotFound", "PreconditionFailed", "RemoteLoaderError", "StorageConfig", "StorageError", "Store",
    "TransientStorageError", "UnsupportedVersion", "UploadConflict", "UploadError", "UploadSummary", "__version__",
    "make_client", "upload_cv_dataset",
}


def test_public_names():
    assert set(remote_loader.__all__) == EXPECTED
    assert all(hasattr(remote_loader, name) for name in remote_loader.__all__)


def test_config_from_aws_and_minio_environment():
    aws = StorageConfig.from_env({"AWS_ENDPOINT_URL": "http://h:1", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "eu-west-1"})
    assert (aws.endpoint_url, aws.access_key, aws.secret_key, aws.region) == ("http://h:1", "k", "s", "eu-west-1")
    minio = StorageConfig.from_env({"MINIO_ENDPOINT": "m:9000", "MINIO_ROOT_USER": "u", "MINIO_ROOT_PASSWORD": "p"})
    assert (minio.endpoint_url, minio.access_key, minio.secret_key) == ("http://m:9000", "u", "p")
    override = StorageConfig.from_env({"AWS_ENDPOINT_URL": "http://h:1"}, endpoint_url="https://other:443", access_key="a", secret_key="b")
    assert override.endpoint_url == "https://other:443"
    with pytest.raises(ConfigError, match="both"):
        StorageConfig.from_env({"AWS_ACCESS_KEY_ID": "k"})
    with pytest.raises(ConfigError, match="endpoint"):
        StorageConfig(endpoint_url="ftp://x")


def test_secrets_stay_out_of_reprs():
    secret = "s3cr3t-VALUE"
    config = StorageConfig(endpoint_url="http://127.0.0.1:9000", access_key="key", secret_key=secret, session_token="tok-" + secret)
    for client in (make_client(config=config), make_client(config=config, backend="minio")):
        assert secret not in repr(client) and secret not in repr(config)


def test_make_client_picks_the_backend(tmp_path):
    assert isinstance(make_client("http://127.0.0.1:9000", "a", "b"), Boto3Store)
    assert isinstance(make_client("127.0.0.1:9000", "a", "b", backend="minio"), MinioStore)
    assert isinstance(make_client(str(tmp_path)), LocalStore)
    assert isinstance(make_client(f"file://{tmp_path}"), LocalStore)
    with pytest.raises(ConfigError):
        make_client("http://h:1", "a", "b", backend="azure")  # type: ignore[arg-type]


def test_parse_location():
    assert (parse_location("s3://bkt/a/b/").bucket, parse_location("s3://bkt/a/b/").prefix) == ("bkt", "a/b")
    assert parse_location("s3://bkt").prefix == ""
    local = parse_location("file:///data/bkt/x")
    assert (local.bucket, local.prefix) == ("data", "bkt/x")
    with pytest.raises(ConfigError):
        parse_location("http://host/bucket")


def test_errors_pickle_with_their_attributes():
    error = pickle.loads(pickle.dumps(UploadError("sample 3: bad", index=3)))
    assert isinstance(error, UploadError) and error.index == 3 and str(error) == "sample 3: bad"
