"""A generated image dataset, for demos, tests and benchmarks: no download, fully deterministic."""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image

from remote_loader.errors import ConfigError

_FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}


class SyntheticImages:
    """``n`` images in class order (like an image folder), each built from its index alone.

    Images are smooth colour fields plus grain, so they compress like photographs (about
    110 KB as JPEG at the default 500x375, quality 90).

    Args:
        n: Number of samples.
        num_classes: Labels run ``0..num_classes-1`` in contiguous blocks.
        size: ``(width, height)``; each image varies it by up to ±25%.
        formats: Encodings cycled by index (``"jpeg"``, ``"png"``, ``"webp"``).
        output: ``"bytes"`` (encoded files, stored as they are) or ``"pil"`` (in-memory images).
        seed: Changes every image.
        quality: JPEG/WebP quality of the generated files.

    Examples:
        >>> ds = SyntheticImages(100, num_classes=10)
        >>> data, label = ds[0]
        >>> data[:2] == b"\\xff\\xd8", label
        (True, 0)
    """

    def __init__(
        self,
        n: int,
        *,
        num_classes: int = 10,
        size: tuple[int, int] = (500, 375),
        formats: tuple[str, ...] = ("jpeg",),
        output: str = "bytes",
        seed: int = 0,
        quality: int = 90,
    ) -> None:
        if n < 0 or num_classes < 1:
            raise ConfigError(f"need n >= 0 and num_classes >= 1, got {n}, {num_classes}")
        if not formats or any(f not in _FORMATS for f in formats):
            raise ConfigError(f"formats must be drawn from {sorted(_FORMATS)}, got {formats!r}")
        if output not in ("bytes", "pil"):
            raise ConfigError(f"output must be 'bytes' or 'pil', got {output!r}")
        self.n, self.num_classes, self.size = n, num_classes, size
        self.formats, self.output, self.seed, self.quality = formats, output, seed, quality
        self.classes = [f"class_{i:04d}" for i in range(num_classes)]

    def __len__(self) -> int:
        return self.n

    def label(self, index: int) -> int:
        """The class of sample ``index`` (contiguous blocks, as a folder tree gives them)."""
        return index * self.num_classes // self.n

    def image(self, index: int) -> Image.Image:
        """The image of sample ``index``, as a PIL RGB image."""
        rng = np.random.default_rng([self.seed, index])
        width = int(self.size[0] * rng.uniform(0.75, 1.25))
        height = int(self.size[1] * rng.uniform(0.75, 1.25))
        coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
        base = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
        grain = rng.normal(0, 28, size=(height, width, 1)).astype(np.int16)
        return Image.fromarray(np.clip(base + grain, 0, 255).astype(np.uint8))

    def encoded(self, index: int) -> bytes:
        """The image of sample ``index`` encoded in its format."""
        out = io.BytesIO()
        self.image(index).save(out, format=_FORMATS[self.formats[index % len(self.formats)]], quality=self.quality)
        return out.getvalue()

    def __getitem__(self, index: int) -> tuple[bytes | Image.Image, int]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} samples")
        image = self.encoded(index) if self.output == "bytes" else self.image(index)
        return image, self.label(index)


class SyntheticVideos:
    """``n`` short videos, each built from its index alone, as ``(path, label)`` pairs: each
    an mp4 file (H.264) written into ``root`` when first asked for. Needs PyAV (the ``video``
    extra).

    Each frame is a smooth colour field that drifts from frame to frame, with a bright square
    moving across it. ``lossless=True`` writes H.264 without loss (RGB, ``qp=0``): the frames
    decode to exactly ``frames_of(index)``, which the tests compare clips against.

    Args:
        n: Number of samples.
        root: The folder the files are written to.
        num_classes: Labels run ``0..num_classes-1`` in contiguous blocks.
        frames: Frames in each video.
        size: ``(width, height)`` (even numbers: H.264's 4:2:0 needs them).
        fps: Frames a second.
        gop: Frames from one key frame to the next (a clip's decode seeks to the key frame before it).
        lossless: Write frames that decode exactly as made.
        seed: Changes every video.
    """

    def __init__(self, n: int, root: str, *, num_classes: int = 4, frames: int = 48, size: tuple[int, int] = (64, 48),
                 fps: int = 24, gop: int = 12, lossless: bool = False, seed: int = 0) -> None:
        if n < 0 or num_classes < 1 or frames < 1 or size[0] % 2 or size[1] % 2:
            raise ConfigError(f"need n >= 0, num_classes >= 1, frames >= 1 and an even size; got {n}, {num_classes},"
                              f" {frames}, {size}")
        self.n, self.root, self.num_classes, self.frames, self.size = n, root, num_classes, frames, size
        self.fps, self.gop, self.lossless, self.seed = fps, gop, lossless, seed

    def __len__(self) -> int:
        return self.n

    def label(self, index: int) -> int:
        return index * self.num_classes // self.n

    def frames_of(self, index: int) -> np.ndarray:
        """The frames of video ``index`` as made, ``T x H x W x 3`` uint8."""
        rng = np.random.default_rng([self.seed, index])
        width, height = self.size
        coarse = rng.integers(0, 256, size=(3, 4, 3), dtype=np.uint8)
        base = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
        out = np.empty((self.frames, height, width, 3), dtype=np.uint8)
        side = max(2, height // 4)
        for t in range(self.frames):
            frame = np.clip(base + (t * 3) % 64, 0, 255).astype(np.uint8)
            x = (t * 2) % max(1, width - side)
            frame[height // 3 : height // 3 + side, x : x + side] = 255
            out[t] = frame
        return out

    def path(self, index: int) -> str:
        """Video ``index``'s file, written if it is not there yet."""
        path = os.path.join(self.root, f"video_{index:05d}.mp4")
        if not os.path.exists(path):
            os.makedirs(self.root, exist_ok=True)
            partial = f"{path}.{os.getpid()}.part"
            self._write(index, partial)
            os.replace(partial, path)
        return path

    def _write(self, index: int, path: str) -> None:
        try:
            import av
        except ImportError:
            raise ConfigError("SyntheticVideos writes its videos with PyAV: pip install '.[video]'") from None
        with av.open(path, mode="w", format="mp4") as container:
            stream = container.add_stream("libx264rgb" if self.lossless else "libx264", rate=self.fps)
            stream.width, stream.height = self.size
            stream.pix_fmt = "rgb24" if self.lossless else "yuv420p"
            stream.codec_context.gop_size = self.gop
            # no B-frames: each frame's time stamp is its number, in decoding order too
            stream.codec_context.options = {"qp": "0", "bf": "0"} if self.lossless else {"crf": "23", "bf": "0"}
            for pixels in self.frames_of(index):
                for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)

    def __getitem__(self, index: int) -> tuple[str, int]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} samples")
        return self.path(index), self.label(index)


def write_avi(path: str, frames: int, *, seed: int = 0, fps: int = 10, audio_rate: int | None = 8000,
              size: tuple[int, int] = (64, 48)) -> None:
    """An AVI as UCF101's are: MPEG-4 video (a key frame every 6 frames) of a coloured field
    with a bright square moving across it, and (``audio_rate`` samples a second; None for
    none) a tone swelling from a quarter of its loudness as 16-bit PCM, as long as the
    video. Needs PyAV (the ``video`` extra)."""
    try:
        import av
    except ImportError:
        raise ConfigError("write_avi writes its videos with PyAV: pip install '.[video]'") from None
    rng = np.random.default_rng(seed)
    width, height = size
    with av.open(path, "w", format="avi") as container:  # every stream added before the first packet
        video = container.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.codec_context.gop_size = 6
        sound = container.add_stream("pcm_s16le", rate=audio_rate, layout="mono") if audio_rate else None
        side = max(2, height // 5)
        rate = audio_rate or 0
        per_frame = rate // fps
        ticks = np.arange(frames * per_frame)
        swell = 0.25 + 0.75 * ticks / max(1, len(ticks))  # louder as it goes: no two stretches of it alike
        wave = (np.sin(ticks * (2 * np.pi * (203.7 + 50 * seed) / max(1, rate))) * 8000 * swell).astype(np.int16)
        for t in range(frames):  # each frame's sound muxed beside it, as a camera's file interleaves them
            pixels = np.full((height, width, 3), rng.integers(0, 256, 3), dtype=np.uint8)
            x = (3 * t) % max(1, width - side)
            pixels[height // 4 : height // 4 + side, x : x + side] = 255
            for packet in video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
            if sound is not None:
                chunk = av.AudioFrame.from_ndarray(wave[None, t * per_frame : (t + 1) * per_frame], format="s16",
                                                   layout="mono")
                chunk.sample_rate, chunk.pts = rate, t * per_frame
                for packet in sound.encode(chunk):
                    container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if sound is not None:
            for packet in sound.encode():
                container.mux(packet)


def ucf101_tree(root: str, classes: int = 2, per_class: int = 3, frames: int = 40, fps: int = 10,
                size: tuple[int, int] = (64, 48)) -> tuple[str, str, dict[str, object]]:
    """A small UCF101 on disk, in its own layout: ``root/UCF-101/<class>/v_<class>_gNN_c01.avi``
    (MPEG-4 with sound, ``frames`` frames of ``size`` each, ``write_avi``) and ``root/splits/`` with the
    three folds' ``trainlistNN.txt`` and ``testlistNN.txt`` (the last video of each class is
    for testing). Returns the two folders and the metadata torchvision's ``VideoClips``
    computes for them (each video's frame numbers and rate), for ``_precomputed_metadata``:
    its own computation reads every video with torchcodec."""
    import torch  # only here: the demo's images need no torch

    videos, splits = os.path.join(root, "UCF-101"), os.path.join(root, "splits")
    os.makedirs(splits, exist_ok=True)
    names = [f"Action{c:02d}" for c in range(classes)]
    train: list[str] = []
    test: list[str] = []
    paths: list[str] = []
    for c, name in enumerate(names):
        os.makedirs(os.path.join(videos, name), exist_ok=True)
        for g in range(per_class):
            file = f"v_{name}_g{g + 1:02d}_c01.avi"
            path = os.path.join(videos, name, file)
            write_avi(path, frames, seed=per_class * c + g, fps=fps, size=size)
            paths.append(path)
            (test if g == per_class - 1 else train).append(f"{name}/{file}")
    for fold in (1, 2, 3):
        with open(os.path.join(splits, f"trainlist{fold:02d}.txt"), "w") as out:
            out.writelines(f"{line} {1 + names.index(line.split('/')[0])}\n" for line in train)
        with open(os.path.join(splits, f"testlist{fold:02d}.txt"), "w") as out:
            out.writelines(f"{line}\n" for line in test)
    metadata: dict[str, object] = {"video_paths": paths, "video_pts": [torch.arange(frames) for _ in paths],
                                   "video_fps": [float(fps)] * len(paths)}
    return videos, splits, metadata
