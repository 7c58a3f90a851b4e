"""The command line's argument types and shared options: counts, sizes, seconds, endpoints,
the connection group every storage command takes, and the help formatter."""

from __future__ import annotations

import argparse
import math
from typing import Any

from remote_loader.config import RetryConfig, normalize_endpoint
from remote_loader.errors import ConfigError
from remote_loader.upload.uploader import MAXSIZE_RANGE


def count_arg(low: int, high: int | None = None) -> Any:
    """An argparse type: an integer >= ``low`` (and <= ``high``, where given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {f'>= {low}' if high is None else f'in {low}..{high}'},"
                                             f" got {value}")
        return value
    return parse


def maxsize_arg(text: str) -> float:
    """An argparse type: a shard size in bytes, ``1e8`` or ``100000000`` (not inf, not nan)."""
    low, high = MAXSIZE_RANGE
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be a number of bytes in {low}..{high}, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def deadline_arg(text: str) -> float:
    """An argparse type: seconds >= 0 a RetryConfig takes (not inf, which it refuses naming its field)."""
    value = _seconds(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def timeout_arg(text: str) -> float | None:
    """An argparse type: seconds > 0, or ``none`` (no bound)."""
    if text.strip().lower() == "none":
        return None
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0, or none")
    return value


def endpoint_arg(text: str) -> str:
    """An argparse type: an S3 endpoint, ``http(s)://host[:port]`` or ``host:port`` (never a
    local path, which would be written to as a directory)."""
    try:
        normalize_endpoint(text)
    except ConfigError as error:  # its message never repeats credentials the URL holds
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


CONNECTION = """The endpoint and keys come from the environment: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN, AWS_REGION, AWS_PROFILE), or MinIO's MINIO_ENDPOINT,
MINIO_ACCESS_KEY, MINIO_SECRET_KEY. With no endpoint, s3:// means AWS S3. Keys are not options:
a command line is visible to every user of the machine."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's default at the end of its help, where it has one worth showing (not a
    flag's False, not an unset None), and descriptions kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "(default" in text or default is None or default is False or default == argparse.SUPPRESS:
            return text
        if not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def add_connection(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection", CONNECTION)
    group.add_argument("--endpoint-url", type=endpoint_arg,
                       help="S3 endpoint, e.g. http://127.0.0.1:9000 (default: AWS_ENDPOINT_URL)")
    group.add_argument("--region", help="signing region (default: AWS_REGION, else us-east-1)")
    group.add_argument("--backend", choices=("boto3", "minio"), default="boto3", help="S3 client library")
    retry = RetryConfig()
    group.add_argument("--outage-deadline", type=deadline_arg, default=None, metavar="SECONDS",
                       help=f"how long to retry a failing store before giving up (default: {retry.outage_deadline:g},"
                       f" or REMOTE_LOADER_OUTAGE_DEADLINE); a store that never answered gets at most"
                       f" {retry.first_contact_deadline:g} s (REMOTE_LOADER_FIRST_CONTACT_DEADLINE)")
