"""A Hugging Face dataset with ``Video`` features uploaded as its videos' files: read with
``Video(decode=False)`` (the file's bytes, or its path), never decoded (which needs
torchcodec, and would store frames)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from remote_loader.errors import ConfigError, UploadError
from remote_loader.format.video import video_extension


def video_columns(ds: Any) -> list[str]:
    """The columns of ``ds`` (a ``datasets.Dataset``) whose feature is a ``Video``; none for
    anything else. ConfigError for a ``Video`` inside another feature (a list of videos),
    which would be decoded."""
    features = getattr(ds, "features", None)
    if not isinstance(features, Mapping) or not hasattr(ds, "cast_column"):
        return []
    columns = [name for name, feature in features.items() if _is_video(feature)]
    nested = [name for name, feature in features.items() if not _is_video(feature) and _holds_video(feature)]
    if nested:
        raise ConfigError(f"column {nested[0]!r} holds Video features inside another feature (a list of videos):"
                          " only a column that is one Video is stored as its files; make each video a column")
    return columns


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


class HFVideos:
    """The rows of a Hugging Face dataset, each ``Video`` column as its file's bytes (a dict
    sample: ``{"video": b"...", "label": 3}`` is stored as ``video.mp4`` and ``label.cls``);
    its ``features`` kept, so their ``ClassLabel`` names are the upload's classes."""

    def __init__(self, ds: Any, columns: list[str]) -> None:
        from datasets import Video

        self.features, self.columns = ds.features, columns
        for column in columns:
            ds = ds.cast_column(column, Video(decode=False))
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = dict(self.ds[index])
        for column in self.columns:
            row[column] = self._file(row[column], index, column)
        return row

    @staticmethod
    def _file(value: Any, index: int, column: str) -> bytes:
        """A ``Video(decode=False)`` value's bytes: its own, else its file's."""
        path = value.get("path") if isinstance(value, Mapping) else None
        if isinstance(value, Mapping) and value.get("bytes") is not None:
            data = bytes(value["bytes"])
        elif not path:
            raise UploadError(f"sample {index}: column {column!r} holds no video (neither bytes nor a path)",
                              index=index)
        else:
            try:
                with open(path, "rb") as file:
                    data = file.read()
            except OSError as exc:
                raise UploadError(f"sample {index}: column {column!r}'s video {path!r} cannot be read"
                                  f" ({exc.strerror})", index=index) from None
        if video_extension(data) is None:
            raise UploadError(f"sample {index}: column {column!r} holds {path or 'bytes'!r}, which is not a video file"
                              " (mp4, mov, mkv, webm, avi)", index=index)
        return data
