"""Upload an image-folder tree (``root/<class>/<image>``) into a bucket, then check it.

    python examples/upload_imagefolder.py /data/imagenet/train --url s3://datasets/imagenet-train
    python examples/upload_imagefolder.py --local-server      # a tiny generated tree, embedded server

Each image file is stored with its original bytes next to its class index; shards are
written as multipart uploads and an interrupted run resumes where it stopped. Afterwards
the script reads every sample back and checks that each stored image is byte-identical
to a source file of the same class.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

from common import add_location_args, maybe_local_server

from remote_loader import DatasetReader, ImageFolder, make_client, upload_cv_dataset
from remote_loader.storage import parse_location
from remote_loader.testing.synthetic import SyntheticImages

JPEG_MAGIC = bytes.fromhex("ffd8")


def make_tree(root: Path, images: int) -> Path:
    """Write ``images`` small JPEG and PNG files in 4 class folders under ``root``."""
    ds = SyntheticImages(images, num_classes=4, size=(96, 72), formats=("jpeg", "png"))
    for i in range(images):
        data, label = ds[i]
        folder = root / ds.classes[label]
        folder.mkdir(parents=True, exist_ok=True)
        suffix = "jpg" if data.startswith(JPEG_MAGIC) else "png"
        (folder / f"{i:06d}.{suffix}").write_bytes(data)
    return root


def check_round_trip(reader: DatasetReader, folder: ImageFolder) -> int:
    """Return how many stored samples match a source file byte for byte (each file used once)."""
    sources = collections.Counter((Path(path).read_bytes(), label) for path, label in folder.samples)
    matched = 0
    for sample in reader:
        image = sample.get("jpg", sample.get("png", sample.get("webp")))
        item = (bytes(image), int(bytes(sample["cls"])))
        if sources[item] > 0:
            sources[item] -= 1
            matched += 1
    return matched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", help="the image folder (generated with --local-server)")
    add_location_args(parser, "imagefolder")
    parser.add_argument("--maxsize", type=float, default=1e8, help="maximum shard size in bytes")
    parser.add_argument("--maxcount", type=int, default=100_000, help="maximum samples per shard")
    parser.add_argument("--workers", type=int, default=None, help="encoding processes (default: CPU count)")
    parser.add_argument("--images", type=int, default=120, help="images to generate with --local-server")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    args = parser.parse_args()
    if args.root is None and not args.local_server:
        parser.error("give the image folder, or --local-server to generate one")

    with maybe_local_server(args), tempfile.TemporaryDirectory() as tmp:
        root = Path(args.root) if args.root else make_tree(Path(tmp) / "tree", args.images)
        if args.local_server and not args.root:
            args.maxcount = min(args.maxcount, 32)  # several shards even for a tiny tree
        folder = ImageFolder(root)
        location = parse_location(args.url)
        client = make_client()
        summary = upload_cv_dataset(folder, client=client, bucket=location.bucket, base_folder=location.base_folder,
                                    maxsize=args.maxsize, maxcount=args.maxcount, workers=args.workers,
                                    progress=not args.json)
        reader = DatasetReader(client, location.bucket, location.base_folder)
        matched = check_round_trip(reader, folder)
        report = {"url": args.url, "files": len(folder), "classes": len(folder.classes), "samples": summary.samples,
                  "shards": summary.shards, "identical": matched, "mb_per_s": round(summary.mb_per_s, 2)}
        client.close()
    if args.json:
        print(json.dumps(report))
    else:
        print(summary)
        print(f"read back {report['identical']} of {report['files']} files byte-identical with their class")
    if report["identical"] != report["files"]:
        raise SystemExit("round trip failed: some stored images differ from their source files")


if __name__ == "__main__":
    main()
