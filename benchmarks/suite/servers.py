"""The S3 servers the suite measures on, each started on 127.0.0.1 and stopped by PID."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from systems import Target

from remote_loader.testing.processes import spawn_tied
from remote_loader.testing.server import EmbeddedS3, free_base_port

BUCKET = "bench"


@contextmanager
def seaweedfs() -> Iterator[tuple[Target, int]]:
    with EmbeddedS3(buckets=[BUCKET]) as server:
        assert server.pid is not None
        yield Target(server.endpoint_url, BUCKET, server.access_key, server.secret_key), server.pid


@contextmanager
def localbucket() -> Iterator[tuple[Target, int]]:
    binary = shutil.which("localbucket", path=str(Path(sys.executable).parent)) or "localbucket"
    port = free_base_port()
    data = tempfile.mkdtemp(prefix="bench-localbucket-")
    process = spawn_tied([binary, "--host", "127.0.0.1", "--port", str(port), data],  # no orphan if the suite is killed
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:  # poll until the port answers (not a timing assumption)
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except urllib.error.HTTPError:
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"localbucket did not start on {url}") from None
                time.sleep(0.1)
        target = Target(url, BUCKET, "bench", "bench-secret")
        target.boto3().create_bucket(Bucket=BUCKET)
        yield target, process.pid
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=15)
        shutil.rmtree(data, ignore_errors=True)


@contextmanager
def external(endpoint: str) -> Iterator[tuple[Target, int | None]]:
    """An endpoint someone else runs: credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY."""
    target = Target(endpoint, os.environ.get("BENCH_BUCKET", BUCKET), os.environ["AWS_ACCESS_KEY_ID"],
                    os.environ["AWS_SECRET_ACCESS_KEY"])
    client = target.boto3()
    try:
        client.create_bucket(Bucket=target.bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    yield target, None


SHAPER = Path(__file__).resolve().parents[1] / "shaper.py"


@contextmanager
def shaped(target: Target, profile: str) -> Iterator[Target]:
    """``target`` seen through ``benchmarks/shaper.py`` under ``profile`` (latency and a
    per-connection bandwidth cap); the relay is stopped by its PID."""
    upstream = target.endpoint.removeprefix("http://")
    relay = subprocess.Popen([sys.executable, str(SHAPER), "--upstream", upstream, "--profile", profile],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert relay.stdout is not None
        port = relay.stdout.readline().split()[1]  # the relay says where it listens once it does
        yield dataclasses.replace(target, endpoint=f"http://127.0.0.1:{port}")
    finally:
        os.kill(relay.pid, signal.SIGTERM)
        relay.wait(timeout=30)
