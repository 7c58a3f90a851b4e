"""A Hugging Face dataset with ``Video`` features uploaded as its videos' files: read with
``Video(decode=False)`` (the file's bytes, or its path), never decoded (which needs
torchcodec, and would store frames)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from remote_loader.errors import UploadError


def video_columns(ds: Any) -> list[str]:
    """The columns of ``ds`` (a ``datasets.Dataset``) whose feature is a ``Video``; none for
    anything else."""
    features = getattr(ds, "features", None)
    if not isinstance(features, Mapping) or not hasattr(ds, "cast_column"):
        return []
    return [name for name, feature in features.items()
            if type(feature).__name__ == "Video" and type(feature).__module__.startswith("datasets")]


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
        if isinstance(value, Mapping) and value.get("bytes") is not None:
            return bytes(value["bytes"])
        path = value.get("path") if isinstance(value, Mapping) else None
        if not path:
            raise UploadError(f"sample {index}: column {column!r} holds no video (neither bytes nor a path)",
                              index=index)
        try:
            with open(path, "rb") as file:
                return file.read()
        except OSError as exc:
            raise UploadError(f"sample {index}: column {column!r}'s video {path!r} cannot be read ({exc.strerror})",
                              index=index) from None
