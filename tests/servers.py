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


class MotoServer:
    """moto's S3 server on a free loopback port, stopped by its PID."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.log = (log_dir / "moto.log").open("ab")
        moto = Path(sys.executable).with_name("moto_server")
        self.process = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_http(f"http://127.0.0.1:{self.port}/", self.process)

    @property
    def target(self) -> S3Target:
        return S3Target("moto", f"http://127.0.0.1:{self.port}", "moto-key", "moto-secret", checks_signatures=False)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


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
