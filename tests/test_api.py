"""The public surface: exported names, configuration from the environment, secrets kept out."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

import remote_loader
from remote_loader import ConfigError, RemoteDataset, StorageConfig, UploadError, make_client
from remote_loader.storage import Boto3Store, LocalStore, Location, MinioStore, parse_location

EXPECTED = {
    "AccessDenied",
    "BucketNotFound",
    "CacheConfig",
    "ConfigError",
    "CorruptSampleError",
    "CorruptShard",
    "DatasetChanged",
    "DatasetNotFound",
    "DatasetReader",
    "DecodeError",
    "EndpointUnreachable",
    "FetchConfig",
    "Metrics",
    "RandomResizedCrop",
    "RemoteDataset",
    "RemoteMapDataset",
    "RemoteVideoClips",
    "LocalitySampler",
    "FormatError",
    "ImageFolder",
    "IndexOutOfBounds",
    "InvalidRange",
    "LocalStore",
    "ObjectNotFound",
    "OnError",
    "PreconditionFailed",
    "RemoteLoaderError",
    "RetryConfig",
    "StorageConfig",
    "StorageError",
    "Store",
    "ResumeError",
    "TransientStorageError",
    "TruncatedShard",
    "UnsupportedVersion",
    "UniformSampler",
    "VideoClip",
    "VideoFolder",
    "UploadConflict",
    "UploadError",
    "UploadSummary",
    "__version__",
    "collate",
    "decode_batches",
    "loader",
    "make_client",
    "rank_cores",
    "restore",
    "upload_cv_dataset",
}


def test_public_names():
    assert set(remote_loader.__all__) == EXPECTED
    assert all(hasattr(remote_loader, name) for name in remote_loader.__all__)


def test_config_from_aws_and_minio_environment():
    aws = StorageConfig.from_env(
        {
            "AWS_ENDPOINT_URL": "http://h:1",
            "AWS_ACCESS_KEY_ID": "k",
            "AWS_SECRET_ACCESS_KEY": "s",
            "AWS_DEFAULT_REGION": "eu-west-1",
        }
    )
    assert (aws.endpoint_url, aws.access_key, aws.secret_key, aws.region) == ("http://h:1", "k", "s", "eu-west-1")
    minio = StorageConfig.from_env({"MINIO_ENDPOINT": "m:9000", "MINIO_ROOT_USER": "u", "MINIO_ROOT_PASSWORD": "p"})
    assert (minio.endpoint_url, minio.access_key, minio.secret_key) == ("http://m:9000", "u", "p")
    override = StorageConfig.from_env(
        {"AWS_ENDPOINT_URL": "http://h:1"}, endpoint_url="https://other:443", access_key="a", secret_key="b"
    )
    assert override.endpoint_url == "https://other:443"
    with pytest.raises(ConfigError, match="both"):
        StorageConfig.from_env({"AWS_ACCESS_KEY_ID": "k"})
    with pytest.raises(ConfigError, match="endpoint"):
        StorageConfig(endpoint_url="ftp://x")


def test_secrets_stay_out_of_reprs():
    secret = "s3cr3t-VALUE"
    config = StorageConfig(
        endpoint_url="http://127.0.0.1:9000", access_key="key", secret_key=secret, session_token="tok-" + secret
    )
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
    assert (parse_location("s3://bkt/a/b/").bucket, parse_location("s3://bkt/a/b/").base_folder) == ("bkt", "a/b")
    assert parse_location("s3://bkt").base_folder == ""
    assert not hasattr(parse_location("s3://bkt/a"), "prefix")  # one name: base_folder
    local = parse_location("file:///data/bkt/x")
    assert (local.bucket, local.base_folder, str(local)) == ("x", "", "/data/bkt/x")
    with pytest.raises(ConfigError):
        parse_location("http://host/bucket")


def test_errors_pickle_with_their_attributes():
    error = pickle.loads(pickle.dumps(UploadError("sample 3: bad", index=3)))
    assert isinstance(error, UploadError) and error.index == 3 and str(error) == "sample 3: bad"


@pytest.mark.parametrize(
    "url, message",
    [
        ("s3:/bkt/x", "not a valid URL"),
        ("S3://bkt/x", "lower case, s3://bkt/x"),
        ("htp://host:9000", "not a valid URL"),
        ("http//host", "not a valid URL"),
        (" s3://bkt/x", "whitespace"),
        ("s3://bkt/x ", "whitespace"),
        ("datasets/x", r"did you mean s3://datasets/x\?"),
        ("http://127.0.0.1:9000", "is an endpoint, not a dataset"),
        ("s3://KEY:hunter2@bkt/ds", "holds credentials"),
        ("s3://KEY:hunter2/x+y@bkt/ds", "holds credentials"),  # a secret with a slash
        ("S3://KEY:hunter2@bkt/ds", "lower case"),
        ("htp://key:hunter2@host:9000/x", "not a valid URL"),
        ("file://key:hunter2@host/x", "names a host"),
    ],
)
def test_mistyped_dataset_urls_are_refused_not_made_into_directories(url, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for attempt in (lambda: parse_location(url), lambda: RemoteDataset(url)):
        with pytest.raises(ConfigError, match=message) as caught:
            attempt()
        assert "hunter2" not in str(caught.value) and "\n" not in str(caught.value)
    assert not list(tmp_path.iterdir())  # nothing was created beside the caller


def test_explicit_local_paths_still_name_local_stores(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_location("./bkt/x") == parse_location(f"{tmp_path}/bkt/x") == Location("x", "")
    assert str(parse_location("./bkt/x")) == f"{tmp_path}/bkt/x"
    assert isinstance(make_client("./root"), LocalStore)
    with pytest.raises(ConfigError, match="not a valid URL"):
        make_client("htp://host:9000")


def test_cli_refuses_a_mistyped_url_and_writes_nothing(tmp_path):
    (tmp_path / "images" / "cat").mkdir(parents=True)
    for url in ("s3:/bkt/x", "datasets/x"):
        out = subprocess.run(
            [sys.executable, "-m", "remote_loader.cli", "upload", "images", url],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "did you mean s3://datasets/x?" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images"]


def test_the_vision_extra_pins_the_torchvision_of_the_tested_torch():
    import re
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    vision = re.fullmatch(r"torchvision==0\.(\d+)\.(\d+)", extras["vision"][0])
    torch = re.search(r"^TORCH := torch==2\.(\d+)\.\d+$", (root / "Makefile").read_text(), re.M)
    assert vision and torch, (extras["vision"], "Makefile TORCH")
    assert int(vision.group(1)) == int(torch.group(1)) + 15  # torch 2.13 <-> torchvision 0.28
