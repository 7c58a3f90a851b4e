"""A fault-injecting HTTP proxy on 127.0.0.1 between an S3 client and a real S3 server.

Each request is forwarded unchanged (the Host header too, so signatures stay valid) and
may meet a fault: a connection reset before the answer or in the middle of the body, a
500, a 503 SlowDown, a delay, a truncated body (short read), flipped bytes in the body, or a
body that stops half-way for ``delay`` seconds (or until the proxy closes) before a reset,
or a server that ignores ``Range`` and answers with the whole object (``ignore_range``: the
header is dropped on the way, so only an upstream that checks no signature, moto, answers),
or a request body with a byte flipped on the way to the server (``flip_body``: a PUT or a
part damaged in transit; bodies go unsigned, so the signature still holds), or a range
answered 416 though it lies inside the object (``refuse_range``: a store that answers wrongly),
or a request held before it is forwarded until the test calls ``release()``, or for a minute
(``hold``: a store that has not answered yet, for as long as a test needs; ``held`` counts
those waiting), or a whole answer with half the bytes asked for, its length saying so
(``short_answer``: a store or proxy that answers wrongly), or a bare 429 (``too_many_requests``:
a rate limit with no S3 body), or an answer to HEAD without its ``Content-Length``
(``head_no_length``), or a body sent a byte every ``delay`` seconds (``trickle``: a server
that never stops, so never meets a read timeout).
Whether a request meets a fault, and which, depends only on the seed, the request
(method, path, query, range; a presigned URL's ``X-Amz-*`` parameters left out: they hold
the time of signing) and how many times that same request was seen before, so a run is
reproducible whatever the threads' timing. With ``each_first``, the first requests that may
meet faults meet each kind of ``rates`` once, in turn, before the draws begin: every kind is
met, whatever the objects' names (an upload's are random).
"""

from __future__ import annotations

import hashlib
import http.client
import random
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULTS = ("reset_before", "reset_mid_body", "error_500", "slow_down_503", "delay", "truncate", "flip", "stall_mid_body")
"""The faults a reader heals by retrying or fetching again."""
ALL_FAULTS = (*FAULTS, "ignore_range", "flip_body", "refuse_range", "hold", "short_answer", "too_many_requests",
              "head_no_length", "trickle")
_HOLD = 60.0  # seconds a request is held at most (a test that never releases it fails, never hangs)
_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
              b"<Message>Reduce your request rate.</Message></Error>")
_INVALID_RANGE = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidRange</Code>'
                  b"<Message>The requested range is not satisfiable</Message></Error>")
_INTERNAL = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>injected</Message></Error>'
)


def _unsigned(path: str) -> str:
    """``path`` without a presigned URL's ``X-Amz-*`` query parameters (the time of signing
    among them), so that a request asked again is the same request."""
    if "?" not in path:
        return path
    base, query = path.split("?", 1)
    kept = [p for p in query.split("&") if not p.lower().startswith("x-amz-")]
    return f"{base}?{'&'.join(kept)}" if kept else base


class FaultProxy:
    """Forward to ``upstream`` (``http://host:port``) with faults at ``rates`` (kind -> probability).

    Only requests whose method is in ``methods`` and whose path holds ``paths`` meet faults
    (with ``first_only="request"``, only the first time each request is made; with
    ``"object"``, only the first request of each method for each object; with ``ranges``,
    only those whose ``Range`` starts so).
    ``injected`` counts faults by kind; ``requests`` counts every forwarded request and
    ``connections`` every client connection accepted; ``bodies`` lists, for each request
    with a body, its method, its length and whether it waited for ``100 Continue``;
    ``payload_hashes`` the ``x-amz-content-sha256`` header of each (None without one).
    """

    def __init__(
        self,
        upstream: str,
        rates: dict[str, float],
        *,
        seed: int = 0,
        methods: tuple[str, ...] = ("GET",),
        delay: float = 0.05,
        paths: str = "",
        each_first: bool = False,
        first_only: str | None = None,
        ranges: str = "",
    ) -> None:
        unknown = set(rates) - set(ALL_FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rates, self.seed, self.methods, self.delay, self.paths = rates, seed, methods, delay, paths
        self.first_only, self.ranges = first_only, ranges
        self._first = [kind for kind in ALL_FAULTS if rates.get(kind, 0.0) > 0] if each_first else []
        self.injected: Counter[str] = Counter()
        self.requests = self.connections = 0
        self.bodies: list[tuple[str, int, bool]] = []
        self.payload_hashes: list[str | None] = []
        self._seen: Counter[str] = Counter()
        self._objects: Counter[str] = Counter()  # requests by method and object, whatever their range
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closing = threading.Event()
        self._released = threading.Event()
        self.held = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy._connections.add(self.connection)
                    proxy.connections += 1

            def finish(self) -> None:
                with proxy._lock:
                    proxy._connections.discard(self.connection)
                super().finish()

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = False
        self.server.block_on_close = True  # close() waits for every connection thread
        self.thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)
        self.thread.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def seen(self, method: str, path: str, range_: str = "") -> int:
        """How many times this request came in (``path`` with its query, as sent, but for
        the ``X-Amz-*`` parameters of a presigned URL)."""
        with self._lock:
            return self._seen[f"{method} {_unsigned(path)} {range_}"]

    def _fault(self, handler: BaseHTTPRequestHandler) -> str | None:
        request = f"{handler.command} {_unsigned(handler.path)} {handler.headers.get('Range', '')}"
        with self._lock:
            self.requests += 1
            attempt = self._seen[request]
            self._seen[request] += 1
            obj = f"{handler.command} {_unsigned(handler.path)}"
            self._objects[obj] += 1
            later = {"request": attempt > 0, "object": self._objects[obj] > 1}
        if handler.command not in self.methods or self.paths not in handler.path or later.get(self.first_only, False):
            return None
        if not handler.headers.get("Range", "").startswith(self.ranges):
            return None
        with self._lock:
            if self._first:
                kind = self._first.pop(0)
                self.injected[kind] += 1
                return kind
        digest = hashlib.sha256(f"{self.seed}|{request}|{attempt}".encode()).digest()
        draw = random.Random(digest).random()
        for kind in ALL_FAULTS:
            rate = self.rates.get(kind, 0.0)
            if draw < rate:
                with self._lock:
                    self.injected[kind] += 1
                return kind
            draw -= rate
        return None

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        if length:
            with self._lock:
                self.bodies.append(
                    (handler.command, length, handler.headers.get("Expect", "").lower() == "100-continue")
                )
                self.payload_hashes.append(handler.headers.get("x-amz-content-sha256"))
        fault = self._fault(handler)
        if fault == "reset_before":
            return self._reset(handler)
        if fault == "refuse_range" and not handler.headers.get("Range"):
            fault = None
        if fault == "too_many_requests":
            handler.send_response(429)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        if fault in ("error_500", "slow_down_503", "refuse_range"):
            status, payload = {"error_500": (500, _INTERNAL), "slow_down_503": (503, _SLOW_DOWN),
                               "refuse_range": (416, _INVALID_RANGE)}[fault]
            handler.send_response(status)
            handler.send_header("Content-Type", "application/xml")
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            if handler.command != "HEAD":  # an answer to HEAD has headers only
                handler.wfile.write(payload)
            return
        if fault == "delay":
            time.sleep(self.delay)  # the injected fault itself: a slow answer
        if fault == "hold":
            with self._lock:
                self.held += 1
                released = self._released
            released.wait(_HOLD)
            with self._lock:
                self.held -= 1
        if fault == "flip_body" and body:
            corrupt = bytearray(body)
            corrupt[len(corrupt) // 2] ^= 0xFF
            body = bytes(corrupt)
        upstream = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            dropped = {"connection", "range"} if fault == "ignore_range" else {"connection"}
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in dropped}
            upstream.request(handler.command, handler.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        if fault == "flip" and len(data) > 0 and response.status in (200, 206):
            corrupt = bytearray(data)
            corrupt[len(corrupt) // 2] ^= 0xFF
            data = bytes(corrupt)
        handler.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("connection", "transfer-encoding", "content-length"):
                handler.send_header(key, value)
        if handler.command == "HEAD":  # the object's length, as upstream gave it; no body
            if fault != "head_no_length":
                handler.send_header("Content-Length", response.getheader("Content-Length") or "0")
            handler.close_connection = fault == "head_no_length"  # no length: the answer ends with the connection
            handler.end_headers()
            return
        if fault == "short_answer" and len(data) > 1 and response.status in (200, 206):
            data = data[: len(data) // 2]
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if fault == "trickle" and response.status in (200, 206):
            try:
                for k in range(len(data)):
                    handler.wfile.write(data[k : k + 1])
                    handler.wfile.flush()
                    if self._closing.wait(self.delay):
                        break
            except OSError:
                pass  # the client gave up
            return self._reset(handler)
        cut = fault in ("truncate", "reset_mid_body", "stall_mid_body")
        if cut and len(data) > 1 and response.status in (200, 206):
            handler.wfile.write(data[: len(data) // 2])
            handler.wfile.flush()
            if fault == "stall_mid_body":
                self._closing.wait(self.delay)  # the injected fault itself: a server that stops sending
            if fault in ("reset_mid_body", "stall_mid_body"):
                return self._reset(handler)
            handler.close_connection = True  # an orderly close: the client sees a short body
            return
        handler.wfile.write(data)

    @staticmethod
    def _reset(handler: BaseHTTPRequestHandler) -> None:
        # SO_LINGER 0: close sends RST, as a dropped connection does.
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        handler.close_connection = True
        handler.connection.close()

    def release(self, hold_again: bool = False) -> None:
        """Forward the requests held (``hold``) and, from now on, those that would be; with
        ``hold_again``, hold those that come from now on."""
        with self._lock:
            self._released.set()
            if hold_again:
                self._released = threading.Event()

    def close(self) -> None:
        """Stop serving, drop open client connections and wait for every proxy thread."""
        self._closing.set()
        with self._lock:
            self._released.set()
        self.server.shutdown()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the other side
        self.server.server_close()
        self.thread.join()
