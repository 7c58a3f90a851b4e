"""Datasets the tests upload (importable by worker processes), and uploads with no progress bar."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from remote_loader import UploadSummary, upload_cv_dataset
from remote_loader.storage import Store
from remote_loader.testing.synthetic import SyntheticImages


def vision() -> Any:
    """torchvision, or a skip where it is not installed. One installed that does not import
    fails the test: a user's script would fail the same way."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (the vision extra)")
    import torchvision

    return torchvision


def require_nvimagecodec() -> None:
    """Skip the calling test unless nvImageCodec (the gpu extra) imports."""
    import pytest

    from remote_loader.errors import ConfigError
    from remote_loader.pipeline.device import nvimgcodec

    try:
        nvimgcodec()
    except ConfigError:
        pytest.skip("nvImageCodec is not installed (the gpu extra)")


def upload(
    client: Store | Any, bucket: str, folder: str, ds: Any, *, workers: int = 0, progress: bool = False, **options: Any
) -> UploadSummary:
    """Upload ``ds`` to ``folder`` of ``bucket`` (which exists already), in this process and with no
    progress bar unless told otherwise; ``options`` as ``upload_cv_dataset`` takes them. Returns its summary."""
    return upload_cv_dataset(
        ds, client=client, bucket=bucket, base_folder=folder, workers=workers, progress=progress, **options
    )


def upload_to_new_bucket(client: Store, bucket: str, folder: str, ds: Any, *, maxcount: int, workers: int = 0,
                         **options: Any) -> None:
    """Create ``bucket`` and upload ``ds`` to ``folder`` in shards of ``maxcount``, with no progress bar."""
    client.create_bucket(bucket)
    upload(client, bucket, folder, ds, maxcount=maxcount, workers=workers, **options)


class FlakyImages(SyntheticImages):
    """Synthetic images where the listed indices return bytes that are not an image."""

    def __init__(self, n: int, bad: set[int], **kwargs: object) -> None:
        super().__init__(n, **kwargs)  # type: ignore[arg-type]
        self.bad = bad

    def __getitem__(self, index: int):  # type: ignore[override]
        if index in self.bad:
            return b"this is not an image", 0
        return super().__getitem__(index)


class WaitingPath(os.PathLike):
    """An item's image given as a path that ``until()`` makes ready: the upload asks for it
    (``os.fspath``) as it encodes the item, once ``ds[i]`` has returned, so a test can make an
    item wait, or crash, beside another task's ``ds[i]`` (which a process calls from one thread
    at a time). ``path`` is the file named then: by default, none."""

    def __init__(self, until: Any, path: Any = "/nonexistent/image.png") -> None:
        self.until, self.path = until, path

    def __fspath__(self) -> str:
        self.until()
        return os.fspath(self.path)


def the_other_task(me: threading.Thread) -> str:
    """Once the other task thread of this process is inside a ``__getitem__`` ("reading") or
    waiting for its turn at the dataset ("waiting", ``watch.Reading.turn``), which."""
    for _ in range(6000):
        for thread in threading.enumerate():
            frame = sys._current_frames().get(thread.ident or 0)
            if thread is me or thread.name != "remote-loader-task" or frame is None:
                continue
            names = set()
            while frame is not None:
                names.add(frame.f_code.co_name)
                frame = frame.f_back
            if "__getitem__" in names:
                return "reading"
            if "_wait_turn" in names:
                return "waiting"
        threading.Event().wait(0.01)
    raise AssertionError("the other task never came to read")


def fingerprinting() -> bool:
    """Whether the caller's item is read for the upload's fingerprint (``remote_loader.upload.fingerprint``),
    ahead of the upload's own read of it: the datasets below that stop an upload at an item
    stop it at that read, where the test means them to."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("upload", "fingerprint.py")):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class KillingImages(SyntheticImages):
    """Synthetic images that SIGKILL their whole process group when ``kill_at`` is read.

    Stands in for a machine that dies mid-upload: no clean-up code runs anywhere.
    """

    def __init__(self, n: int, kill_at: int, **kwargs: object) -> None:
        super().__init__(n, **kwargs)  # type: ignore[arg-type]
        self.kill_at = kill_at

    def __getitem__(self, index: int):  # type: ignore[override]
        if index == self.kill_at and not fingerprinting():
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return super().__getitem__(index)


class NoisyImages(SyntheticImages):
    """Synthetic images where the listed indices are large noise PNGs, which do not compress."""

    def __init__(self, n: int, noisy: set[int], **kwargs: object) -> None:
        super().__init__(n, **kwargs)  # type: ignore[arg-type]
        self.noisy = noisy

    def __getitem__(self, index: int):  # type: ignore[override]
        if index in self.noisy:
            import io

            import numpy as np
            from PIL import Image

            pixels = np.random.default_rng(index).integers(0, 256, (128, 128, 3), dtype=np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, format="PNG")
            return out.getvalue(), 0
        return super().__getitem__(index)


unpickled = 0  # CountedImages unpickled in this process


class CountedImages(SyntheticImages):
    """Synthetic images that count how often this process unpickled one (``unpickled``)."""

    def __setstate__(self, state: dict[str, object]) -> None:
        global unpickled
        unpickled += 1
        self.__dict__.update(state)


def unpickled_count() -> int:
    return unpickled


small_images_built = 0


def small_images() -> SyntheticImages:
    """A ``module:function`` source for uploads on a cluster (counted: ``small_images_count``)."""
    global small_images_built
    small_images_built += 1
    return SyntheticImages(300, num_classes=7, size=(64, 48))


def small_images_count() -> int:
    """How many times this process built ``small_images``."""
    return small_images_built


class BlockingImages(SyntheticImages):
    """Synthetic images whose sample ``block_at`` connects to 127.0.0.1:``port`` and waits
    there until the connection ends: the test learns the upload reached it by accepting."""

    released: Exception | None = RuntimeError("released")

    def __init__(self, n: int, block_at: int | None, port: int, **kwargs: object) -> None:
        super().__init__(n, **kwargs)  # type: ignore[arg-type]
        self.block_at, self.port = block_at, port

    def __getitem__(self, index: int):  # type: ignore[override]
        if index == self.block_at and not fingerprinting():
            import socket

            with socket.create_connection(("127.0.0.1", self.port)) as connection:
                connection.recv(1)
            if self.released is not None:
                raise self.released
        return super().__getitem__(index)


class PausingImages(BlockingImages):
    """``BlockingImages`` whose sample ``pause_at`` returns normally once the test closes the
    connection: an upload held still at a known point, for as long as the test needs."""

    released = None

    def __init__(self, n: int, pause_at: int, port: int, **kwargs: object) -> None:
        super().__init__(n, pause_at, port, **kwargs)


FLAKY_MARK = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"remote-loader-flaky-{os.getuid()}")


class MarkedImages(SyntheticImages):
    """Synthetic images whose sample 5 is not an image while the file ``FLAKY_MARK`` exists:
    a fault the test can take away between two runs of the same upload."""

    def __getitem__(self, index: int):  # type: ignore[override]
        if index == 5 and os.path.exists(FLAKY_MARK):
            return b"this is not an image", 0
        return super().__getitem__(index)


def marked_images() -> MarkedImages:
    """A ``module:function`` source for uploads on a cluster."""
    return MarkedImages(60, size=(32, 24))


class StuckInWorkers(SyntheticImages):
    """Synthetic images whose reads in any process but the one that made it record that
    process's id in ``directory`` and then block (up to two minutes): upload workers stuck
    mid-task, for a test to kill their parent under them."""

    def __init__(self, n: int, directory: str, **kwargs: object) -> None:
        super().__init__(n, **kwargs)  # type: ignore[arg-type]
        self.directory, self.owner = directory, os.getpid()

    def __getitem__(self, index: int):  # type: ignore[override]
        if os.getpid() != self.owner:
            open(os.path.join(self.directory, str(os.getpid())), "w").close()
            import threading

            threading.Event().wait(120)
        return super().__getitem__(index)


def flaky_images() -> FlakyImages:
    """30 small synthetic images, 3 of them not images (``module:function`` for CLI tests)."""
    return FlakyImages(30, {3, 11, 29}, size=(32, 24))


class Undecodable(SyntheticImages):
    """JPEGs, one of them (``broken``) whole but undecodable: its scan names a Huffman table
    it never defines. Its header reads and it ends where it should (the upload takes it, as
    it takes any whole file: it does not decode), but no decoder decodes it."""

    def __init__(self, *args: Any, broken: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.broken = broken

    def __getitem__(self, index: int):  # type: ignore[override]
        image, label = super().__getitem__(index)
        if index == self.broken:
            data = bytearray(self.encoded(index))
            data[data.find(b"\xff\xda") + 6] = 0x99  # the first component's tables: DC 9, AC 9
            return bytes(data), label
        return image, label


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def in_plain_fork(run: Any, seconds: float = 120) -> tuple[Any, ...]:
    """``run()`` in a child made by ``os.fork`` (no multiprocessing hook runs in it):
    ``("ok", result)``, ``("raised", type name, message)``, ``("hung",)`` where it gave no
    answer within ``seconds`` (then killed), or ``("died", wait status)``."""
    import pickle
    import select

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_end)
        try:
            answer: tuple[Any, ...] = ("ok", run())
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            answer = ("raised", type(error).__name__, str(error))
        os.write(write_end, pickle.dumps(answer))
        os._exit(0)
    os.close(write_end)
    try:
        if not select.select([read_end], [], [], seconds)[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return ("hung",)
        chunks = []
        while chunk := os.read(read_end, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    return pickle.loads(b"".join(chunks)) if chunks else ("died", status)


def vp9_bytes(frames: Any, gop: int = 8) -> bytes:
    """``frames`` (``T x H x W x 3`` uint8) as a lossless VP9 WebM, a key frame every ``gop``:
    a video DALI's CPU decoder reads (it has no H.264). Needs PyAV."""
    import io

    import av

    out = io.BytesIO()
    with av.open(out, "w", format="webm") as container:
        stream = container.add_stream("libvpx-vp9", rate=10)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.codec_context.gop_size = gop
        stream.codec_context.options = {"lossless": "1"}
        for pixels in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()
