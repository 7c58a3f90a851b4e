"""torchvision's video classes (``UCF101``, ``HMDB51``, ``Kinetics``, anything with a
``video_clips`` of ``VideoClips`` and ``samples`` of ``(path, class)``) uploaded as their
videos' files, once each, with the clip index that says which frames of which video
``ds[i]`` hands over (``format/clip_index.py``): ``ds[i]`` decodes a clip, and several
clips of one video would each store its frames again."""

from __future__ import annotations

import os
from typing import Any

from remote_loader.errors import ConfigError
from remote_loader.format.clip_index import LAYOUTS, ClipIndex


class ClassVideos:
    """The videos of a torchvision video dataset as ``(path, class)`` items, one a video
    in the class's order (its ``video_clips.video_paths``), with its ``classes`` and the
    ``clip_index`` of its clips."""

    def __init__(self, items: list[tuple[str, int]], classes: list[str], clip_index: ClipIndex) -> None:
        self.items, self.classes, self.clip_index = items, classes, clip_index

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[str, int]:
        return self.items[index]


def is_video_class(ds: Any) -> bool:
    """Whether ``ds`` is built on torchvision's ``VideoClips`` (told by its attributes)."""
    clips = getattr(ds, "video_clips", None)
    return (type(clips).__name__ == "VideoClips" and isinstance(getattr(clips, "video_paths", None), list)
            and isinstance(getattr(ds, "samples", None), list))


def class_videos(ds: Any) -> ClassVideos:
    """The files and clip index of a torchvision video dataset; ConfigError where its clips
    are not its files' frames as they are (a ``transform``, a resized decode)."""
    name = type(ds).__name__
    if getattr(ds, "transform", None) is not None:
        raise ConfigError(f"{name} has a transform: upload it with transform=None (its videos' files are stored,"
                          " and its clips decoded where they are read; apply the transform there)")
    clips = ds.video_clips
    for option in ("_video_width", "_video_height", "_video_min_dimension", "_video_max_dimension",
                   "_audio_samples", "_audio_channels"):
        if getattr(clips, option, 0):
            raise ConfigError(f"{name} was made with {option.lstrip('_')}={getattr(clips, option)!r}: its videos'"
                              " files are stored as they are; upload it without that option")
    if clips.output_format not in LAYOUTS:
        raise ConfigError(f"{name}'s output_format {clips.output_format!r} is not one of {', '.join(LAYOUTS)}")
    labels = {os.path.normpath(str(path)): label for path, label in ds.samples}
    items = []
    for v, path in enumerate(clips.video_paths):
        label = labels.get(os.path.normpath(str(path)))
        if label is None:
            raise ConfigError(f"{name}: video {v} ({path}) is not among its samples: no class for it")
        items.append((str(path), int(label)))
    index = ClipIndex(int(clips.num_frames), int(clips.step), None if clips.frame_rate is None else
                      float(clips.frame_rate), clips.output_format, tuple(len(pts) for pts in clips.video_pts),
                      tuple(None if fps is None else float(fps) for fps in clips.video_fps))
    if len(index) != len(ds):
        raise ConfigError(f"{name} holds {len(ds)} clips where its videos' frame counts give {len(index)}")
    classes = getattr(ds, "classes", None)
    return ClassVideos(items, list(classes) if isinstance(classes, list) else [], index)
