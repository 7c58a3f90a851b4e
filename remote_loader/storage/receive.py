"""Receive a GET's body into a buffer the caller owns, without a temporary copy."""

from __future__ import annotations

import http.client
from collections.abc import Callable
from typing import Any

BODY_ERRORS = (TimeoutError, http.client.HTTPException)
"""What ``receive_into`` raises past the SDK, besides ``ConnectionError``: a socket's read
timeout and a body cut short. A backend counts them among its transient errors."""


def _fill(read: Callable[[memoryview], int | None], out: memoryview) -> int:
    filled = 0
    while filled < len(out):
        count = read(out[filled:])
        if not count:
            break
        filled += count
    return filled


def receive_into(response: Any, out: memoryview) -> int:
    """Fill ``out`` from a urllib3 response's body and return how many bytes came.

    urllib3's ``readinto`` reads into a new bytes object as long as ``out`` and copies it
    over (urllib3 issue 1540): an 8 MiB temporary for every ranged GET, made in the
    fetcher's threads. Freed, such blocks raise glibc's mmap threshold and then stay in
    each thread's malloc arena: ~100 MB of a reading process's peak, and a copy of every
    byte. The ``http.client`` response under urllib3 reads from the socket into ``out``
    itself; at the body's end the connection goes back to urllib3's pool, and a body cut
    short raises ``http.client.IncompleteRead`` as urllib3 would raise its own. A body of
    another kind, or one to decode (``Content-Encoding``), is read through urllib3.
    """
    body = getattr(response, "_fp", None)
    encoded = getattr(response, "headers", {}).get("Content-Encoding", "identity") != "identity"
    if encoded or not isinstance(body, http.client.HTTPResponse):
        return _fill(response.readinto, out)
    filled = _fill(body.readinto, out)
    if filled < len(out) and body.length:  # the connection ended before the body's Content-Length
        raise http.client.IncompleteRead(b"", body.length)
    if body.isclosed():
        response.release_conn()  # the whole body was read: the connection can serve the next request
    return filled
