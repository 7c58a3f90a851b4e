"""What the examples share: where the bucket is, and an embedded server for trying them.

Every example takes ``--url s3://bucket/prefix`` and reads the endpoint and credentials
from the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, or the ``MINIO_*`` names), as the library does. With
``--local-server`` an example starts an embedded S3 server on 127.0.0.1 instead, exports
its variables for itself (and any process it starts) and stops it when done.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

from remote_loader.storage import parse_location
from remote_loader.testing.server import EmbeddedS3


def add_location_args(parser: argparse.ArgumentParser, default_prefix: str) -> None:
    parser.add_argument("--url", default=f"s3://examples/{default_prefix}",
                        help="the dataset's s3://bucket/prefix (endpoint and credentials from the environment)")
    parser.add_argument("--local-server", action="store_true",
                        help="run against an embedded S3 server on 127.0.0.1 with a tiny generated dataset")


@contextlib.contextmanager
def maybe_local_server(args: argparse.Namespace) -> Iterator[EmbeddedS3 | None]:
    """Start an embedded server holding the bucket of ``args.url`` if ``--local-server`` was given."""
    if not args.local_server:
        yield None
        return
    bucket = parse_location(args.url).bucket
    with EmbeddedS3(buckets=[bucket]) as server:
        saved = dict(os.environ)
        os.environ.update(server.env())
        print(
            f"embedded S3 server on {server.endpoint_url} (pid {server.pid}), bucket {bucket!r}",
            file=sys.stderr,
            flush=True,
        )
        try:
            yield server
        finally:
            os.environ.clear()
            os.environ.update(saved)
