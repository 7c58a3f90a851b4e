"""Frozen configuration objects; the one place that reads ``os.environ``."""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from remote_loader.checks import (
    parse_bytes,
    require_bool,
    require_int,
    seconds,
    shown,
)
from remote_loader.errors import ConfigError

BACKENDS = ("boto3", "minio", "local")
MAX_WORKERS = 1024
"""Most DataLoader workers a RemoteDataset runs in, and a state may name (a bound on what a state
dict may allocate)."""

MOST_THREADS = 1024
"""The most threads a pipeline stage runs on, and a fetcher's ``concurrency``: each starts all of
its threads at once, in every DataLoader worker, where a count past what a process can start
failed mid-epoch."""

MOST_EPOCH = 2**62
"""The largest epoch ``set_epoch`` takes and a saved state may hold."""

_HOST_PORT = re.compile(r"^[A-Za-z0-9.-]+:\d+$")
def _first(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = env.get(name)
        if value:
            return value
    return None


_KEY_VARIABLES = {
    "access_key": ("AWS_ACCESS_KEY_ID", "MINIO_ACCESS_KEY", "MINIO_ROOT_USER"),
    "secret_key": ("AWS_SECRET_ACCESS_KEY", "MINIO_SECRET_KEY", "MINIO_ROOT_PASSWORD"),
    "session_token": ("AWS_SESSION_TOKEN",),
}
"""StorageConfig's keys and the environment variables that give them, the first set winning."""
_UNSHOWN = "it is not shown; a newline or a tab copied with the key?"


def _key_from(env: Mapping[str, str], *names: str) -> str | None:
    """The first of ``names`` set in ``env``; a ConfigError naming the variable, never its
    value, where it holds a control character (an SDK would send it in a header)."""
    for name in names:
        value = env.get(name)
        if value:
            if not value.isprintable():
                raise ConfigError(f"the environment variable {name} holds a non-printable character ({_UNSHOWN})")
            return value
    return None


SERVER_KEY_VARIABLES = ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD")
"""The identity an S3 server started here (``remote-loader serve``) accepts, named as MinIO's
server names its own; the clients read them too, after the AWS and MinIO client names."""


def server_keys(env: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """The access key and secret ``SERVER_KEY_VARIABLES`` give (None where unset), so a secret
    need not be typed on a command line, which ``ps`` and shell history show."""
    env = os.environ if env is None else env
    return _key_from(env, SERVER_KEY_VARIABLES[0]), _key_from(env, SERVER_KEY_VARIABLES[1])


def aws_files(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The AWS credentials file and config file botocore reads (``AWS_SHARED_CREDENTIALS_FILE``
    and ``AWS_CONFIG_FILE``, else ``~/.aws/credentials`` and ``~/.aws/config``), for messages
    and the minio backend."""
    env = os.environ if env is None else env
    return (os.path.expanduser(env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials"),
            os.path.expanduser(env.get("AWS_CONFIG_FILE") or "~/.aws/config"))


def check_world(rank: object, world_size: object) -> tuple[int, int]:
    """``(rank, world_size)`` checked: ints with ``0 <= rank < world_size``."""
    size = require_int("world_size", world_size, 1)
    return require_int("rank", rank, 0, size - 1), size


def world_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """Rank and world size from ``RANK`` and ``WORLD_SIZE`` (default 0 and 1), checked."""
    env = os.environ if env is None else env
    values = []
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1")):
        text = env.get(name) or default
        try:
            values.append(int(text))
        except ValueError:
            raise ConfigError(f"the environment variable {name} must be an integer, got {text!r}") from None
    if not env.get("RANK") and values[1] > 1:  # every process would read rank 0's part
        raise ConfigError(f"WORLD_SIZE={values[1]} in the environment but no RANK: set both (torchrun does), or pass"
                          " rank= and world_size=")
    if not env.get("WORLD_SIZE") and values[0] != 0:
        raise ConfigError(f"RANK={values[0]} in the environment but no WORLD_SIZE: set both (torchrun does), or pass"
                          " rank= and world_size=")
    try:
        return check_world(*values)
    except ConfigError as exc:
        raise ConfigError(f"RANK={values[0]} and WORLD_SIZE={values[1]} in the environment: {exc}") from None


def rank_cores(env: Mapping[str, str] | None = None, *, cgroup: str = "/sys/fs/cgroup/cpu.max",
               cpuset: str = "/sys/fs/cgroup/cpuset.cpus.effective", allowed: int | None = None,
               machine: int | None = None) -> int:
    """The cores this process (a rank) may use, of those its container or job holds: its CPU
    affinity (``allowed``) and the container's CPU quota (cgroup v2 ``cpu.max``), shared with
    the other ranks on the node (``LOCAL_WORLD_SIZE``, torchrun's). The affinity is this rank's
    own where it is narrower than the container's cpuset (``machine`` cores: cgroup v2
    ``cpuset.cpus.effective``, else the machine's); the quota is always the container's."""
    env = os.environ if env is None else env
    if not isinstance(env, Mapping):
        raise ConfigError(f"env must be a mapping of environment variables, got {type(env).__name__}")
    for name, given in (("allowed", allowed), ("machine", machine)):  # allowed=1.5 gave 1.5 cores
        if given is not None:
            require_int(name, given, 1)
    machine = machine or _cpuset_cores(cpuset) or os.cpu_count() or 1
    if allowed is None:
        sched = getattr(os, "sched_getaffinity", None)
        allowed = len(sched(0)) if sched is not None else machine
    text = env.get("LOCAL_WORLD_SIZE") or "1"
    try:
        ranks = max(1, int(text))
    except ValueError:
        raise ConfigError(f"the environment variable LOCAL_WORLD_SIZE must be an integer, got {text!r}") from None
    cores = allowed if allowed < machine else allowed // ranks  # an affinity narrowed to this rank: all of it
    try:
        with open(cgroup) as handle:
            quota, period = handle.read().split()[:2]
        if quota != "max":
            cores = min(cores, -(-int(quota) // int(period)) // ranks)
    except (OSError, ValueError):
        pass
    return max(1, cores)


def _cpuset_cores(path: str) -> int | None:
    """The number of CPUs in a cgroup cpuset list (``0-31,64-95``), or None where unread."""
    try:
        with open(path) as handle:
            text = handle.read().strip()
        count = 0
        for part in text.split(","):
            low, _, high = part.partition("-")
            count += int(high or low) - int(low) + 1
    except (OSError, ValueError):
        return None
    return count or None


def normalize_endpoint(endpoint: str, *, secure: bool = False) -> str:
    """Return ``endpoint`` as ``scheme://host[:port]``; a bare ``host:port`` gets http(s).

    An endpoint holding credentials (``http://key:secret@host``) is refused, with a message
    that does not repeat them: credentials go in ``access_key`` / ``secret_key`` or the
    environment, where they are kept out of reprs and logs.
    """
    # Anywhere: a secret may hold a '/' or a '?' (ending the host part before its '@'), and a
    # host:port has no scheme; an endpoint has no other use for an '@'.
    if "@" in endpoint:
        raise ConfigError(
            "the endpoint URL holds credentials (user:secret@host), which are not used from there: pass"
            " access_key and secret_key, or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    if _HOST_PORT.match(endpoint):
        endpoint = f"{'https' if secure else 'http'}://{endpoint}"
    # Never its query in a message: a presigned URL's holds its signature.
    named = repr(endpoint.partition("?")[0] + ("?..." if "?" in endpoint else ""))
    if not endpoint.isprintable():  # urlsplit would drop a tab or newline: another host than the one given
        raise ConfigError(f"endpoint {named} holds a control character")
    try:
        parts = urlsplit(endpoint)
        hostname = parts.hostname
    except ValueError:  # 'Invalid IPv6 URL'
        hostname = None
    if not hostname or parts.scheme not in ("http", "https"):
        raise ConfigError(f"endpoint {named} is not an http(s)://host[:port] URL")
    try:
        port = parts.port  # read only here: a port that is no number or out of range raises
    except ValueError:
        port = 0
    if port == 0:  # else the SDKs fail at the first request (boto3: EndpointResolutionError)
        raise ConfigError(f"endpoint {named} has no valid port: a port is a number from 1 to 65535")
    if parts.path not in ("", "/"):
        raise ConfigError(f"endpoint {named} must not have a path; put bucket and prefix elsewhere")
    if parts.query:
        raise ConfigError(f"endpoint {named} must not have a query; give only http(s)://host[:port]")
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class StorageConfig:
    """How to reach an S3-compatible store.

    Attributes:
        endpoint_url: ``http(s)://host:port``; None means the SDK's default (AWS S3).
        access_key: Access key id; None lets boto3 use its own credential chain.
        secret_key: Secret access key (never shown in reprs or messages).
        session_token: Optional session token (never shown).
        region: Region name used to sign requests.
        max_attempts: Attempts the SDK itself makes per request. The default, 1, leaves
            retrying to remote_loader's own policy (``FetchConfig``: backoff and an outage
            deadline); raising it multiplies the attempts of the two layers.
        connect_timeout: Seconds to wait for a connection.
        read_timeout: Seconds to wait for bytes on an open connection: it bounds how long
            a request to a hung server can block (a body must also come within it plus a
            second for each 32 KiB: ``storage.receive.SLOWEST_BODY``).
        max_connections: Size of the connection pool per process.
        profile: The AWS profile whose keys to use when none are given (``AWS_PROFILE``;
            None: the ``default`` profile, where it holds keys); boto3 reads it through its
            own chain, the minio backend from the credentials file.
        credentials_file: The AWS credentials file, a str or path (``AWS_SHARED_CREDENTIALS_FILE``, else
            ``~/.aws/credentials``).
    """

    endpoint_url: str | None = None
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    region: str = "us-east-1"
    max_attempts: int = 1
    connect_timeout: float = 5.0
    read_timeout: float = 20.0
    max_connections: int = 32
    profile: str | None = None
    credentials_file: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.credentials_file, os.PathLike):  # a pathlib.Path, as the minio backend reads it
            object.__setattr__(self, "credentials_file", os.fspath(self.credentials_file))
        for name in ("endpoint_url", "profile", "credentials_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):  # an endpoint's value (bytes...) may hold user:secret@
                raise ConfigError(f"{name} must be a str, got {type(value).__name__}"
                                  + ("" if name == "endpoint_url" else f" {shown(value)}"))
        if not isinstance(self.region, str) or not self.region or not self.region.isprintable():
            raise ConfigError(f"region must be a region's name (us-east-1), got {shown(self.region)}")
        if self.endpoint_url is not None:
            object.__setattr__(self, "endpoint_url", normalize_endpoint(self.endpoint_url))
        if (self.access_key is None) != (self.secret_key is None):
            raise ConfigError("give both access_key and secret_key, or neither")
        for name in _KEY_VARIABLES:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.isprintable()):
                raise ConfigError(f"{name} holds a non-printable character ({_UNSHOWN})"
                                  if isinstance(value, str) else f"{name} must be a str, got {type(value).__name__}")
        for name in ("max_attempts", "max_connections"):  # 1.5 and True were taken
            object.__setattr__(self, name, require_int(name, getattr(self, name), 1))
        for name in ("connect_timeout", "read_timeout"):  # inf would wait on a hung server for ever
            object.__setattr__(self, name, seconds(name, getattr(self, name), positive=True))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> StorageConfig:
        """Build a config from the standard environment variables, then apply ``overrides``.

        Read: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
        ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``,
        ``AWS_DEFAULT_REGION``, ``AWS_PROFILE``, ``AWS_SHARED_CREDENTIALS_FILE``, and MinIO's
        ``MINIO_ENDPOINT`` (with ``MINIO_SECURE``),
        ``MINIO_ACCESS_KEY`` / ``MINIO_ROOT_USER``, ``MINIO_SECRET_KEY`` /
        ``MINIO_ROOT_PASSWORD`` and ``MINIO_REGION``. AWS names win over MinIO names.
        Overrides whose value is None are ignored.
        """
        env = os.environ if env is None else env
        endpoint = _first(env, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        if endpoint is None and env.get("MINIO_ENDPOINT"):
            secure = env.get("MINIO_SECURE", "").lower() in ("1", "true", "yes")
            endpoint = normalize_endpoint(env["MINIO_ENDPOINT"], secure=secure)
        values: dict[str, object] = {
            "endpoint_url": endpoint,
            # a key an override replaces is not read: its variable's faults do not matter
            **{name: _key_from(env, *variables) for name, variables in _KEY_VARIABLES.items()
               if overrides.get(name) is None},
            "region": _first(env, "AWS_REGION", "AWS_DEFAULT_REGION", "MINIO_REGION") or "us-east-1",
            "profile": _first(env, "AWS_PROFILE"),
            "credentials_file": _first(env, "AWS_SHARED_CREDENTIALS_FILE"),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if (values["access_key"] is None) != (values["secret_key"] is None):
            # A key from the environment and a secret from an argument (or the reverse) would
            # mix two identities; ask for both from one place.
            raise ConfigError("give both access_key and secret_key, or neither (arguments or environment)")
        return cls(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RetryConfig:
    """How every request to the store is retried (connection refused or reset, timeouts,
    5xx, slow-down, short reads): exponential backoff with full jitter until it succeeds
    or has failed for a deadline, then ``EndpointUnreachable``.

    Attributes:
        backoff: Base seconds of the exponential backoff between attempts.
        max_backoff: Longest pause between two attempts.
        outage_deadline: Seconds a request is retried while the store fails it. The
            default, 5 minutes, rides out a server restart; a hung server is detected
            after this plus one ``StorageConfig.read_timeout``.
        first_contact_deadline: The same, for an endpoint that has not answered once since
            this process started (a wrong port, a host that does not resolve, a server not
            started): a typo fails in about this long (2 s), with one error and no warning
            before it, not after ``outage_deadline``. The smaller of the two applies. A
            DataLoader or upload worker inherits what its parent knew.
    """

    backoff: float = 0.05
    max_backoff: float = 2.0
    outage_deadline: float = field(default_factory=lambda: _env_default("outage_deadline", 300.0))
    first_contact_deadline: float = field(default_factory=lambda: _env_default("first_contact_deadline", 2.0))

    def __post_init__(self) -> None:
        for name in ("backoff", "max_backoff", "outage_deadline", "first_contact_deadline"):
            seconds(name, getattr(self, name))  # inf would retry a dead store, or wait between two tries, for ever

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> RetryConfig:
        """The defaults, with ``REMOTE_LOADER_OUTAGE_DEADLINE`` and
        ``REMOTE_LOADER_FIRST_CONTACT_DEADLINE`` (seconds) of ``env`` when set, then
        ``overrides`` (None values ignored). ``RetryConfig()`` reads the process's environment
        the same way."""
        values: dict[str, object] = {name: _env_seconds(name, env) for name in ENV_DEADLINES}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**{k: v for k, v in values.items() if v is not None})  # type: ignore[arg-type]


ENV_DEADLINES = ("outage_deadline", "first_contact_deadline")
"""RetryConfig's fields a variable sets: ``REMOTE_LOADER_<FIELD>``, in seconds."""


def _env_default(field_name: str, default: float) -> float:
    value = _env_seconds(field_name)
    return default if value is None else value


def _env_seconds(field_name: str, env: Mapping[str, str] | None = None) -> float | None:
    env = os.environ if env is None else env
    name = f"REMOTE_LOADER_{field_name.upper()}"
    if not env.get(name):
        return None
    try:
        seconds = float(env[name])
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {env[name]!r}") from None
    if not (math.isfinite(seconds) and seconds >= 0):  # named here: RetryConfig's own check names its field
        raise ConfigError(f"{name} must be a finite number of seconds >= 0, got {env[name]!r}")
    return seconds


DECODING_PREFETCH_BYTES = 32 * 1024 * 1024
"""Prefetch budget of a decoding DataLoader worker, at most (``FetchConfig.for_decoding``)."""

_RETRY_FIELDS = ("backoff", "max_backoff", "outage_deadline", "first_contact_deadline")


@dataclass(frozen=True)
class FetchConfig:
    """How shards are fetched ahead of use: the shape of the reads and their memory.

    The shard data a process holds at once is at most ``range_memory(open_shards,
    largest_sample)``: ``max(prefetch_bytes, R) + (open_shards + free_ranges) * R`` plus 8
    MiB, where a range ``R`` is ``range_bytes`` or, when one sample is larger, that sample
    (rounded up to whole MiB): ranges being fetched, the ``open_shards`` ranges being read,
    the free buffers kept for reuse, and the heads of the first shards. With the defaults,
    ``open_shards=4`` and samples under 8 MiB: 184 MiB; with 40 MB samples, 370 MiB. Ranges
    are cut from each shard's index, so this holds for any mix of sample sizes. The fetcher
    starts with 8 GETs in flight and a quarter of ``prefetch_bytes`` as its budget, 32 MiB at
    most (88 MiB in all) and reaches toward ``concurrency`` and
    ``prefetch_bytes`` only while the reader waits for bytes and each step brings them in
    faster: across a network, where every GET costs a round trip; it starts there when the
    manifest's first GET took 15 ms or more. At the start of an
    epoch the first MiB of the first four shards (a shard under 2 MiB whole) is fetched
    while their indexes arrive (8 MiB more at most, until copied into their ranges). A range larger than
    ``prefetch_bytes`` (one sample bigger than that) is fetched alone. A process's loader memory adds the shuffle
    buffer's samples, per threaded stage ``2 x threads`` samples in flight, and the shard
    indexes it keeps (``2 x open_shards + 4``, ~70 bytes a sample and 20 more a field each).
    Tars streamed unindexed are read whole, a range each, whatever ``range_bytes``. A
    DataLoader worker that decodes on the CPU, given no ``fetch``, fetches under a smaller
    budget and keeps no free buffer (``for_decoding``).

    Attributes:
        part_size: Bytes per ranged GET; a shard is fetched as parallel parts of this size.
        concurrency: The most ranged GETs in flight at once for a reader (threads per
            process), the node cache's fetches of whole shards included; the fetcher starts
            with up to 8 and adds more while they pay (see above). At most 1024.
        prefetch_bytes: Bound on bytes being fetched or fetched and not yet opened by the
            reader; the fetcher starts with a quarter of it, 32 MiB at most. A single range larger than
            this is still fetched, alone. A worker's memory for shard data is at most this
            plus the ``open_shards`` ranges it reads.
        range_bytes: Largest range read from one shard at a time: a worker's part of a
            shard is read as consecutive ranges of whole samples of at most this size (a
            sample larger than that alone), so memory does not grow with the shard size.
        refetch_attempts: Fetches of bytes that fail their checksum before they are
            reported as corrupt (``CorruptShard`` / ``CorruptSampleError``, or skipped).
        free_ranges: Range buffers kept for reuse once read, each of a range's size: a
            fresh buffer costs a page fault per page it is filled with, in the threads that
            fetch (where the GIL is not held).
        retry: How each request is retried (``RetryConfig``).
    """

    part_size: int = 8 * 1024 * 1024
    concurrency: int = 16
    prefetch_bytes: int = 128 * 1024 * 1024
    range_bytes: int = 8 * 1024 * 1024
    refetch_attempts: int = 5
    free_ranges: int = 2
    retry: RetryConfig = field(default_factory=RetryConfig)

    def __post_init__(self) -> None:
        for name in ("part_size", "prefetch_bytes", "range_bytes", "refetch_attempts"):
            object.__setattr__(self, name, require_int(name, getattr(self, name), low=1))
        object.__setattr__(self, "concurrency", require_int("concurrency", self.concurrency, 1, MOST_THREADS))
        object.__setattr__(self, "free_ranges", require_int("free_ranges", self.free_ranges, 0, 64))
        if not isinstance(self.retry, RetryConfig):
            raise ConfigError(f"retry must be a RetryConfig, got {type(self.retry).__name__}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> FetchConfig:
        """The defaults, with the retry deadlines of ``RetryConfig.from_env``; ``overrides``
        name FetchConfig's or RetryConfig's fields (None values ignored)."""
        retry = RetryConfig.from_env(env, **{k: v for k, v in overrides.items() if k in _RETRY_FIELDS})
        return cls(retry=retry, **{k: v for k, v in overrides.items() if k not in _RETRY_FIELDS and v is not None})  # type: ignore[arg-type]

    def for_decoding(self) -> FetchConfig:
        """What a DataLoader worker that decodes (or runs your functions) on the CPU fetches
        with, where ``fetch`` was not given: a budget of at most ``DECODING_PREFETCH_BYTES``,
        its fetcher starting at a quarter of it, and no free range buffer. Such a worker takes
        its samples at the rate it decodes them, tens of MB a second, which that covers across
        a network's round trip; each of a node's workers starting at 32 MiB (at 128 MiB across
        a network) held that much more beside its shuffle buffer (docs/performance.md). A few
        ranges a second come to it, and each free buffer kept was a range more of its memory
        (16 decoding workers: 140 MB of PSS in all). Ranges keep their size:
        smaller ones cost the store a request each (2 MiB ranges cut 16 decoding workers' PSS
        by a fifth, and took 2.2x the server's CPU a sample on SeaweedFS)."""
        return replace(self, prefetch_bytes=min(self.prefetch_bytes, DECODING_PREFETCH_BYTES), free_ranges=0)

    def range_memory(self, open_shards: int, largest_sample: int = 0) -> int:
        """The most bytes of shard data a process holds at once with ``open_shards`` and
        samples of at most ``largest_sample`` bytes (see the class's docstring)."""
        mib = 1 << 20
        ranges = -(-max(self.range_bytes, largest_sample) // mib) * mib
        return max(self.prefetch_bytes, ranges) + (open_shards + self.free_ranges) * ranges + 8 * mib


def fetch_config(fetch: object) -> FetchConfig:
    """``fetch`` as given (a FetchConfig), or the defaults for None; ConfigError for anything
    else (a dict of its fields was taken as given, and failed at the first read)."""
    if fetch is None:
        return FetchConfig()
    if not isinstance(fetch, FetchConfig):
        raise ConfigError(f"fetch must be a FetchConfig, got {type(fetch).__name__} {shown(fetch)}")
    return fetch


def current_world(rank: int | None, world_size: int | None,
                  inherited: tuple[int, int] | None = None) -> tuple[int, int]:
    """Rank and world size: as given, else from torch.distributed, else ``inherited`` (the
    world torch.distributed gave the process that pickled the caller's object, for a spawned
    DataLoader worker, which has no process group), else ``RANK`` / ``WORLD_SIZE``."""
    if (rank is None) != (world_size is None):
        raise ConfigError(
            f"give rank and world_size together, or neither (to take both from torch.distributed"
            f" or RANK / WORLD_SIZE); got rank={rank!r}, world_size={world_size!r}"
        )
    if rank is not None and world_size is not None:
        return check_world(rank, world_size)
    return distributed_world() or inherited or world_from_env()


def distributed_world() -> tuple[int, int] | None:
    """Rank and world size where torch.distributed was set up in this process, else None."""
    import torch.distributed as dist  # only when the world is not given, and by datasets, which import torch anyway

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


@dataclass(frozen=True)
class CacheConfig:
    """A node-local shard cache (docs/cache.md): where, how many bytes it may hold, and how
    what it holds is checked.

    Attributes:
        directory: A directory on a local disk, shared by the node's ranks and workers.
        max_bytes: The most bytes of shards it holds, all datasets together; None: as much
            as leaves a tenth of the disk free.
        verify_reads: Check every member read from the cache against its crc32, every epoch,
            as bytes from the store are. False (the default): a shard is checked whole
            against the manifest's crc32 when it enters the cache, and whole again when a
            process finds its file changed since (its size, inode or modification time);
            its members are not checked again at every read.
    """

    directory: str
    max_bytes: int | None = None
    verify_reads: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, os.PathLike)) or not str(self.directory):
            raise ConfigError(f"the cache directory must be a path, got {shown(self.directory)}")
        if "\0" in os.fsdecode(self.directory):  # no path holds one: refused here, not at the first sample
            raise ConfigError(f"cache_dir must not hold a NUL byte, got {shown(os.fspath(self.directory))}")
        object.__setattr__(self, "directory", os.path.abspath(os.path.expanduser(os.fspath(self.directory))))
        lacks = _cache_lacks()
        if lacks:
            raise ConfigError(f"the shard cache (cache_dir, REMOTE_LOADER_CACHE_DIR) needs {' and '.join(lacks)},"
                              f" which this system ({sys.platform}) lacks: leave both unset there")
        if self.max_bytes is not None:
            object.__setattr__(self, "max_bytes", parse_bytes("cache_bytes", self.max_bytes))
        require_bool("verify_reads", self.verify_reads)

    @classmethod
    def of(cls, directory: str | os.PathLike[str] | None, max_bytes: int | str | None,
           env: Mapping[str, str] | None = None, verify_reads: bool | None = None) -> CacheConfig | None:
        """The cache a dataset uses: ``directory``, ``max_bytes`` and ``verify_reads`` as given,
        else from ``REMOTE_LOADER_CACHE_DIR``, ``REMOTE_LOADER_CACHE_BYTES`` and
        ``REMOTE_LOADER_CACHE_VERIFY`` (``1`` or ``0``); None (no cache) where no directory
        is named. ``directory=""`` turns off a cache the environment names."""
        env = os.environ if env is None else env
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise ConfigError(f"cache_dir must be a path, got {type(directory).__name__} {shown(directory)}")
        if verify_reads is not None:
            require_bool("cache_verify", verify_reads)  # not taken for true or false, also without a cache
        from_env = {"cache_dir": directory is None and "REMOTE_LOADER_CACHE_DIR",
                    "cache_bytes": max_bytes is None and "REMOTE_LOADER_CACHE_BYTES"}
        if directory is None:
            if max_bytes is not None and not env.get("REMOTE_LOADER_CACHE_DIR"):
                raise ConfigError("cache_bytes bounds a cache: give cache_dir too (or REMOTE_LOADER_CACHE_DIR)")
            directory = env.get("REMOTE_LOADER_CACHE_DIR") or None
        if max_bytes is None:
            max_bytes = env.get("REMOTE_LOADER_CACHE_BYTES") or None
        given = verify_reads  # the environment's flag, as its cache_bytes, asks nothing where there is no cache
        if verify_reads is None:
            verify_reads = _env_flag(env, "REMOTE_LOADER_CACHE_VERIFY")
        if not directory:
            if given:
                raise ConfigError("cache_verify checks what a cache reads: give cache_dir too (or"
                                  " REMOTE_LOADER_CACHE_DIR)")
            return None
        try:
            return cls(os.fspath(directory), max_bytes, verify_reads)  # type: ignore[arg-type]
        except ConfigError as error:  # a value the environment gave is named as the user set it
            for field, variable in from_env.items():
                if variable and str(error).startswith(field):
                    raise ConfigError(f"the environment variable {variable}{str(error)[len(field):]}") from None
            raise


def _cache_lacks() -> list[str]:
    """What the node cache needs that this system lacks (Windows: all of it): a cache in a
    shared directory is safe only with ``flock``, ``O_NOFOLLOW`` and directory descriptors."""
    lacks = [] if hasattr(os, "O_NOFOLLOW") and os.open in os.supports_dir_fd else ["O_NOFOLLOW and dir_fd"]
    try:
        import fcntl  # noqa: F401  (only to know whether there is one)
    except ImportError:
        lacks.append("flock (fcntl)")
    if not hasattr(os, "geteuid"):
        lacks.append("user ids (os.geteuid)")
    return lacks


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    """Environment variable ``name`` as a flag: ``1``/``true``/``yes`` or ``0``/``false``/``no`` (unset: False)."""
    text = env.get(name, "").strip().lower()
    if text in ("", "0", "false", "no"):
        return False
    if text in ("1", "true", "yes"):
        return True
    raise ConfigError(f"the environment variable {name} must be 1 or 0, got {env[name]!r}")
