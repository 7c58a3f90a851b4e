"""What a new user meets in the first hour with the command line: a bucket that does not
exist (and the option that makes it), Ctrl-C during an upload (and how to go on), counts
said in words."""

from __future__ import annotations

import os

import pytest

from remote_loader.testing.synthetic import SyntheticImages
from tests.cli.test_cli import run


class _InterruptedAt(SyntheticImages):
    """Ctrl-C arrives while sample 5 is read (an upload with ``--workers 0`` reads it in the CLI's process)."""

    def __getitem__(self, index: int):  # type: ignore[override]
        if index == 5:
            raise KeyboardInterrupt
        return super().__getitem__(index)


def interrupted() -> SyntheticImages:
    return _InterruptedAt(20, size=(16, 12))


def twenty() -> SyntheticImages:
    return SyntheticImages(20, size=(16, 12))


@pytest.fixture
def env(seaweed):
    return {**os.environ, **seaweed.env()}


def test_an_upload_to_a_bucket_that_does_not_exist_says_how_to_make_it_and_the_option_does(env):
    url = "s3://first-hour-missing/d"
    refused = run(env, "upload", "tests.cli.test_first_hour:twenty", url, "--workers", "0", check=False)
    assert refused.returncode == 1
    assert "bucket 'first-hour-missing' does not exist" in refused.stderr
    assert refused.stderr.rstrip().endswith("(--create-bucket makes it)")
    run(env, "upload", "tests.cli.test_first_hour:twenty", url, "--workers", "0", "--create-bucket")
    assert "samples   20 in 1 shard," in run(env, "info", url).stdout


def test_ctrl_c_during_an_upload_says_the_same_command_resumes_it(env, s3):
    _, bucket = s3
    stopped = run(env, "upload", "tests.cli.test_first_hour:interrupted", f"s3://{bucket}/i", "--workers", "0",
                  check=False)
    assert stopped.returncode == 130
    assert stopped.stderr.strip().splitlines()[-1] == (
        "remote-loader: interrupted: the shards written are kept, and the same command again resumes the upload")
