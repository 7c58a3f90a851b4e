"""S3 servers for the tests: SeaweedFS (embedded), moto's server, and an external endpoint.

Set ``REMOTE_LOADER_TEST_ENDPOINT`` (with ``REMOTE_LOADER_TEST_ACCESS_KEY`` and
``REMOTE_LOADER_TEST_SECRET_KEY``, default ``minioadmin``) to run the storage and
round-trip tests against another server too, such as the MinIO of ``localstack/``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from remote_loader.testing.processes import spawn_tied


@dataclass(frozen=True)
class S3Target:
    """One S3 server the tests can talk to."""

    name: str
    endpoint_url: str
    access_key: str
    secret_key: str = field(repr=False)
    checks_signatures: bool = True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Poll ``url`` until it answers any HTTP status; fail if ``process`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server process exited with {process.returncode} before answering {url}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answered
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)  # polling readiness, not synchronising on time
    raise RuntimeError(f"server did not answer {url} within {timeout} s")


class ProcessServer:
    """An S3 server process on a free loopback port, stopped by its PID."""

    name = ""
    access_key, secret_key, checks_signatures = "key", "secret", False

    def __init__(self, log_dir: Path) -> None:
        self.port, self.log_dir = free_port(), log_dir
        self.log = (log_dir / f"{self.name}.log").open("ab")
        # Tied to this process: a test run interrupted or killed outright does not leave it running.
        self.process = spawn_tied(self.command(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(f"http://127.0.0.1:{self.port}/", self.process)

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def target(self) -> S3Target:
        return S3Target(self.name, f"http://127.0.0.1:{self.port}", self.access_key, self.secret_key,
                        checks_signatures=self.checks_signatures)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


class MotoServer(ProcessServer):
    """moto's S3 server."""

    name, access_key, secret_key = "moto", "moto-key", "moto-secret"

    def command(self) -> list[str]:
        return [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(self.port)]


class LocalBucketServer(ProcessServer):
    """localbucket, a minimal S3 server (no multipart-upload listing, no signature checks)."""

    name = "localbucket"

    def command(self) -> list[str]:
        data = self.log_dir / "data"
        data.mkdir(exist_ok=True)
        return [str(Path(sys.executable).with_name("localbucket")), "--host", "127.0.0.1", "--port", str(self.port),
                str(data)]


def external_target() -> S3Target | None:
    endpoint = os.environ.get("REMOTE_LOADER_TEST_ENDPOINT")
    if not endpoint:
        return None
    return S3Target(
        "external",
        endpoint,
        os.environ.get("REMOTE_LOADER_TEST_ACCESS_KEY", "minioadmin"),
        os.environ.get("REMOTE_LOADER_TEST_SECRET_KEY", "minioadmin"),
    )


def remove_bucket(target: S3Target, bucket: str) -> None:
    """Empty and delete a test's bucket on a server the tests do not own (an external one),
    through the SDK directly: the library has no call to delete buckets."""
    import boto3

    sdk = boto3.client("s3", endpoint_url=target.endpoint_url, aws_access_key_id=target.access_key,
                       aws_secret_access_key=target.secret_key, region_name="us-east-1")
    try:
        for page in sdk.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for upload in page.get("Uploads", []):
                sdk.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        for page in sdk.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                sdk.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        sdk.delete_bucket(Bucket=bucket)
    finally:
        sdk.close()
