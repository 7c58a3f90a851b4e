"""A Hugging Face dataset's ``Video`` and ``Image`` columns uploaded as their files: read with
``Video(decode=False)`` / ``Image(decode=False)`` (the file's bytes, or its path), never
decoded. A video decoded needs torchcodec and would store frames; an image decoded would be
encoded again (a JPEG a second time, a PNG as a lossy JPEG), where its own bytes are what
``ds[i]`` decodes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from remote_loader.errors import ConfigError, UploadError
from remote_loader.format.video import video_extension
from remote_loader.upload.encode import check_image


def video_columns(ds: Any) -> list[str]:
    """The columns of ``ds`` (a ``datasets.Dataset``) whose feature is a ``Video``; none for
    anything else. ConfigError for a ``Video`` inside another feature (a list of videos),
    which would be decoded."""
    features = _features(ds)
    columns = [name for name, feature in features.items() if _is_video(feature)]
    nested = [name for name, feature in features.items() if not _is_video(feature) and _holds_video(feature)]
    if nested:
        raise ConfigError(f"column {nested[0]!r} holds Video features inside another feature (a list of videos):"
                          " only a column that is one Video is stored as its files; make each video a column")
    return columns


def image_columns(ds: Any) -> list[str]:
    """The columns of ``ds`` whose feature is an ``Image`` that hands out its file's pixels as
    they are (no ``mode`` to convert them to), where ``ds[i]`` is the dataset's own row (no
    format or transform set); none for anything else."""
    features = _features(ds)
    if getattr(ds, "format", {}).get("type") is not None:
        return []
    return [name for name, feature in features.items()
            if type(feature).__name__ == "Image" and type(feature).__module__.startswith("datasets")
            and getattr(feature, "mode", None) is None]


def _features(ds: Any) -> Mapping[str, Any]:
    features = getattr(ds, "features", None)
    return features if isinstance(features, Mapping) and hasattr(ds, "cast_column") else {}


def _is_video(feature: Any) -> bool:
    return type(feature).__name__ == "Video" and type(feature).__module__.startswith("datasets")


def _holds_video(feature: Any) -> bool:
    """Whether a Video feature lies anywhere inside ``feature`` (lists, dicts, sequences)."""
    if _is_video(feature):
        return True
    if isinstance(feature, Mapping):
        return any(_holds_video(f) for f in feature.values())
    if isinstance(feature, list | tuple):
        return any(_holds_video(f) for f in feature)
    inner = getattr(feature, "feature", None)  # Sequence and List keep theirs here
    return inner is not None and _holds_video(inner)


class HFFiles:
    """The rows of a Hugging Face dataset, each ``Video`` and ``Image`` column as its file's
    bytes (a dict sample: ``{"video": b"...", "label": 3}`` is stored as ``video.mp4`` and
    ``label.cls``, ``{"image": b"..."}`` as ``image.jpg``, read back as the image ``ds[i]``
    gave); its ``features`` kept, so their ``ClassLabel`` names are the upload's classes."""

    def __init__(self, ds: Any, videos: list[str], images: list[str]) -> None:
        from datasets import Image, Video

        self.features, self.videos, self.images = ds.features, videos, images
        for column in videos:
            ds = ds.cast_column(column, Video(decode=False))
        for column in images:
            ds = ds.cast_column(column, Image(decode=False))
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = dict(self.ds[index])
        for column in self.videos:
            row[column] = _video(_file(row[column], index, column, "video"), index, column, row[column])
        for column in self.images:
            if row[column] is not None:  # an image left out of a row stays None
                row[column] = check_image(_file(row[column], index, column, "image"), index,
                                          f"column {column!r}'s image")
        return row


def _file(value: Any, index: int, column: str, what: str) -> bytes:
    """A ``Video(decode=False)`` or ``Image(decode=False)`` value's bytes: its own, else its file's."""
    path = value.get("path") if isinstance(value, Mapping) else None
    if isinstance(value, Mapping) and value.get("bytes") is not None:
        return bytes(value["bytes"])
    if not path:
        raise UploadError(f"sample {index}: column {column!r} holds no {what} (neither bytes nor a path)",
                          index=index)
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise UploadError(f"sample {index}: column {column!r}'s {what} {path!r} cannot be read"
                          f" ({exc.strerror})", index=index) from None


def _video(data: bytes, index: int, column: str, value: Any) -> bytes:
    if video_extension(data) is None:
        path = value.get("path") if isinstance(value, Mapping) else None
        raise UploadError(f"sample {index}: column {column!r} holds {path or 'bytes'!r}, which is not a video file"
                          " (mp4, mov, mkv, webm, avi)", index=index)
    return data
