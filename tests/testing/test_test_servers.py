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
