"""Receive a GET's body into a buffer the caller owns, without a temporary copy, in bounded time."""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

BODY_ERRORS = (TimeoutError, http.client.HTTPException)
"""What ``receive_into`` raises past the SDK, besides ``ConnectionError``: a socket's read
timeout, a body that comes too slowly and a body cut short. A backend counts them among its
transient errors."""
SLOWEST_BODY = 32 * 1024
"""Bytes a second under which a body is taken for a server that stalls (one that sends a byte
now and then never meets a read timeout): a body of ``n`` bytes must come within the read
timeout plus ``n / SLOWEST_BODY`` seconds, or its GET fails and is retried."""


class _Deadlines:
    """Shuts down the socket of a body still arriving past its deadline, from one thread of
    the process (a read blocked on a socket that gets a byte now and then returns no other
    way); ``watch`` and ``done`` bracket a body's reads. Made again in a forked process."""

    def __init__(self) -> None:
        self._after_fork()

    def _after_fork(self) -> None:
        """Anew in a forked process: a lock another thread held at the fork stays held there."""
        self._pid = -1
        self._lock = threading.Lock()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._wake = threading.Condition(threading.Lock())
        self._due: dict[int, tuple[float, socket.socket]] = {}
        self._fired: set[int] = set()
        self._next = 0
        threading.Thread(target=self._run, name="remote_loader-body-deadlines", daemon=True).start()

    def watch(self, sock: socket.socket, deadline: float) -> int:
        with self._lock:
            if self._pid != os.getpid():
                self._start()
        with self._wake:
            if all(deadline < due for due, _ in self._due.values()):  # the thread waits for a later one, or none
                self._wake.notify()
            self._next += 1
            self._due[self._next] = (deadline, sock)
            return self._next

    def done(self, token: int) -> bool:
        """Stop watching; whether the deadline passed (the socket was shut down)."""
        with self._wake:
            self._due.pop(token, None)
            if token in self._fired:
                self._fired.discard(token)
                return True
            return False

    def _run(self) -> None:
        with self._wake:
            while True:
                if not self._due:
                    self._wake.wait()
                    continue
                token, (deadline, sock) = min(self._due.items(), key=lambda item: item[1][0])
                left = deadline - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                del self._due[token]
                self._fired.add(token)
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns: the body ends short
                except OSError:
                    pass  # closed meanwhile


_DEADLINES = _Deadlines()
if hasattr(os, "register_at_fork"):  # Windows has no fork
    os.register_at_fork(after_in_child=_DEADLINES._after_fork)


def _fill(read: Callable[[memoryview], int | None], out: memoryview) -> int:
    filled = 0
    while filled < len(out):
        count = read(out[filled:])
        if not count:
            break
        filled += count
    return filled


def _socket_of(body: http.client.HTTPResponse) -> socket.socket | None:
    """The socket an ``http.client`` response reads from (a ``socket.SocketIO`` under its
    buffered reader), or None."""
    sock = getattr(getattr(body.fp, "raw", None), "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def receive_into(response: Any, out: memoryview, read_timeout: float | None = None) -> int:
    """Fill ``out`` from a urllib3 response's body and return how many bytes came; with
    ``read_timeout``, TimeoutError where the body comes slower than ``SLOWEST_BODY``.

    urllib3's ``readinto`` reads into a new bytes object as long as ``out`` and copies it
    over (urllib3 issue 1540): an 8 MiB temporary for every ranged GET, made in the
    fetcher's threads. Freed, such blocks raise glibc's mmap threshold and then stay in
    each thread's malloc arena: ~100 MB of a reading process's peak, and a copy of every
    byte. The ``http.client`` response under urllib3 reads from the socket into ``out``
    itself; at the body's end the connection goes back to urllib3's pool, and a body cut
    short raises ``http.client.IncompleteRead`` as urllib3 would raise its own. A body of
    another kind, or one to decode (``Content-Encoding``), is read through urllib3 (a read
    timeout bounds each of its reads only).
    """
    body = getattr(response, "_fp", None)
    encoded = getattr(response, "headers", {}).get("Content-Encoding", "identity") != "identity"
    if encoded or not isinstance(body, http.client.HTTPResponse):
        return _fill(response.readinto, out)
    sock = _socket_of(body) if read_timeout is not None else None
    token = None
    if sock is not None and read_timeout is not None:
        token = _DEADLINES.watch(sock, time.monotonic() + read_timeout + len(out) / SLOWEST_BODY)
    try:
        filled = _fill(body.readinto, out)
    finally:
        late = token is not None and _DEADLINES.done(token)
    if late:
        raise TimeoutError(f"the body came at under {SLOWEST_BODY // 1024} KiB/s: its GET is given up")
    if filled < len(out) and body.length:  # the connection ended before the body's Content-Length
        raise http.client.IncompleteRead(b"", body.length)
    if body.isclosed():
        response.release_conn()  # the whole body was read: the connection can serve the next request
    return filled


def read_body(response: Any, read_timeout: float | None) -> bytes:
    """A urllib3 response's whole body, received as ``receive_into`` receives it (in bounded
    time) where its length is known; read through urllib3 otherwise (chunked, encoded)."""
    body = getattr(response, "_fp", None)
    length = body.length if isinstance(body, http.client.HTTPResponse) else None
    encoded = getattr(response, "headers", {}).get("Content-Encoding", "identity") != "identity"
    if length is None or encoded:
        return bytes(response.read())
    out = bytearray(length)
    filled = receive_into(response, memoryview(out), read_timeout)
    return bytes(out) if filled == length else bytes(out[:filled])
