"""Datasets to upload from: an image-folder tree, ``module:function``, and file-backed items."""

from __future__ import annotations

import importlib
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remote_loader.checks import one_line, require_path
from remote_loader.errors import ConfigError, UploadError
from remote_loader.upload.hf_files import HFFiles, image_columns, video_columns
from remote_loader.upload.video_classes import class_videos, is_video_class

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi")


class ImageFolder:
    """An image-folder tree (``root/<class>/<image>``) read as torchvision's ImageFolder reads it.

    Classes are the sorted subfolder names; ``ds[i]`` returns ``(path, class_index)``, so the
    uploader stores each file's original bytes. Needs no torchvision.

    Args:
        root: The directory holding one subfolder per class.

    Examples:
        >>> ds = ImageFolder("/data/imagenet/val")
        >>> ds.classes[:2], len(ds)
    """

    suffixes: tuple[str, ...] = IMAGE_SUFFIXES
    what = "image"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(require_path(f"{self.what} folder", root))
        if not self.root.is_dir():
            raise ConfigError(f"{self.what} folder {str(self.root)!r} is not a directory")
        self.classes = sorted(entry.name for entry in os.scandir(self.root) if entry.is_dir())
        if not self.classes:
            raise ConfigError(f"{self.what} folder {str(self.root)!r} has no class subfolders")
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        for name in self.classes:
            for dirpath, files in _walk(str(self.root / name)):
                for file in sorted(files):
                    if file.lower().endswith(self.suffixes):
                        self.samples.append((os.path.join(dirpath, file), self.class_to_idx[name]))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[str, int]:
        return self.samples[index]


def _walk(top: str) -> list[tuple[str, list[str]]]:
    """Each folder under ``top`` with its files, sorted by path, following links to folders
    as torchvision's ImageFolder does, but never into a folder that holds the link (a link
    to ``.`` or ``..``, to the tree's root or above it): walked again at each level, such a
    loop listed every image about 40 times, until the path was too deep, and two loops in
    one folder made a listing that never ended."""
    def key(path: str | Path) -> tuple[int, int] | None:
        try:
            found = os.stat(path)
        except OSError:  # a broken link: os.walk would not list it either
            return None
        return found.st_dev, found.st_ino

    real = Path(os.path.realpath(top))
    above: dict[str, frozenset[tuple[int, int] | None]] = {top: frozenset(map(key, [real, *real.parents]))}
    out = []
    for dirpath, dirnames, files in os.walk(top, followlinks=True):
        chain = above.pop(dirpath)
        dirnames[:] = [d for d in dirnames if key(os.path.join(dirpath, d)) not in chain]
        above.update((os.path.join(dirpath, d), chain | {key(os.path.join(dirpath, d))}) for d in dirnames)
        out.append((dirpath, files))
    return sorted(out)


class VideoFolder(ImageFolder):
    """A tree of video files, one subfolder per class (``root/<class>/<video>``: UCF101's and
    HMDB51's layout), read as ``ImageFolder`` reads images: ``ds[i]`` is ``(path,
    class_index)``, and each video is stored as its file's bytes (docs/video.md)."""

    suffixes = VIDEO_SUFFIXES
    what = "video"


def is_file_backed(ds: Any) -> bool:
    """Return whether ``ds`` is a torchvision ``DatasetFolder`` whose items are plain files.

    Such a dataset decodes and converts each image in ``__getitem__``; reading
    ``ds.samples[i]`` instead keeps the files' original bytes. Only an untransformed dataset
    with torchvision's default loader qualifies.
    """
    loader = getattr(ds, "loader", None)
    return (
        isinstance(getattr(ds, "samples", None), list)
        and getattr(loader, "__module__", "").startswith("torchvision")
        and getattr(loader, "__name__", "") in ("default_loader", "pil_loader")
        and getattr(ds, "transform", None) is None
        and getattr(ds, "target_transform", None) is None
        and getattr(ds, "transforms", None) is None
    )


def load_source(spec: str) -> Any:
    """Return the dataset named by ``spec``: an image-folder directory (a video folder where it
    holds videos and no image) or ``module:function``.

    ``module:function`` imports ``module`` (the current directory is searched first) and
    returns ``function()``.
    """
    if Path(spec).is_dir():
        images = ImageFolder(spec)
        if not len(images):  # no image in it: a tree of videos, if it holds any
            videos = VideoFolder(spec)
            return videos if len(videos) else images
        return images
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise ConfigError(f"source {spec!r} is neither a directory nor module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for source {spec!r}: {one_line(exc)}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(f"{module_name!r} has no callable {function_name!r}")
    try:
        dataset = function()
    except Exception as exc:
        raise ConfigError(
            f"source {spec!r}: {function_name}() raised {type(exc).__name__}: {one_line(exc)}"[:300]
        ) from None
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) or isinstance(dataset, (str, bytes)):
        raise ConfigError(f"source {spec!r} returned a {type(dataset).__name__}, not a dataset (len(ds) and ds[i])")
    return uploaded_form(dataset)


def uploaded_form(ds: Any) -> Any:
    """What an upload reads of ``ds``: the files of a torchvision video class (``UCF101``...),
    one item a video, with its clip index (``video_classes.py``); a Hugging Face dataset's
    ``Video`` and ``Image`` columns as their files' bytes (``hf_files.py``); any other dataset
    as it is."""
    if is_video_class(ds):
        return class_videos(ds)
    videos, images = video_columns(ds), image_columns(ds)
    return HFFiles(ds, videos, images) if videos or images else ds


@dataclass(frozen=True)
class SourceSpec:
    """A dataset named by a ``load_source`` spec: what an upload's worker plugin carries to a
    Dask cluster's workers instead of the dataset (``shipping.py``). Each worker builds it at
    its first task of the upload, once, and drops it when the upload ends, so a later upload
    of the same spec reads the folder or calls the function anew."""

    spec: str


@dataclass(frozen=True)
class Shipped:
    """A dataset sent to this worker once, by a Dask worker plugin (``shipping.py``)."""

    token: str


class _Built:
    """A ``SourceSpec``'s dataset in this worker, built by the first task that asks for it;
    the others wait for that one rather than build their own."""

    def __init__(self, source: SourceSpec) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._dataset: Any = None

    def dataset(self) -> Any:
        with self._lock:
            if self._dataset is None:
                self._dataset = load_source(self.source.spec)
            return self._dataset


_shipped: dict[str, Any] = {}


def keep_shipped(token: str, dataset: Any) -> None:
    """Hold an upload's dataset (or the ``SourceSpec`` to build it from) in this worker while the upload runs."""
    _shipped[token] = _Built(dataset) if isinstance(dataset, SourceSpec) else dataset


def drop_shipped(token: str) -> None:
    _shipped.pop(token, None)


def resolve(dataset: Any) -> Any:
    """The dataset itself; for a ``Shipped`` the one its plugin left in this worker (built
    here from its source spec the first time it is asked for)."""
    if not isinstance(dataset, Shipped):
        return dataset
    held = _shipped.get(dataset.token)
    if held is None:
        raise UploadError("this Dask worker has not received the upload's dataset (its worker plugin was"
                          " removed: the upload ended or was interrupted); re-run the upload")
    return held.dataset() if isinstance(held, _Built) else held
