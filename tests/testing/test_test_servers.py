"""The suite's own servers (moto) end with the test run that started them, however it ends:
an interrupted or killed ``make test`` leaves no server running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from tests.testing.test_server import _alive

_START_AND_WAIT = """
import sys
from pathlib import Path
from tests.servers import MotoServer
server = MotoServer(Path(sys.argv[1]))
print(server.process.pid, flush=True)
sys.stdin.readline()
"""


def test_a_moto_server_ends_when_the_run_that_started_it_is_killed(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", _START_AND_WAIT, str(tmp_path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    pid = int(process.stdout.readline())
    try:
        assert _alive(pid)
        process.kill()  # SIGKILL: no finally, no atexit, no fixture teardown
        process.communicate()
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            threading.Event().wait(0.05)  # polling for the server to end on its parent's death
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)


def test_the_fault_proxy_takes_a_request_signed_again_for_the_same_request(seaweed):
    """A presigned URL holds the time it was signed: the same range asked again a second
    later is the same request to the proxy, so its faults follow the requests, not the clock
    (a manifest fetch through it met 7 to 19 faults from one run to the next)."""
    import http.client

    from tests.faultproxy import FaultProxy

    proxy = FaultProxy(seaweed.endpoint_url, {})
    try:
        host, port = proxy.endpoint_url.removeprefix("http://").split(":")
        for signed in ("20260101T000000Z", "20260101T000001Z"):
            connection = http.client.HTTPConnection(host, int(port), timeout=30)
            connection.request("GET", f"/b/k?X-Amz-Date={signed}&X-Amz-Signature={signed[-3:]}&part=1",
                               headers={"Range": "bytes=0-9"})
            connection.getresponse().read()
            connection.close()
        assert proxy.seen("GET", "/b/k?part=1", "bytes=0-9") == 2
    finally:
        proxy.close()
