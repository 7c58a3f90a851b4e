"""What a new user meets in the first hour with the command line: a bucket that does not
exist (and the option that makes it), a bucket name S3 does not allow, a mistyped URL, no
endpoint set, Ctrl-C during an upload (and how to go on), counts said in words."""

from __future__ import annotations

import os
import subprocess

import pytest

from remote_loader.cli import main
from tests.cli.test_cli import _local_tars, run
from tests.servers import free_port


@pytest.fixture
def env(seaweed):
    return {**os.environ, **seaweed.env()}


def test_an_upload_to_a_bucket_that_does_not_exist_says_how_to_make_it_and_the_option_does(env):
    url = "s3://first-hour-missing/d"
    refused = run(env, "upload", "tests.cli.sources:twenty", url, "--workers", "0", check=False)
    assert refused.returncode == 1
    assert "bucket 'first-hour-missing' does not exist" in refused.stderr
    assert refused.stderr.rstrip().endswith("(--create-bucket makes it)")
    run(env, "upload", "tests.cli.sources:twenty", url, "--workers", "0", "--create-bucket")
    assert "samples   20 in 1 shard," in run(env, "info", url).stdout


@pytest.mark.parametrize("wrong", ["bucket", "endpoint", "secret"])
def test_a_bucket_that_cannot_be_written_is_said_before_the_dataset_is_built(env, s3, tmp_path, wrong):
    # The dataset was built (minutes, for a large one) before the first request said what was wrong.
    _, bucket = s3
    marker = tmp_path / "built"
    env = {**env, "SOURCE_BUILT_MARKER": str(marker), "REMOTE_LOADER_FIRST_CONTACT_DEADLINE": "0.5"}
    url = f"s3://{bucket}/d"
    if wrong == "bucket":
        url = "s3://first-hour-not-there/d"
    elif wrong == "endpoint":
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    else:
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    refused = run(env, "upload", "tests.cli.sources:marked", url, "--workers", "0", check=False)
    assert refused.returncode == 1, refused.stderr
    said = {"bucket": "bucket 'first-hour-not-there' does not exist", "endpoint": "127.0.0.1",
            "secret": "access denied"}[wrong]
    assert said in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert not marker.exists()
    if wrong == "bucket":  # the same source, where the bucket is, is built and uploaded
        run({**env, "SOURCE_BUILT_MARKER": str(marker)}, "upload", "tests.cli.sources:marked", f"s3://{bucket}/d",
            "--workers", "0", "--quiet")
        assert marker.read_text() == "built"


def test_ctrl_c_during_an_upload_says_the_same_command_resumes_it(env, s3):
    _, bucket = s3
    stopped = run(env, "upload", "tests.cli.sources:interrupted", f"s3://{bucket}/i", "--workers", "0",
                  check=False)
    assert stopped.returncode == 130
    assert stopped.stderr.strip().splitlines()[-1] == (
        "remote-loader: interrupted: the shards written are kept, and the same command again resumes the upload")


def test_one_shard_and_one_sample_are_said_in_the_singular(env, s3, tmp_path):
    _, bucket = s3
    url = f"s3://{bucket}/one"
    run(env, "upload", "tests.cli.sources:twenty", url, "--workers", "0", "--quiet")
    assert run(env, "verify", url, "--quiet").stdout == "1 of 1 shard ok\n"
    tars = tmp_path / "tars"
    _local_tars(tars, count=1)
    assert run(env, "index", str(tars), "--quiet").stdout == f"indexed 3 samples in 1 shard at {tars}\n"


def _in_process(env, monkeypatch, capsys):
    """``run`` for ``remote_loader.cli.main`` called in this process, with the same environment."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def command(*args, check=True):
        capsys.readouterr()
        status = main(list(args))
        out, err = capsys.readouterr()
        if check:
            assert status == 0, err
        return subprocess.CompletedProcess(list(args), status, out, err)

    return command


@pytest.mark.parametrize("backend", ["boto3", "minio"])
@pytest.mark.parametrize("bucket, reason", [
    ("ab", "'ab' has 2 characters"),
    ("x" * 64, f"'{'x' * 64}' has 64 characters"),
    ("Bad_Name", "'Bad_Name' holds 'B', '_', 'N'"),
    ("-dash", "'-dash' begins with '-'"),
])
def test_a_bucket_name_s3_does_not_allow_is_refused_with_the_rule(env, backend, bucket, reason, monkeypatch, capsys):
    # The first name runs the console script in a subprocess, as a user does, with each client; the
    # others call the same main() in this process: only the interpreter's start (1 s a command) is left out.
    command = (lambda *args, check=True: run(env, *args, check=check)) if bucket == "ab" else (
        _in_process(env, monkeypatch, capsys))
    rule = "S3 bucket names have 3-63 characters: lowercase letters, digits, dots and hyphens"
    refused = command("upload", "tests.cli.sources:twenty", f"s3://{bucket}/d", "--workers", "0",
                      "--backend", backend, check=False)
    assert refused.returncode == 1 and reason in refused.stderr and rule in refused.stderr, refused.stderr
    assert "--create-bucket" not in refused.stderr  # the option cannot make it
    made = command("upload", "tests.cli.sources:twenty", f"s3://{bucket}/d", "--workers", "0",
                   "--create-bucket", "--backend", backend, check=False)
    assert made.returncode == 1 and reason in made.stderr and rule in made.stderr, made.stderr
    assert len(made.stderr.strip().splitlines()) == 1, made.stderr
    read = command("info", f"s3://{bucket}/d", "--backend", backend, check=False)
    assert read.returncode == 1 and reason in read.stderr and rule in read.stderr, read.stderr


@pytest.mark.parametrize("typed, meant", [
    ("s3:/datasets/guide", "s3://datasets/guide"),
    ("s3:datasets/guide", "s3://datasets/guide"),
    ("s3:///datasets/guide", "s3://datasets/guide"),
    ("s3//datasets/guide", "s3://datasets/guide"),
    ("s3:/KEY:hunter2@datasets/guide", "s3://***@datasets/guide"),
    ("s3:/KEY:hunter2/x+y@datasets/guide", "s3://***@datasets/guide"),  # a secret with a slash
])
def test_a_mistyped_s3_url_gets_the_url_it_meant(env, typed, meant):
    refused = run(env, "info", typed, check=False)
    assert refused.returncode == 2 and f"did you mean {meant}?" in refused.stderr, refused.stderr
    assert "hunter2" not in refused.stderr


def test_an_s3_url_with_no_environment_names_the_endpoint_variable_too(tmp_path):
    bare = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MINIO_"))}
    bare["HOME"] = str(tmp_path)  # no ~/.aws either
    refused = run(bare, "info", "s3://datasets/guide", check=False)
    assert refused.returncode == 1, refused.stderr
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        assert name in refused.stderr, refused.stderr
