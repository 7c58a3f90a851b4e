"""Video clips: what a video dataset stores, and clips/s from the bucket, ours against WebDataset.

``--videos`` H.264 files of 10 s at 320 x 240 (24 frames a second, a key frame every 2 s;
``SyntheticVideos``) are uploaded to the embedded S3 server (SeaweedFS, loopback) by both:
ours with ``upload_cv_dataset`` over ``(path, label)`` pairs, WebDataset's ``ShardWriter``
with each file's bytes as an ``.mp4`` member. Then clips of 16 frames, 2 apart, cropped and
resized to 112 x 112, in batches of 8:

- ours: ``decode(video=VideoClip(16, step=2, crop=RandomResizedCrop(112)))``;
- WebDataset: ``.to_tuple("mp4", "cls").map_tuple(clip, int)`` (its docs decode video in a
  ``map``), ``clip`` a PyAV function a user writes: seek to a random start's key frame,
  decode the clip, one crop and resize for its frames (the same work, not our code);

each with 0 and 2 DataLoader workers (persistent: two epochs timed after one that starts
them), one boto3 client per process (WebDataset's ``gopen_schemes``), every row
``--repeats`` times in turn, medians. Bytes: what each stored
against the files, and against the clips stored as decoded frames (16 x 112 x 112 x 3 bytes
a clip, one clip a video; at full size, 16 x 240 x 320 x 3).

``--device cuda`` (on a GPU node, with the ``gpu`` extra) adds ours with
``VideoClip(..., device="cuda")``: the same clips decoded by DALI (NVDEC) in this process,
through ``loader()`` with 0 and 2 workers that only draw the clips.

    python benchmarks/video.py [--videos 48] [--repeats 3] [--device cuda] [--json results/video-<commit>.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "suite")]

FRAMES, STEP, SIZE, BATCH = 16, 2, 112, 8


def pyav_clip(data: bytes, seed: int) -> Any:
    """A user's clip decoder for WebDataset's map: PyAV, a seek to the key frame before a
    random start, the clip's frames, one random crop resized to 112 x 112."""
    import av
    import numpy as np
    import torch
    from torch.nn import functional

    rng = np.random.default_rng(seed)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        rate = float(stream.average_rate)
        start = int(rng.integers(0, max(1, stream.frames - (FRAMES - 1) * STEP)))
        container.seek(int(start / rate / stream.time_base), stream=stream, backward=True)
        frames = []
        for frame in container.decode(stream):
            number = round(float(frame.pts * stream.time_base) * rate)
            if number >= start and (number - start) % STEP == 0:
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) == FRAMES:
                    break
    clip = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)
    height, width = clip.shape[-2:]
    side = int(rng.integers(min(height, width) // 2, min(height, width) + 1))
    top, left = int(rng.integers(0, height - side + 1)), int(rng.integers(0, width - side + 1))
    box = clip[:, :, top : top + side, left : left + side].float()
    return functional.interpolate(box, size=(SIZE, SIZE), mode="bilinear", antialias=True).round().to(torch.uint8)


class _Clip:
    """``pyav_clip`` with a seed per call (WebDataset's map has no key-based generator)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, data: bytes) -> Any:
        self.calls += 1
        return pyav_clip(data, os.getpid() * 1_000_003 + self.calls)


def _ours(server: Any, workers: int, device: str | None = None) -> Any:
    from torch.utils.data import DataLoader

    from remote_loader import RandomResizedCrop, RemoteDataset, VideoClip, loader

    clip = VideoClip(FRAMES, step=STEP, crop=RandomResizedCrop(SIZE), device=device)
    ds = (RemoteDataset(server.client(), "bench", "ours", seed=0).shuffle(BATCH * 2).decode(video=clip)
          .to_tuple("mp4", "cls").batched(BATCH))
    if device is not None:  # the clips decoded in this process, as loader() runs it
        return loader(ds, num_workers=workers)
    return DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)


def _webdataset(server: Any, workers: int) -> Any:
    import webdataset as wds
    from systems import _s3_opener
    from torch.utils.data import DataLoader

    os.environ.update(AWS_ENDPOINT_URL=server.endpoint_url, AWS_ACCESS_KEY_ID=server.access_key,
                      AWS_SECRET_ACCESS_KEY=server.secret_key)
    wds.gopen_schemes["s3"] = _s3_opener
    listing = server.client().list("bench", "wds/")
    urls = sorted(f"s3://bench/{info.key}" for info in listing if info.key.endswith(".tar"))
    ds = (wds.WebDataset(urls, shardshuffle=len(urls), seed=0, nodesplitter=wds.single_node_only,
                         workersplitter=wds.split_by_worker, empty_check=False)
          .shuffle(BATCH * 2).to_tuple("mp4", "cls").map_tuple(_Clip(), int).batched(BATCH))
    return DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)


def _epochs(loader: Any, epochs: int = 2) -> tuple[int, float]:
    """Clips and seconds of ``epochs`` epochs, after one that starts the workers."""
    for _ in loader:
        pass
    started, clips = time.perf_counter(), 0
    for _ in range(epochs):
        for videos, _ in loader:
            assert tuple(videos.shape[1:]) == (FRAMES, 3, SIZE, SIZE)
            clips += len(videos)
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the last batch's decode is done
    return clips, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--videos", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cuda",), help="add ours decoding the clips with DALI there")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    import webdataset as wds

    from remote_loader import upload_cv_dataset
    from remote_loader.testing.server import EmbeddedS3
    from remote_loader.testing.synthetic import SyntheticVideos

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench-video-"))
    videos = SyntheticVideos(args.videos, str(work / "files"), frames=240, size=(320, 240), fps=24, gop=48)
    items = [videos[i] for i in range(len(videos))]
    files = sum(os.path.getsize(path) for path, _ in items)
    rows: dict[str, list[float]] = {}
    with EmbeddedS3(buckets=["bench"]) as server:
        client = server.client()
        upload_cv_dataset(items, client=client, bucket="bench", base_folder="ours", workers=0, progress=False)
        ours_bytes = sum(info.size for info in client.list("bench", "ours/"))
        with wds.ShardWriter(str(work / "shard-%06d.tar"), maxcount=8, verbose=0) as sink:
            for i, (path, label) in enumerate(items):
                sink.write({"__key__": f"{i:06d}", "mp4": Path(path).read_bytes(), "cls": str(label).encode()})
        for shard in sorted(work.glob("shard-*.tar")):
            client.put("bench", f"wds/{shard.name}", shard.read_bytes())
        systems: list[tuple[str, Any]] = [("remote_loader", _ours), ("webdataset", _webdataset)]
        if args.device:
            systems.insert(1, (f"remote_loader, DALI on {args.device}",
                               lambda server, workers: _ours(server, workers, args.device)))
        for repeat in range(args.repeats):
            for name, make in systems:
                for workers in (0, 2):
                    clips, seconds = _epochs(make(server, workers))
                    rate = clips / seconds
                    rows.setdefault(f"{name}, {workers} workers", []).append(rate)
                    print(f"[{repeat + 1}/{args.repeats}] {name:<14} {workers} workers {rate:7.1f} clips/s",
                          flush=True)
    raw_small, raw_full = args.videos * FRAMES * SIZE * SIZE * 3, args.videos * FRAMES * 240 * 320 * 3
    summary = {name: statistics.median(rates) for name, rates in rows.items()}
    print(f"\n{args.videos} videos of 10 s, 320x240 H.264: files {files / 1e6:.2f} MB; ours stores"
          f" {ours_bytes / 1e6:.2f} MB (manifest and indexes included); one clip a video as decoded frames:"
          f" {raw_small / 1e6:.1f} MB at 112x112 ({raw_small / files:.1f}x the files), {raw_full / 1e6:.1f} MB at"
          f" full size ({raw_full / files:.1f}x)")
    print(f"clips of {FRAMES} frames, {STEP} apart, {SIZE}x{SIZE}, batches of {BATCH}, medians of {args.repeats}:")
    for name, rate in summary.items():
        print(f"| {name} | {rate:,.1f} clips/s |")
    if args.json:
        args.json.write_text(json.dumps({"videos": args.videos, "files_bytes": files, "ours_bytes": ours_bytes,
                                         "raw_clip_bytes_112": raw_small, "raw_clip_bytes_full": raw_full,
                                         "medians": summary, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
