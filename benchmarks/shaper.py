"""A network between a loader and its S3 server, on loopback: a TCP relay that delays every
byte by a one-way latency in each direction and caps each connection's bandwidth.

A request then costs a round trip (2 x latency) before its first byte, and a connection
carries at most ``bandwidth`` bytes/s, as a connection to S3 across a network does. Run it
as its own process (so its work does not share the measured loader's interpreter):

    python benchmarks/shaper.py --listen 18000 --upstream 127.0.0.1:9000 --profile s3-same-region

It prints ``ready <port>`` once it listens, and runs until killed. From another benchmark,
``with relayed(endpoint, profile) as (endpoint, pid):`` runs one for the block. With
``--counters FILE`` it keeps, in FILE (two little-endian int64s, ``Counters`` reads them), the
bytes it carried from the server and the HTTP requests it carried to it: what a loader fetched.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHUNK = 256 * 1024
_REQUEST = b" HTTP/1.1\r\n"  # ends every request line a client sends


class Counters:
    """Bytes from the server and requests to it, in a file both the relay and a benchmark map."""

    def __init__(self, path: str | Path, create: bool = False) -> None:
        if create:
            Path(path).write_bytes(bytes(16))
        with open(path, "r+b") as handle:
            self._map = mmap.mmap(handle.fileno(), 16)
        self.values = np.frombuffer(self._map, dtype="<i8")

    def read(self) -> tuple[int, int]:
        """(bytes from the server, requests to it) so far."""
        return int(self.values[0]), int(self.values[1])


@dataclass(frozen=True)
class Profile:
    latency: float  # seconds, each way
    bandwidth: float  # bytes/s per connection and direction; 0: no cap


PROFILES = {
    "s3-same-region": Profile(0.010, 90e6),
    "s3-cross-region": Profile(0.040, 50e6),
}


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, profile: Profile,
                count: np.ndarray | None = None, requests: bool = False) -> None:
    """Forward ``reader`` to ``writer``: each chunk leaves ``latency`` after it arrived, and
    no sooner than the bandwidth allows after the previous one. ``count``: add the bytes
    carried to ``count[0]`` or, with ``requests``, the request lines to ``count[1]``."""
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

    async def deliver() -> None:
        free_at = 0.0  # when the link has sent what it was given
        while (item := await queue.get()) is not None:
            arrived, data = item
            start = max(arrived + profile.latency, free_at)
            if start > time.monotonic():
                await asyncio.sleep(start - time.monotonic())
            writer.write(data)
            await writer.drain()
            free_at = start + (len(data) / profile.bandwidth if profile.bandwidth else 0.0)
        writer.close()

    sender = asyncio.create_task(deliver())
    tail = b""
    try:
        while data := await reader.read(CHUNK):
            queue.put_nowait((time.monotonic(), data))
            if count is not None and requests:
                seen = tail + data
                count[1] += seen.count(_REQUEST)
                tail = seen[-(len(_REQUEST) - 1):]
            elif count is not None:
                count[0] += len(data)
    except ConnectionError:
        pass
    finally:
        queue.put_nowait(None)
        try:
            await sender
        except ConnectionError:
            pass


async def _serve(listen: int, upstream: tuple[str, int], profile: Profile, counters: str | None = None) -> None:
    count = Counters(counters, create=True).values if counters else None

    async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*upstream)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pump(client_reader, server_writer, profile, count, requests=True),
                             _pump(server_reader, client_writer, profile, count))

    server = await asyncio.start_server(relay, "127.0.0.1", listen)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


@contextmanager
def relayed(endpoint: str, profile: str, counters: str | None = None) -> Iterator[tuple[str, int | None]]:
    """``endpoint`` seen through a relay under ``profile`` (itself for ``loopback``): yields
    the endpoint to use and the relay's PID, and stops the relay by its PID on leaving.
    ``counters``: the file the relay counts what it carries in (``Counters``)."""
    if profile == "loopback":
        yield endpoint, None
        return
    relay = subprocess.Popen([sys.executable, __file__, "--upstream", endpoint.removeprefix("http://"),
                              "--profile", profile, *(["--counters", counters] if counters else [])],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert relay.stdout is not None
        yield f"http://127.0.0.1:{relay.stdout.readline().split()[1]}", relay.pid
    finally:
        os.kill(relay.pid, signal.SIGTERM)
        relay.wait(30)
        if relay.stdout is not None:
            relay.stdout.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=int, default=0, help="port on 127.0.0.1 (0: any free one)")
    parser.add_argument("--upstream", required=True, help="host:port of the S3 server")
    parser.add_argument("--profile", choices=sorted(PROFILES), required=True)
    parser.add_argument("--counters", default=None, help="a file to count bytes and requests in (Counters)")
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    asyncio.run(_serve(args.listen, (host, int(port)), PROFILES[args.profile], args.counters))


if __name__ == "__main__":
    main()
