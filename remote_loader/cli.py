"""The ``remote-loader`` console script: upload, ls, info, verify, serve."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from PIL import Image
from tqdm import tqdm

from remote_loader import __version__
from remote_loader.checks import one_line
from remote_loader.cli_args import HelpFormatter, add_connection, count_arg, maxsize_arg, timeout_arg
from remote_loader.cli_serve import add_serve_parser, block_stop_signals
from remote_loader.config import MAX_WORKERS, CacheConfig, FetchConfig
from remote_loader.errors import BucketNotFound, ConfigError, RemoteLoaderError
from remote_loader.format import ShardTable, fields
from remote_loader.format.video import VIDEO_EXTENSIONS
from remote_loader.read.node_cache import NodeCache
from remote_loader.read.reader import DatasetReader
from remote_loader.storage import Location, Store, open_location
from remote_loader.storage.base import bucket_name_problem
from remote_loader.storage.factory import Backend
from remote_loader.upload import upload_cv_dataset
from remote_loader.upload.indexer import index_webdataset
from remote_loader.upload.uploader import MAXCOUNT_RANGE
from remote_loader.upload.watch import DEFAULT_STALL_TIMEOUT

MOST_CROP = 4096
"""``bench --size``'s bound: a batch of 64 crops that size is 3.2 GB of pixels."""


def _fetch(args: argparse.Namespace) -> FetchConfig:
    return FetchConfig.from_env(outage_deadline=args.outage_deadline)


def _reader(args: argparse.Namespace) -> tuple[DatasetReader, Location]:
    store, location = _open(args)
    return DatasetReader(store, location.bucket, location.base_folder, fetch=_fetch(args)), location


def _open(args: argparse.Namespace) -> tuple[Store, Location]:
    backend: Backend = args.backend
    return open_location(args.url, endpoint_url=args.endpoint_url, region=args.region, backend=backend)


def _shown(text: str) -> str:
    """``text`` for a terminal: control characters (a class name from a hostile upload could
    hold escape sequences) shown as escapes, never sent as they are."""
    return one_line(text)


def _counted(count: int, noun: str) -> str:
    """``1 shard``, ``2 shards``."""
    return f"{count:,d} {noun}{'' if count == 1 else 's'}"


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)


def cmd_upload(args: argparse.Namespace) -> int:
    store, location = _open(args)
    if location.path or args.create_bucket:  # a local destination is a directory: made, as a bucket would be
        store.create_bucket(location.bucket)
    dask = _dask_client(args.dask, _fetch(args).retry.first_contact_deadline) if args.dask else None
    try:
        summary = _upload(args, store, location, dask.get_executor() if dask else None)
    finally:
        if dask is not None:
            dask.close()
    data = {
        "url": str(summary.location),
        "samples": summary.samples,
        "shards": summary.shards,
        "bytes": summary.bytes,
        "skipped": summary.skipped,
        "seconds": round(summary.seconds, 3),
        "writing_seconds": round(summary.writing_seconds, 3),
        "mb_per_s": round(summary.mb_per_s, 2),
        "samples_per_s": round(summary.samples_per_s, 1),
        "kept_shards": summary.kept_shards,
        "kept_samples": summary.kept_samples,
        "uploaded_samples": summary.uploaded_samples,
        "uploaded_shards": summary.uploaded_shards,
    }
    _emit(args, data, str(summary))
    return 0


def _dask_client(address: str, timeout: float) -> Any:
    """A client of the Dask scheduler at ``address`` (the ``dask`` extra), given as long to
    answer as a store that never answered (``RetryConfig.first_contact_deadline``)."""
    try:
        from distributed import Client  # the optional extra, imported only for --dask
    except ImportError:
        raise ConfigError(
            "--dask needs dask.distributed: pip install 'dask[distributed]' (remote_loader's dask extra)"
        ) from None
    try:
        return Client(address, timeout=max(timeout, 1.0))
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot reach the Dask scheduler at {address} within {max(timeout, 1.0):g} s"
                          f" (REMOTE_LOADER_FIRST_CONTACT_DEADLINE): {type(exc).__name__}: {exc}"[:300]) from None


def _upload(args: argparse.Namespace, store: Any, location: Any, executor: Any) -> Any:
    # The upload builds the dataset from its source spec after its first request to the store
    # (a missing bucket is said before minutes of building); a cluster's workers, each once.
    return upload_cv_dataset(
        args.source,
        executor=executor,
        client=store,
        bucket=location.bucket,
        base_folder=location.base_folder,
        maxsize=args.maxsize,
        maxcount=args.maxcount,
        workers=args.workers,
        seed=args.seed,
        image_format=args.image_format,
        quality=args.quality,
        on_error=args.on_error,
        shuffle=not args.no_shuffle,
        overwrite=args.overwrite,
        progress=not (args.quiet or args.json),
        retry=_fetch(args).retry,
        verify=not args.no_verify,
        stall_timeout=args.stall_timeout,
        frames_as_video=args.frames_as_video,
    )


def cmd_index(args: argparse.Namespace) -> int:
    store, location = _open(args)
    bar = tqdm(unit="shard", desc="index", disable=args.quiet or args.json)
    summary = index_webdataset(
        store, location, progress=lambda name: bar.update(1), force=args.force, retry=_fetch(args).retry
    )
    bar.close()
    data = {"url": str(location), "shards": summary.shards, "samples": summary.samples, "bytes": summary.bytes}
    _emit(args, data,
          f"indexed {_counted(summary.samples, 'sample')} in {_counted(summary.shards, 'shard')} at {location}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    reader, _ = _reader(args)
    table = reader.manifest.shards
    rows: Iterable[tuple[int, int, str]]
    if isinstance(table, ShardTable):  # columns, not an entry object per shard
        rows = zip(table.size.tolist(), table.samples.tolist(), (table.names[i] for i in range(len(table))),
                   strict=True)
    else:  # a manifest read by pages: page after page
        rows = ((e.size, e.samples, e.name) for e in table)
    if args.json:
        _emit(args, [{"name": n, "samples": c, "bytes": b} for b, c, n in rows], "")
    else:
        sys.stdout.write(f"{'bytes':>14}  {'samples':>8}  shard\n")
        sys.stdout.writelines(f"{b:>14,d}  {c:>8,d}  {n}\n" for b, c, n in rows)
    return 0


def _image_kinds(reader: DatasetReader) -> dict[str, str]:
    """What each image field of a structured dataset holds, by its first member's header (a few
    KB read): ``mask (P)`` for a stored mode an input image does not have, ``image (RGBA)``."""
    manifest = reader.manifest
    wanted = [f for f in manifest.fields
              if fields.parse(f).stem is not None and fields.parse(f).ext in fields.IMAGE_EXTENSIONS]
    if not wanted or not len(manifest.shards):
        return {}
    entry = manifest.shards[0]
    index = reader.read_index(entry)
    kinds = {}
    for column, name in enumerate(index.fields):
        if name not in wanted:
            continue
        present = np.flatnonzero(index.offsets[:, column])
        if not len(present):
            continue
        start = int(index.offsets[present[0], column])
        head = reader.session().store.get_range(reader.location.bucket, reader.location.key(entry.name), start,
                                               start + min(int(index.sizes[present[0], column]), 1 << 16))
        try:
            with Image.open(io.BytesIO(head)) as image:
                mode = image.mode
        except (OSError, ValueError, Image.DecompressionBombError):
            continue
        target = mode not in fields.INPUT_MODES and fields.parse(name).stem != "0"
        kinds[name] = f"{'mask' if target else 'image'} ({mode})" if target or mode != "RGB" else "image"
    return kinds


_PROBED = 256 << 20  # a video member larger than this is not read whole to say what it holds


def _video_kinds(reader: DatasetReader) -> dict[str, str]:
    """What each video field holds, by its first member's header, read with PyAV where it is
    installed: ``video (h264, 320x240, 10.0 s, 24 fps)``."""
    manifest = reader.manifest
    wanted = [f for f in manifest.fields if fields.parse(f).ext in VIDEO_EXTENSIONS]
    if not wanted or not len(manifest.shards):
        return {}
    try:
        import av
    except ImportError:
        return {}
    entry = manifest.shards[0]
    index = reader.read_index(entry)
    kinds = {}
    for column, name in enumerate(index.fields):
        present = np.flatnonzero(index.offsets[:, column]) if name in wanted else np.empty(0, np.int64)
        if not len(present) or int(index.sizes[present[0], column]) > _PROBED:
            continue
        start = int(index.offsets[present[0], column])
        data = reader.session().store.get_range(reader.location.bucket, reader.location.key(entry.name), start,
                                                start + int(index.sizes[present[0], column]))
        try:
            with av.open(io.BytesIO(data)) as container:
                stream = container.streams.video[0]
                rate = float(stream.average_rate or 0)
                seconds = float(stream.duration * stream.time_base) if stream.duration is not None \
                    else (container.duration or 0) / 1e6
                kinds[name] = (f"video ({stream.codec_context.name}, {stream.codec_context.width}x"
                               f"{stream.codec_context.height}, {seconds:.1f} s, {rate:g} fps)")
        except (av.error.FFmpegError, ValueError, OSError, IndexError):
            continue
    return kinds


def cmd_cache(args: argparse.Namespace) -> int:
    config = CacheConfig.of(args.dir, None)
    if config is None:
        raise ConfigError("name the cache's directory (remote-loader cache DIR) or set REMOTE_LOADER_CACHE_DIR")
    if not os.path.isdir(config.directory):
        raise ConfigError(f"{config.directory} is not a directory: name the directory a cache_dir or"
                          " REMOTE_LOADER_CACHE_DIR named")
    cache = NodeCache(config)
    try:
        if args.clear:
            removed = cache.clear()
            _emit(args, {"directory": config.directory, "cache": cache.path, "removed_bytes": removed},
                  f"{cache.path}: removed {removed / 1e6:,.1f} MB")
            return 0
        datasets = cache.datasets()
    except OSError as error:  # Refused: a directory or folder the cache does not use
        raise ConfigError(f"the cache in {config.directory} cannot be read: {error}") from None
    total = sum(d.bytes for d in datasets)
    lines = [f"{cache.path}: {total / 1e6:,.1f} MB in {_counted(sum(d.shards for d in datasets), 'shard')}"]
    lines += [f"  {_shown(d.name)}: {_counted(d.shards, 'shard')}, {d.bytes / 1e6:,.1f} MB" for d in datasets]
    data = {"directory": config.directory, "cache": cache.path, "bytes": total,
            "datasets": [{"dataset": d.name, "uploads": sorted(d.uploads), "shards": d.shards, "bytes": d.bytes}
                         for d in datasets]}
    _emit(args, data, "\n".join(lines))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    reader, location = _reader(args)
    manifest = reader.manifest
    kinds = {f: fields.describe(f) for f in manifest.fields} | _image_kinds(reader) | _video_kinds(reader)
    data = {
        "url": str(location),
        "format_version": manifest.version,
        "samples": manifest.num_samples,
        "shards": len(manifest.shards),
        "bytes": manifest.num_bytes,
        "fields": list(manifest.fields),
        "field_types": kinds,
        "skipped": manifest.skipped,
        "params": dict(manifest.params),
    }
    upload = dict(manifest.params.get("upload", {}))
    classes = manifest.params.get("classes") or []
    unknown = (
        "unknown (tars indexed in place)" if manifest.params.get("indexed") else "unknown (not recorded at upload)"
    )
    text = "\n".join(
        [
            f"dataset   {location}",
            f"samples   {manifest.num_samples:,d} in {_counted(len(manifest.shards), 'shard')},"
            f" {manifest.num_bytes / 1e6:,.1f} MB",
            f"fields    {_shown(', '.join(f'{f} ({kinds[f]})' for f in manifest.fields))}",
            f"skipped   {manifest.skipped}",
            "classes   "
            + (
                f"{len(classes)} ({_shown(', '.join(map(str, classes[:5])))}{', ...' if len(classes) > 5 else ''})"
                if classes
                else unknown
            ),
            f"upload    {_shown(', '.join(f'{k}={v}' for k, v in sorted(upload.items()) if k != 'items'))}",
            f"created   {_shown(str(manifest.params.get('created', '?')))}",
            f"format    version {manifest.version}",
        ]
    )
    _emit(args, data, text)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    reader, location = _reader(args)
    reports = []
    bar = tqdm(reader.manifest.shards, unit="shard", desc="verify", disable=args.quiet or args.json)
    for entry in bar:
        report = reader.check_shard(entry)
        reports.append(report)
        if not report.ok and not args.json:
            tqdm.write(f"BAD {entry.name}: {'; '.join(report.problems)}", file=sys.stderr)
    bad = [r for r in reports if not r.ok]
    data = {
        "url": str(location),
        "shards": len(reports),
        "bad": [{"name": r.name, "problems": r.problems} for r in bad],
        "ok": not bad,
    }
    text = f"{len(reports) - len(bad)} of {_counted(len(reports), 'shard')} ok" + (
        f"; bad: {', '.join(r.name for r in bad)}" if bad else ""
    )
    _emit(args, data, text)
    return 1 if bad else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from remote_loader import bench  # torch: imported by the one command that streams

    reader, location = _reader(args)
    store = reader.client
    options = {
        "samples": args.samples,
        "workers": args.workers,
        "size": args.size,
        "min_size": args.min_size,
        "verify": not args.no_verify,
        "fetch": reader.fetch,
    }
    manifest = reader.manifest
    total = manifest.num_samples if args.samples is None else min(args.samples, manifest.num_samples)
    if total == 0:
        raise ConfigError(f"{location} holds no samples: nothing to bench")
    bench.require_fit(manifest.fields, args.decode, str(location))
    results = []
    for decode in dict.fromkeys(("none", args.decode)):
        # The bar's rate is the run's average over the span the summary times (smoothing=0, its
        # clock restarted at progress(0)), so the two agree.
        with tqdm(total=total, unit="sample", desc=f"bench {decode}", smoothing=0,
                  disable=args.quiet or args.json) as bar:
            def tick(n: int, bar: tqdm = bar) -> None:
                bar.update(n) if n else bar.reset(total)

            results.append(
                bench.run(store, location.bucket, location.base_folder, decode=decode, progress=tick, **options)
            )
    summary = bench.verdict(results[0], results[1] if len(results) > 1 else None)
    data = {"url": str(location), "workers": args.workers, "runs": [r.as_dict() for r in results], "verdict": summary}
    _emit(args, data, "\n".join([*map(str, results), summary]))
    return 0


def _upload_parser(sub: Any) -> None:
    p = sub.add_parser("upload", help="pack a dataset into shards in a bucket", formatter_class=HelpFormatter)
    p.add_argument("source", help="an image-folder tree (class subfolders) or module:function returning a dataset")
    p.add_argument("url", help="destination, s3://bucket/prefix or a local path")
    p.add_argument("--maxsize", type=maxsize_arg, default=1e8, help="maximum shard size in bytes (default: 1e8)")
    p.add_argument("--maxcount", type=count_arg(*MAXCOUNT_RANGE), default=100_000, help="maximum samples per shard")
    p.add_argument("--workers", type=count_arg(0), default=None,
                   help="encoding processes; 0 encodes in this process (default: CPU count)")
    p.add_argument("--seed", type=count_arg(0), default=0, help="seed of the permutation before sharding")
    p.add_argument("--image-format", default="jpeg", choices=("jpeg", "png", "webp"),
                   help="how in-memory images are encoded (files are stored as they are)")
    p.add_argument("--quality", type=count_arg(1), default=90, help="JPEG and WebP quality, 1..100")
    p.add_argument("--frames-as-video", default=None, choices=("h264", "lossless"),
                   help="store frames (uint8 T x H x W x C arrays and tensors) as an H.264 video, lossy or lossless"
                        " (default: their values, .npy)")
    p.add_argument("--on-error", default="raise", choices=("raise", "skip"),
                   help="raise: stop at the first sample that cannot be read or encoded, naming it; skip: leave it"
                   " out, counted in the summary and the manifest")
    p.add_argument("--no-shuffle", action="store_true", help="keep the source order")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset uploaded with other parameters")
    p.add_argument("--create-bucket", action="store_true", help="make the bucket first where it does not exist")
    p.add_argument("--no-verify", action="store_true",
                   help="where shards are already uploaded, trust the 128 sampled items instead of reading every"
                   " kept item again (a fast resume of a huge upload)")
    p.add_argument("--stall-timeout", type=timeout_arg, default=DEFAULT_STALL_TIMEOUT, metavar="SECONDS",
                   help="seconds one item may take in a worker before the upload ends naming it ('none' waits for"
                   " ever)")
    p.add_argument(
        "--dask",
        metavar="ADDRESS",
        help="run the tasks on the Dask cluster whose scheduler is at ADDRESS"
        " (tcp://host:8786); its workers build the dataset from SOURCE, so it must import there",
    )
    p.set_defaults(func=cmd_upload)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remote-loader", description="Shard datasets into object storage and read them back."
    )
    parser.add_argument("--version", action="version", version=f"remote-loader {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    _upload_parser(sub)
    for name, func, help_text in (
        ("ls", cmd_ls, "list a dataset's shards"),
        ("info", cmd_info, "show a dataset's size, fields and upload parameters"),
        ("verify", cmd_verify, "check every shard against its checksums"),
        ("index", cmd_index, "index existing WebDataset .tar shards in place and write a manifest"),
    ):
        p = sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        p.add_argument("url", help="s3://bucket/prefix or a local path")
        p.set_defaults(func=func)
        if name == "index":
            p.add_argument(
                "--force",
                action="store_true",
                help="replace the manifest of a dataset uploaded by remote_loader (drops its parameters)",
            )
    p = sub.add_parser("bench", help="stream a dataset and say whether storage or decoding limits the rate",
                       formatter_class=HelpFormatter)
    p.add_argument("url", help="s3://bucket/prefix or a local path")
    p.add_argument("--samples", type=count_arg(1), default=None, help="samples per run (default: one epoch)")
    p.add_argument("--workers", type=count_arg(0, MAX_WORKERS), default=2, help="DataLoader workers")
    p.add_argument(
        "--decode",
        choices=("none", "pil", "rrc", "rrc-plain", "clip"),
        default="none",
        help="none: bytes only; pil: decode; rrc: decode + random-resized-crop with reduced-size"
        " JPEG decoding; rrc-plain: the same without it; clip: a clip of 16 frames, 2 apart, of each"
        " video field, cropped to --size (PyAV)",
    )
    p.add_argument("--size", type=count_arg(1, MOST_CROP), default=224, help="crop size for rrc and clip")
    p.add_argument("--min-size", type=count_arg(1), default=None, help="reduced-size decoding for pil")
    p.add_argument("--no-verify", action="store_true", help="skip crc32 checks (to measure what they cost)")
    p.set_defaults(func=cmd_bench)
    for name, p in sub.choices.items():
        add_connection(p)
        p.add_argument("--json", action="store_true", help="print one JSON document on stdout, for scripts")
        if name != "ls" and name != "info":  # the commands that show a progress bar
            p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser("cache", help="show what a node's shard cache holds, or clear it", formatter_class=HelpFormatter)
    p.add_argument("dir", nargs="?", default=None, help="the cache's directory (default: REMOTE_LOADER_CACHE_DIR)")
    p.add_argument("--clear", action="store_true", help="remove every cached shard no process is writing")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout, for scripts")
    p.set_defaults(func=cmd_cache)

    add_serve_parser(sub)
    for command in sub.choices.values():
        command.set_defaults(command_parser=command)
    return parser


def _hint(command: str, exc: RemoteLoaderError) -> str:
    """The option of this command that answers ``exc``, where there is one."""
    if command == "upload" and isinstance(exc, BucketNotFound) and bucket_name_problem(exc.bucket or "") is None:
        return " (--create-bucket makes it)"  # not a name no bucket can have
    return ""


_INTERRUPTED = {"upload": ": the shards written are kept, and the same command again resumes the upload"}


def main(argv: Sequence[str] | None = None) -> int:
    if sys.stdout is None:  # started with its stdout closed (`>&-`): what it prints would be lost
        if sys.stderr is not None:
            print("remote-loader: error: standard output is closed", file=sys.stderr)
        return 1
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own usage, not the top-level one, says what it takes
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "serve":
        block_stop_signals()
    try:
        return int(args.func(args))
    except RemoteLoaderError as exc:
        print(f"remote-loader: error: {_shown(str(exc))}{_hint(args.command, exc)}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1  # argparse's convention: 2 for what the user typed
    except KeyboardInterrupt:
        print(f"remote-loader: interrupted{_INTERRUPTED.get(args.command, '')}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141


if __name__ == "__main__":
    sys.exit(main())
