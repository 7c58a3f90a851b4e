"""A torchvision video class uploaded as its files: bytes stored against its clips as frames,
and clips/s read back with ``RemoteVideoClips`` against the same clips decoded from the
local files.

``--videos`` AVI files (MPEG-4 and 16-bit PCM sound, as UCF101's) of 10 s at 320 x 240, 25
frames a second, in UCF101's layout (``ucf101_tree``), read by torchvision's ``UCF101``
(``frames_per_clip=16``, with ``step_between_clips`` 16 and 1, its default) and uploaded to
the embedded S3 server (SeaweedFS, loopback). Bytes: the bucket's objects against the clips
the class hands over, stored as their frames (``T x H x W x 3`` bytes each, as a dataset of
decoded clips stores them). Clips/s: every ``--stride``-th clip, read with
``RemoteVideoClips`` (audio included, as the class decodes it) by a DataLoader with 0 and 2
workers (and from the node cache, ``cache_dir``, once a pass filled it), against the same
clips decoded from the local files with the same PyAV code (the
class itself decodes with torchcodec, which does not load beside this machine's CPU torch);
medians of ``--repeats``. Long videos: ``--long-minutes`` of the same video (two of them, one
to train), whose clips ``RemoteVideoClips`` reads whole (``ranges_over=None``) and in parts
(``ranges_over=0``, 1 MiB a part): bytes read from the store a clip, and clips/s.

    python benchmarks/video_classes.py [--videos 24] [--stride 8] [--repeats 3] [--long-minutes 5]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "suite")]


class _Local:
    """The class's clips decoded from its local files, as RemoteVideoClips decodes them."""

    def __init__(self, clips: Any, paths: list[str]) -> None:
        self.clips, self.paths = clips, paths

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, i: int) -> Any:
        v, j = self.clips.clip_index.locate(i)
        data = Path(self.paths[v]).read_bytes()
        numbers = self.clips.clip_index.clips_of(v)[j].tolist()
        frames, sound = self.clips._decode(lambda: io.BytesIO(data), numbers, self.clips.clip_index.video_fps[v] or 1.0)
        return frames, sound, 0


def _rate(dataset: Any, indices: list[int], workers: int) -> float:
    import torch
    from torch.utils.data import DataLoader, Subset

    loader = DataLoader(Subset(dataset, indices), batch_size=None, num_workers=workers,
                        multiprocessing_context="fork" if workers else None)
    started = time.perf_counter()
    count = sum(1 for video, _, _ in loader if isinstance(video, torch.Tensor))
    return count / (time.perf_counter() - started)


def _long(client: Any, folder: Path, args: Any) -> dict[str, Any]:
    """Bytes read a clip and clips/s for clips of a long video, read whole and in parts."""
    import torchvision

    from remote_loader import RemoteVideoClips, upload_cv_dataset
    from remote_loader.testing.synthetic import ucf101_tree

    frames = int(args.long_minutes * 60 * 25)
    root, splits, metadata = ucf101_tree(str(folder), classes=1, per_class=2, frames=frames, fps=25, size=(320, 240))
    ucf = torchvision.datasets.UCF101(root, splits, 16, 250, num_workers=0, _precomputed_metadata=metadata)
    upload_cv_dataset(ucf, client=client, bucket="bench", base_folder="long", workers=0, progress=False)
    size = Path(ucf.video_clips.video_paths[0]).stat().st_size
    out: dict[str, Any] = {"minutes": args.long_minutes, "file_bytes": size, "clips": len(ucf)}
    for name, ranges_over in (("whole", None), ("parts", 0)):
        clips = RemoteVideoClips(client, "bench", "long", ranges_over=ranges_over)
        rates = []
        for _ in range(args.repeats):
            before, started = clips.videos.metrics.bytes, time.perf_counter()
            for i in range(len(clips)):
                clips[i]
            rates.append(len(clips) / (time.perf_counter() - started))
            read = (clips.videos.metrics.bytes - before) / len(clips)
        out[name] = {"bytes_per_clip": read, "clips_per_s": statistics.median(rates), "runs": rates}
        print(f"a {args.long_minutes:g}-minute video ({size / 1e6:.1f} MB), read {name}: {read / 1e6:.2f} MB a clip,"
              f" {statistics.median(rates):.1f} clips/s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos", type=int, default=24)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-minutes", type=float, default=5.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torchvision

    from remote_loader import RemoteVideoClips, upload_cv_dataset
    from remote_loader.testing.server import EmbeddedS3
    from remote_loader.testing.synthetic import ucf101_tree

    out: dict[str, Any] = {"videos": args.videos, "stride": args.stride, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedS3(buckets=["bench"]) as server:
        client = server.client()
        root, splits, metadata = ucf101_tree(tmp, classes=2, per_class=args.videos // 2, frames=250, fps=25,
                                             size=(320, 240))
        files = sum(Path(p).stat().st_size for p in metadata["video_paths"])  # type: ignore[attr-defined]
        out["files_bytes"] = files
        for step in (16, 1):
            ucf = torchvision.datasets.UCF101(root, splits, 16, step, fold=1, train=True, num_workers=0,
                                              _precomputed_metadata=metadata)
            prefix = f"ucf-step{step}"
            upload_cv_dataset(ucf, client=client, bucket="bench", base_folder=prefix, workers=0, progress=False)
            stored = sum(o.size for o in client.list("bench", prefix + "/"))
            frames = len(ucf) * 16 * 240 * 320 * 3
            out[f"step{step}"] = {"clips": len(ucf), "stored_bytes": stored, "clips_as_frames_bytes": frames,
                                  "train_files_bytes": sum(Path(ucf.video_clips.video_paths[v]).stat().st_size
                                                           for v in range(ucf.video_clips.num_videos())),
                                  "frames_over_stored": frames / stored}
            print(f"step_between_clips={step}: {len(ucf)} clips; stored {stored / 1e6:.2f} MB; as frames "
                  f"{frames / 1e6:.1f} MB ({frames / stored:.0f}x)", flush=True)
        clips = RemoteVideoClips(client, "bench", "ucf-step16")
        local = _Local(clips, list(ucf.video_clips.video_paths))  # the train fold's, in the class's order
        cached = RemoteVideoClips(client, "bench", "ucf-step16", cache_dir=str(Path(tmp) / "cache"))
        indices = list(range(0, len(clips), args.stride))
        _rate(cached, indices, 0)  # the node cache filled: the rows below read it
        rows: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for workers in (0, 2):
                for name, dataset in (("RemoteVideoClips", clips), ("RemoteVideoClips, node cache", cached),
                                      ("local files", local)):
                    rows.setdefault(f"{name}, {workers} workers", []).append(_rate(dataset, indices, workers))
        out["clips_per_s"] = {name: statistics.median(rates) for name, rates in rows.items()}
        out["runs"] = rows
        for name, rate in out["clips_per_s"].items():
            print(f"{name}: {rate:.1f} clips/s", flush=True)
        out["long"] = _long(client, Path(tmp) / "long", args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
