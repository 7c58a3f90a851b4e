"""The embedded server: stopping it always ends it, and a port already taken is refused."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from remote_loader import ConfigError
from remote_loader.testing.server import EmbeddedS3

# Stops the server while it is SIGSTOPped (so stop() waits), and a thread delivers Ctrl-C
# once the main thread is inside that wait: the second Ctrl-C of an impatient user.
_INTERRUPTED_STOP = """
import os, signal, sys, threading
from remote_loader.testing.server import EmbeddedS3

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
        with pytest.raises(ConfigError, match=rf"ports in use on 127.0.0.1: s3 \({port}\)"):
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
