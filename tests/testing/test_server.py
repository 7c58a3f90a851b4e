"""The embedded server: stopping it always ends it, and a port already taken is refused."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

from remote_loader import ConfigError, RetryConfig
from remote_loader.storage.retrying import Retry, RetryingStore
from remote_loader.testing.processes import cpu_seconds
from remote_loader.testing.server import EmbeddedS3

# Stops the server while it is SIGSTOPped (so stop() waits), and a thread delivers Ctrl-C
# once the main thread is inside that wait: the second Ctrl-C of an impatient user.
_INTERRUPTED_STOP = """
import os, signal, sys, threading
from remote_loader.testing import server as embedded
from remote_loader.testing.server import EmbeddedS3

embedded.STOP_GRACE = 600  # the Ctrl-C lands in the wait on SIGTERM, however late this thread runs
server = EmbeddedS3().start()
print(server.pid, server.data_dir, flush=True)
sys.stdin.readline()  # the test has SIGSTOPped the server
main = threading.main_thread().ident

def waiting_in_stop():
    frame = sys._current_frames().get(main)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("subprocess.py"):
            return True
        frame = frame.f_back
    return False

def interrupt():
    while not waiting_in_stop():
        threading.Event().wait(0.01)  # polling for the main thread's state
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt, daemon=True).start()
try:
    server.stop()
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_a_stop_interrupted_by_ctrl_c_still_ends_the_server():
    process = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_STOP], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        assert process.stdin is not None and process.stdout is not None
        pid_text, data_dir = process.stdout.readline().split()
        pid = int(pid_text)
        os.killpg(pid, signal.SIGSTOP)  # a server slow to stop: stop() waits
        process.stdin.write("go\n")
        process.stdin.flush()
        out, _ = process.communicate(timeout=60)
        assert "interrupted" in out  # the Ctrl-C still reaches the caller...
        assert not _alive(pid)  # ...and the server is gone, not orphaned with its ports bound
        assert not os.path.exists(data_dir)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if pid is not None and _alive(pid):
            os.killpg(pid, signal.SIGKILL)


def test_a_port_in_use_is_refused_not_shared_with_another_server():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        # The ports derived from it (master, admin) may be another test's at the moment: they are named too.
        with pytest.raises(ConfigError, match=rf"ports in use on 127.0.0.1: (\w+ \(\d+\), )*s3 \({port}\)"):
            EmbeddedS3(port=port).start()


@pytest.mark.parametrize("port", [1, 70000, "9000"])
def test_a_port_outside_the_range_is_refused(port):
    with pytest.raises(ConfigError, match="port must be an integer in"):
        EmbeddedS3(port=port).start()  # type: ignore[arg-type]


def test_serve_refuses_a_taken_port_in_one_line():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "remote_loader.cli", "serve", "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"cannot serve S3 on port {port}" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "remote_loader.cli", "serve", "--port", "1"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "port must be an integer in" in out.stderr and "-2" not in out.stderr


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on, read from /proc (no tool needed)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_server_listens_on_the_ports_it_names_and_no_other(seaweed):
    assert listening_ports(seaweed.pid) == set(seaweed.ports.values())
    assert len(seaweed.ports) == 10 and seaweed.ports["s3"] == seaweed.port


def _http(method: str, url: str, body: bytes | None = None, context=None) -> tuple[int, bytes]:
    """The status and body of a request; 0 where the port dropped it (plain HTTP on a TLS
    port, or TLS without the client certificate it asks for)."""
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        try:
            return error.code, error.read()
        except ConnectionError:  # refused, then the connection reset while its body was read (seen: a 400)
            return error.code, b""
    except (urllib.error.URLError, ConnectionError, ssl.SSLError):
        return 0, b""


def test_only_the_s3_port_serves_data_and_only_with_credentials(seaweed, s3):
    store, bucket = s3
    store.put(bucket, "dir/secret.bin", b"SECRET-BYTES" * 100)
    s3_url = f"http://127.0.0.1:{seaweed.port}"
    assert _http("GET", f"{s3_url}/{bucket}/dir/secret.bin")[0] == 403  # anonymous
    for name, port in seaweed.ports.items():
        if name == "s3" or name.endswith("gRPC"):
            continue
        base = f"http://127.0.0.1:{port}"
        for method, path, body in [
            ("GET", f"/buckets/{bucket}/dir/secret.bin", None),
            ("GET", f"/buckets/{bucket}/", None),
            ("GET", "/buckets/", None),
            ("POST", f"/buckets/{bucket}/dir/evil.bin", b"evil"),
            ("PUT", f"/buckets/{bucket}/dir/secret.bin", b"evil"),
            ("DELETE", f"/buckets/{bucket}/dir/secret.bin", None),
        ]:
            status, answer = _http(method, base + path, body)
            assert status == 0 or status >= 400, (name, method, path, status, answer[:200])
            assert b"SECRET" not in answer
    # The master's HTTP port: its admin calls and status pages answer no one without the
    # server's client certificate, over HTTP or HTTPS; the volume server's admin calls want a token.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    for service, path in [("master", f"/col/delete?collection={bucket}"), ("master", "/vol/grow?count=1"),
                          ("master", "/vol/status"), ("master", "/dir/status"), ("master", "/dir/assign"),
                          ("volume", "/admin/volume/delete?volume=1"), ("volume", "/admin/assign_volume?volume=9"),
                          ("volume", "/stats/disk"), ("volume", "/ui/index.html")]:
        port = seaweed.ports[service]
        for scheme in ("http", "https"):
            url = f"{scheme}://127.0.0.1:{port}{path}"
            status, answer = _http("GET", url, context=context if scheme == "https" else None)
            assert status == 0 or status >= 400, (service, path, scheme, status, answer[:200])
            assert bucket.encode() not in answer
    assert store.get(bucket, "dir/secret.bin") == b"SECRET-BYTES" * 100
    assert [o.key for o in store.list(bucket)] == ["dir/secret.bin"]


def test_the_grpc_ports_refuse_a_connection_without_the_servers_client_certificate(seaweed):
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    for name, port in seaweed.ports.items():
        if not name.endswith("gRPC"):
            continue
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # plain HTTP/2: no answer
            raw.sendall(preface)
            try:
                assert raw.recv(100) == b"", name
            except ConnectionResetError:
                pass
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with pytest.raises(ssl.SSLError, match="CERTIFICATE_REQUIRED|certificate required"):
                with context.wrap_socket(raw) as tls:
                    tls.sendall(preface)
                    tls.recv(100)


def test_cpu_seconds_counts_what_a_process_spent_whatever_its_name():
    """A process named with spaces and a parenthesis (``/proc``'s stat quotes it raw), busy for
    about 0.3 s of CPU, then waiting."""
    burn = ("import time\nopen('/proc/self/comm', 'w').write('a) (b c')\nend = time.process_time() + 0.3\n"
            "while time.process_time() < end: pass\nprint('done', flush=True)\ninput()")
    process = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "done\n"
        spent = cpu_seconds(process.pid)
    finally:
        process.communicate("\n", timeout=10)
    assert 0.3 <= spent < 5


_SERVE_AND_WAIT = """
import sys
from remote_loader.testing.server import EmbeddedS3

server = EmbeddedS3(buckets=["left"]).start()
server.client().put("left", "object", b"DATA")
print(server.pid, server.data_dir, server._sockets, flush=True)
sys.stdin.readline()
"""


def test_what_a_server_killed_outright_leaves_is_removed_at_the_next_start(tmp_path, monkeypatch):
    """SIGKILL gives the process no chance to remove its temporary data (every object, the
    server's TLS key) and sockets; the next server started on the machine removes them, and
    not those of a server still running. The servers here keep their temporary directories
    in one of the test's own, where the servers other tests start at the same time (which
    clean the machine's) cannot remove them first."""
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    running = EmbeddedS3().start()
    pid = None
    try:
        process = subprocess.Popen([sys.executable, "-c", _SERVE_AND_WAIT], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(private)})
        assert process.stdout is not None
        pid_text, data_dir, sockets = process.stdout.readline().split()
        pid = int(pid_text)
        process.kill()  # SIGKILL: no finally, no atexit
        process.communicate()
        assert os.path.isdir(data_dir) and os.path.isdir(sockets)
        EmbeddedS3().start().stop()  # while the server may still be ending, its directories stay
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            threading.Event().wait(0.05)  # polling for the server to end on its parent's death
        assert not _alive(pid)
        assert os.path.isdir(data_dir) and os.path.isdir(sockets)
        with EmbeddedS3() as later:
            assert later.data_dir != data_dir
            assert not os.path.exists(data_dir) and not os.path.exists(sockets)
            assert running.data_dir is not None and os.path.isdir(running.data_dir)
        given = tmp_path / "mine"  # a data directory the user named is never the server's to remove
        with EmbeddedS3(data_dir=str(given)):
            pass
        assert given.is_dir()
    finally:
        running.stop()
        if pid is not None and _alive(pid):  # it ends on its parent's death; by PID if not yet
            os.killpg(pid, signal.SIGKILL)


def test_a_server_that_cannot_act_on_sigterm_is_still_ended_by_stop():
    """A server stopped with SIGSTOP leaves SIGTERM pending: stop() goes on to SIGKILL after its
    grace and reaps the process. The bound is far above the grace and far below the 15 s a stop
    once waited: it tells the escalation from a stop that waits out a long grace, not speed."""
    server = EmbeddedS3().start()
    pid = server.pid
    assert pid is not None
    try:
        os.killpg(pid, signal.SIGSTOP)
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 12  # the grace (1 s), far from 15 s, with room for a busy machine
        assert not os.path.exists(f"/proc/{pid}")  # ended and reaped: not even a zombie is left
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.killpg(pid, signal.SIGKILL)


@pytest.mark.parametrize("stopped_first", [False, True], ids=["stop", "sigstop-then-stop"])
def test_a_stop_then_a_start_on_the_same_data_directory_keeps_every_object(tmp_path, stopped_first):
    """What a stop ends, by SIGTERM or by SIGKILL after the grace (a server that cannot act on
    SIGTERM: SIGSTOPped), the next start on the same data directory serves again, every byte."""
    objects = {f"dir/{i}.bin": os.urandom(size) for i, size in enumerate([0, 1, 1000, 3_000_000])}
    server = EmbeddedS3(data_dir=str(tmp_path / "data"), buckets=["kept"]).start()
    try:
        store = server.client()
        for key, data in objects.items():
            store.put("kept", key, data)
        store.close()
        if stopped_first:
            assert server.pid is not None
            os.killpg(server.pid, signal.SIGSTOP)
        server.stop()
        server.start()
        # Read as the library reads, retried: a volume server just started may answer a first
        # GET with InternalError while it registers its volumes (seen once in a full run).
        raw = server.client()
        store = RetryingStore(raw, Retry(RetryConfig(), raw.endpoint))
        assert {o.key: store.get("kept", o.key) for o in store.list("kept")} == objects
        raw.close()
    finally:
        server.stop()


def test_a_relative_data_directory_is_taken_from_where_the_server_is_started(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with EmbeddedS3(data_dir="rel-data", buckets=["here"]) as server:
        assert server.data_dir == str(tmp_path / "rel-data")
        client = server.client()
        client.put("here", "k", b"v")
        assert client.get("here", "k") == b"v"
        client.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rel-data"]
    assert not (tmp_path / "rel-data" / "rel-data").exists()  # nothing made below it as if it were relative


_DYING_WEED = """#!/bin/sh
echo "  Starting SeaweedFS Mini ..."
echo "F1207 01:10:09.305479 tls.go:261 open tls/ca.crt: no such file or directory"
echo "goroutine 146 [running]:"
for i in $(seq 60); do printf 'github.com/seaweedfs/seaweedfs/weed/glog.stacks(0x0)\\n\\tglog.go:832 +0x85\\n'; done
exit 1
"""


def test_a_server_that_exits_at_start_is_reported_in_one_short_line(tmp_path, monkeypatch):
    from remote_loader import EndpointUnreachable
    from remote_loader.testing import server as embedded

    weed = tmp_path / "weed"
    weed.write_text(_DYING_WEED)
    weed.chmod(0o755)
    monkeypatch.setattr(embedded, "find_weed", lambda: str(weed))
    with pytest.raises(EndpointUnreachable) as caught:
        EmbeddedS3(data_dir=str(tmp_path / "data")).start(timeout=60)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 600, message
    assert message == (
        "embedded S3 server exited at start; its log ends: Starting SeaweedFS Mini ... | F1207 01:10:09.305479"
        f" tls.go:261 open tls/ca.crt: no such file or directory (all of it in {tmp_path}/data/weed.log)"
    )
