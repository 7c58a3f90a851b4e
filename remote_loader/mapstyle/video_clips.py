"""``RemoteVideoClips``: the clips of a torchvision video dataset (``UCF101``, ``HMDB51``,
``Kinetics``) uploaded as its videos' files, handed over as the class hands them over."""

from __future__ import annotations

import io
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from remote_loader.checks import as_index, require_bool, require_int
from remote_loader.errors import ConfigError, DecodeError, FormatError
from remote_loader.format.clip_index import ClipIndex
from remote_loader.format.video import VIDEO_EXTENSIONS
from remote_loader.frames import RangedFile, audio_between, decode_errors, frames_at
from remote_loader.mapstyle.dataset import RemoteMapDataset


class RemoteVideoClips(Dataset):
    """``ds[i]`` is clip ``i`` of the torchvision video dataset uploaded there, as the class's
    own ``ds[i]`` gives it: ``(video, audio, label)``, ``video`` its frames (uint8,
    ``T x H x W x C``, or ``T x C x H x W`` where the class was made with
    ``output_format="TCHW"``), ``audio`` the sound played meanwhile (float32, ``channels x
    samples``; ``1 x 0`` where the video has none, or with ``audio=False``), ``label`` its
    video's class. Each clip is decoded from its video's file, seeking to the key frame
    before it; the file is fetched with one ranged GET (``RemoteMapDataset``), or, over
    ``ranges_over`` bytes, read in parts of 1 MiB as the decoder asks for them: its index,
    then the key frame before the clip and the clip, not the whole file (``part`` bytes at a
    time).

    Args:
        client: A store, a boto3 S3 client or ``minio.Minio`` of your own, or an ``s3://`` URL.
        bucket: The bucket (omit with a URL).
        base_folder: The dataset's prefix (omit with a URL).
        audio: Decode each clip's audio.
        ranges_over: Videos larger than this many bytes are read in parts (None: always
            whole). A whole file is checked against its crc32; parts cannot be, so a damaged
            byte in them reaches the decoder (which refuses most damage, not all).
        transform: Applied to each clip's frames, as the class applies its ``transform``.
        **options: ``RemoteMapDataset``'s (``cache_dir``, ``fetch``, ``endpoint_url``...).
    """

    part = 1 << 20
    """Bytes a ranged read of a long video fetches at a time."""

    def __init__(self, client: Any, bucket: str | None = None, base_folder: str | None = None, *,
                 audio: bool = True, ranges_over: int | None = 64 << 20,
                 transform: Callable[[torch.Tensor], Any] | None = None, **options: Any) -> None:
        require_bool("audio", audio)  # 'no' was taken for True
        if ranges_over is not None:  # checked before the manifest is read, not after (numpy's integers taken)
            try:
                ranges_over = require_int("ranges_over", ranges_over, 0)
            except ConfigError:
                raise ConfigError(f"ranges_over must be a number of bytes >= 0 or None, got {ranges_over!r}") from None
        if transform is not None and not callable(transform):
            raise ConfigError(f"transform must be callable (applied to each clip), got {type(transform).__name__}")
        self.videos = RemoteMapDataset(client, bucket, base_folder, **options)
        where = str(self.videos.reader.location)
        upload = self.videos.reader.manifest.params.get("upload")
        raw = upload.get("video_clips") if isinstance(upload, dict) else None
        if raw is None:
            raise ConfigError(f"{where} was not uploaded from a torchvision video class (UCF101, HMDB51, Kinetics):"
                              " it has no clip index; read its videos with RemoteMapDataset or RemoteDataset")
        self.clip_index = ClipIndex.of_params(raw, where)
        videos = upload.get("samples") if isinstance(upload, dict) else None
        if len(self.clip_index.video_frames) != videos:
            raise FormatError(f"{where}: its clip index has {len(self.clip_index.video_frames)} videos where the upload"
                              f" read {videos}", name=where)
        self.audio, self.ranges_over, self.transform = audio, ranges_over, transform

    def __len__(self) -> int:
        return len(self.clip_index)

    @property
    def classes(self) -> list[str]:
        """The class names recorded at upload."""
        return self.videos.classes

    def __repr__(self) -> str:
        return f"RemoteVideoClips({self.videos.reader.location}, {len(self)} clips)"

    def __getitem__(self, i: int) -> tuple[Any, torch.Tensor, int]:
        i = as_index(i, "a clip index")
        video, clip = self.clip_index.locate(i)
        file, label, key = self._video(video)
        numbers = self.clip_index.clips_of(video)[clip]
        try:
            frames, sound = self._decode(file, numbers.tolist(), self.clip_index.video_fps[video] or 1.0)
        except DecodeError as exc:
            raise DecodeError(f"clip {i} (frames {numbers[0]}-{numbers[-1]} of sample {key!r}): {exc}",
                              key=key) from None
        if self.clip_index.output_format == "TCHW":
            frames = frames.permute(0, 3, 1, 2)
        if self.transform is not None:
            frames = self.transform(frames)
        return frames, sound, label

    def _video(self, video: int) -> tuple[Callable[[], Any], int, str]:
        """How to open video ``video``'s file (its bytes, or the file read in parts), its
        label and its sample's key."""
        key, members = self.videos.members_of(video)
        fields = [name for name in members if name in VIDEO_EXTENSIONS]
        if len(fields) != 1 or "cls" not in members:
            raise DecodeError(f"sample {key!r} (video {video}) holds fields {sorted(members)}, not one video and its"
                              " class", key=key)
        size = members[fields[0]][0]
        if self.ranges_over is not None and size > self.ranges_over:
            parts = RangedFile(partial(self.videos.read_member, video, fields[0]), size, block=self.part)
            return lambda: (parts.seek(0), parts)[1], int(self.videos.read_member(video, "cls")), key
        sample = self.videos.by_source_index(video)
        data = bytes(sample[fields[0]])
        return lambda: io.BytesIO(data), int(bytes(sample["cls"])), key

    def _decode(self, file: Callable[[], Any], numbers: list[int], fps: float) -> tuple[torch.Tensor, torch.Tensor]:
        with decode_errors() as av:
            with av.open(file(), mode="r") as container:
                if not container.streams.video:
                    raise DecodeError("a video file without a video stream")
                stream = container.streams.video[0]
                rate = float(stream.average_rate or stream.guessed_rate or fps)
                got = frames_at(container, stream, rate, numbers)
            sound = None
            if self.audio:
                with av.open(file(), mode="r") as container:
                    sound = audio_between(container, numbers[0] / fps, (numbers[-1] + 1) / fps)
        if len(got) != len(numbers):
            raise DecodeError(f"the video has {len(got)} of the clip's {len(numbers)} frames")
        frames = torch.from_numpy(np.stack(got))
        return frames, (torch.empty((1, 0), dtype=torch.float32) if sound is None else torch.from_numpy(sound))
