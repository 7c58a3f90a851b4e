"""``remote-loader serve``: an embedded S3 server (SeaweedFS) on 127.0.0.1, to try things."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from remote_loader.cli_args import HelpFormatter, count_arg
from remote_loader.config import SERVER_KEY_VARIABLES, server_keys
from remote_loader.errors import ConfigError

_USER, _PASSWORD = SERVER_KEY_VARIABLES


def serve_keys(args: argparse.Namespace) -> tuple[str, str] | None:
    """The identity the server accepts: the options, else the environment, else none (the
    server's default, minioadmin / minioadmin). A secret typed as an option is taken, with a
    warning on stderr (never repeating it): ``ps`` and shell history show a command line."""
    access, secret = server_keys()
    access = access if args.access_key is None else args.access_key
    if args.secret_key is not None:
        print(f"remote-loader: warning: --secret-key puts the secret on the command line, where ps and shell"
              f" history show it: set {_PASSWORD} instead", file=sys.stderr)
        secret = args.secret_key
    if (access is None) != (secret is None):
        raise ConfigError(f"give the server's access key and secret together (--access-key or {_USER}, and"
                          f" {_PASSWORD}), or neither, for minioadmin / minioadmin")
    return None if access is None or secret is None else (access, secret)


def cmd_serve(args: argparse.Namespace) -> int:
    keys = serve_keys(args)
    from remote_loader.testing.server import EmbeddedS3  # the test server, only for `serve`

    server = EmbeddedS3(data_dir=args.data, port=args.port, buckets=args.bucket or [])
    if keys is not None:
        server.access_key, server.secret_key = keys
    server.start()
    try:
        print(f"S3 server on {server.endpoint_url} (pid {server.pid}); data in {server.data_dir}")
        internal = ", ".join(f"{name} {port}" for name, port in server.ports.items() if name != "s3")
        print(
            f"its internal services take these loopback ports too, and refuse requests without the server's"
            f" own keys, but for the volume server's /status page (bucket names, object counts and sizes,"
            f" this data directory) open to anyone on this machine: {internal}"
        )
        print("export these to use it:")
        for name, value in server.env().items():
            if name == "AWS_SECRET_ACCESS_KEY" and keys is not None:
                value = "<the secret you gave>"  # a secret of the user's is not echoed
            print(f"  export {name}={value}")
        print("Ctrl-C stops it.", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.stop()
    return 0


def block_stop_signals() -> None:
    """Hold SIGINT and SIGTERM for ``cmd_serve``'s ``sigwait`` (from the start, so neither
    arrives as an exception while the server starts)."""
    if hasattr(signal, "pthread_sigmask"):  # Windows has none (nor a server: see EmbeddedS3.start)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run an embedded S3 server (SeaweedFS) on 127.0.0.1",
                       formatter_class=HelpFormatter)
    p.add_argument("--port", type=count_arg(1), default=None, help="S3 port (default: a free one)")
    p.add_argument("--data", default=None, help="data directory (default: temporary)")
    p.add_argument("--bucket", action="append", help="bucket to create (repeatable)")
    p.add_argument("--access-key", default=None,
                   help=f"the identity the server accepts (default: {_USER}, else minioadmin)")
    p.add_argument("--secret-key", default=None,
                   help=f"its secret; visible to every user of the machine (ps) and kept in shell history:"
                   f" set {_PASSWORD} instead (default: {_PASSWORD}, else minioadmin)")
    p.set_defaults(func=cmd_serve)
