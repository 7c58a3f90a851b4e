"""Decoding whole batches on a GPU: workers draw each sample's crop, the main process decodes.

``decode(RandomResizedCrop(224), device="cuda")`` keeps CUDA out of DataLoader workers
(it does not survive a fork). There the stage only reads each JPEG's header and draws the
sample's crop box and flip from (seed, epoch, key), exactly as the CPU path does, and hands
on an ``Encoded`` image; ``batched`` gathers a batch's into one ``EncodedBatch`` (one
tensor of bytes, which DataLoader moves through shared memory and pins). In the main
process ``device_batches`` decodes each batch on its own thread and CUDA stream with
NVIDIA's nvImageCodec: one batched call that decodes only each crop's region (the hardware
JPEG decoder where the GPU has one), then the resize of the whole batch in a few kernels
(antialiased bilinear as separable weight matrices, the flip folded into them), so the
step gets a ready ``B x 3 x size x size`` batch while the next one decodes.

nvImageCodec's CPU backend runs the same code on the CPU (``batched=True`` with
``device="cpu"``): how the tests cover it, and a way to try a GPU script without a GPU.
Images that are not JPEG are decoded by the workers on the CPU, as the CPU path does.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import queue
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import simplejpeg
import torch
from torch.utils.data import default_collate

from remote_loader.errors import ConfigError, DecodeError
from remote_loader.pipeline.augment import JPEG_MAGIC, RandomResizedCrop
from remote_loader.read.metrics import Metrics

log = logging.getLogger("remote_loader")

EXTRA = "install the gpu extra (pip install '.[gpu]' in remote_loader's checkout: NVIDIA's nvImageCodec)"
_CHUNK = 64  # images resized at once: their padded batch and weights stay small
_DEPTH = 2  # batches decoded ahead: one being used, one ready
_JOIN_SECONDS = 1.0  # an iteration closed waits this long for its decoding thread (a decode under way)


@dataclass(frozen=True)
class Encoded:
    """A JPEG whose crop was drawn in a worker, to decode in the main process."""

    data: bytes
    box: tuple[int, int, int, int]  # left, top, right, bottom, in the image's own pixels
    flip: bool
    key: str
    shard: str


def prepare(crop: RandomResizedCrop, data: Any, rng: np.random.Generator, key: str, shard: str) -> Any:
    """What a worker makes of an image field: a JPEG's ``Encoded`` (its box and flip drawn as
    ``RandomResizedCrop.decode`` draws them: the box, then the flip), or the crop itself,
    decoded on the CPU, for another format."""
    if bytes(data[:2]) != JPEG_MAGIC:
        return crop.decode(data, rng)
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError as exc:
        raise DecodeError(f"sample {key!r} of {shard} is not a decodable image ({exc})"[:300], key=key) from None
    box = crop.box(width, height, rng)
    flip = bool(crop.flip and rng.random() < 0.5)
    return Encoded(bytes(data), box, flip, key, shard)


class EncodedBatch:
    """A batch's images: the JPEGs' bytes in one uint8 tensor (``offsets`` into it), their
    boxes and flips, and images already decoded (other formats), by position."""

    def __init__(self, items: Sequence[Any]) -> None:
        jpegs = [(i, item) for i, item in enumerate(items) if isinstance(item, Encoded)]
        self.size = len(items)
        self.positions = [i for i, _ in jpegs]
        lengths = [len(item.data) for _, item in jpegs]
        self.offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).tolist()
        self.data = torch.empty(self.offsets[-1], dtype=torch.uint8)
        data = self.data.numpy()
        for k, (_, item) in enumerate(jpegs):  # one copy of each JPEG, into the tensor DataLoader shares
            data[self.offsets[k] : self.offsets[k + 1]] = np.frombuffer(item.data, dtype=np.uint8)
        self.boxes = [item.box for _, item in jpegs]
        self.flips = [item.flip for _, item in jpegs]
        self.names = [(item.key, item.shard) for _, item in jpegs]
        self.decoded = {i: item for i, item in enumerate(items) if not isinstance(item, Encoded)}

    def __len__(self) -> int:
        return self.size

    def pin_memory(self) -> EncodedBatch:
        """DataLoader's ``pin_memory`` calls this: the bytes in page-locked memory."""
        self.data = self.data.pin_memory()
        return self


def collate(batch: Sequence[Any]) -> Any:
    """``default_collate``, with a batch's ``Encoded`` images gathered into an ``EncodedBatch``
    (position by position in tuples, key by key in dicts)."""
    first = batch[0]
    if isinstance(first, Encoded) or (isinstance(first, torch.Tensor) and any(isinstance(b, Encoded) for b in batch)):
        return EncodedBatch(batch)
    if isinstance(first, tuple | list) and any(_holds_encoded(b) for b in batch):
        return type(first)(collate(list(column)) for column in zip(*batch, strict=True)) if isinstance(first, tuple) \
            else [collate(list(column)) for column in zip(*batch, strict=True)]
    if isinstance(first, dict) and any(_holds_encoded(b) for b in batch):
        return {k: collate([b[k] for b in batch]) for k in first}
    return default_collate(list(batch))


def _holds_encoded(item: Any) -> bool:
    if isinstance(item, Encoded):
        return True
    if isinstance(item, tuple | list):
        return any(isinstance(x, Encoded) for x in item)
    if isinstance(item, dict):
        return any(isinstance(x, Encoded) for x in item.values())
    return False


# --------------------------------------------------------------------------- the decoder


@contextlib.contextmanager
def _stderr_quiet() -> Iterator[list[str]]:
    """File descriptor 2 into a file while nvImageCodec loads: it prints what it could not
    load (the JPEG 2000 and TIFF decoders, nvJPEG without CUDA) there, past Python."""
    captured: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read().decode("utf-8", "replace"))


def nvimgcodec() -> Any:
    """The nvImageCodec module, loaded without its messages on stderr; ConfigError naming
    the extra if it is not installed."""
    # Its log says on stderr which images failed, which we name in errors ourselves: quiet
    # unless the user asked for it.
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    with _stderr_quiet():
        try:
            module = importlib.import_module("nvidia.nvimgcodec")
        except ImportError:
            raise ConfigError(f"decoding batches needs nvImageCodec: {EXTRA}") from None
    return module


def check_device(device: Any, batched: bool) -> torch.device | None:
    """Where a decode stage decodes: None for the CPU path in the workers, else the device
    of the batched path (checked now, in the user's process)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and _importable() else "cpu"
    try:
        place = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"decode device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}") from None
    if place.type == "cpu":
        if batched:
            nvimgcodec()
        return place if batched else None
    if place.type != "cuda":
        raise ConfigError(f"decode device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}")
    if not torch.cuda.is_available():
        raise ConfigError(f"decode(device={device!r}) needs CUDA, and torch.cuda.is_available() is False here"
                          " (no GPU, or a CPU build of torch): use device='auto' to decode on the CPU where there"
                          " is no GPU")
    nvimgcodec()
    return place


def _importable() -> bool:
    try:
        nvimgcodec()
    except ConfigError:
        return False
    return True


def _weights(starts: torch.Tensor, lengths: torch.Tensor, padded: int, size: int, flips: torch.Tensor | None,
             device: torch.device) -> torch.Tensor:
    """``(n, size, padded)`` antialiased bilinear weights resizing each image's ``lengths[k]``
    pixels (from ``starts[k]`` of its padded row) to ``size``, as torch's ``interpolate(...,
    antialias=True)`` does, flipped where ``flips`` says: one matrix multiply resizes a batch."""
    scale = (lengths / size).to(torch.float64)[:, None, None]
    support = torch.clamp(scale, min=1.0)  # a triangle as wide as the scale when shrinking
    centre = scale * (torch.arange(size, device=device, dtype=torch.float64)[None, :, None] + 0.5)
    source = torch.arange(padded, device=device, dtype=torch.float64)[None, None, :] - starts[:, None, None]
    weight = torch.clamp(1 - torch.abs(source + 0.5 - centre) / support, min=0)
    weight = weight * ((source >= 0) & (source < lengths[:, None, None]))
    weight = weight / weight.sum(-1, keepdim=True).clamp(min=1e-12)
    if flips is not None:
        weight = torch.where(flips[:, None, None], weight.flip(1), weight)
    return weight.to(torch.float32)


class DeviceDecoder:
    """Decodes ``EncodedBatch``es on ``device`` with nvImageCodec: every crop's region in one
    batched call, then the batch resized to ``size`` in a few kernels.

    Args:
        crop: The stage's ``RandomResizedCrop`` (its size, and its output: uint8 or normalised).
        device: Where (``cuda:N``, or ``cpu`` through nvImageCodec's CPU backend).
        skip: Leave out a sample whose JPEG does not decode (counted in ``metrics.skipped``)
            instead of raising ``DecodeError`` naming it.
        metrics: Where skipped samples are counted.
    """

    def __init__(self, crop: RandomResizedCrop, device: torch.device, skip: bool = False,
                 metrics: Metrics | None = None) -> None:
        self.crop, self.device, self.skip, self.metrics = crop, device, skip, metrics or Metrics()
        self._decoder: Any = None
        self._module: Any = None
        self._warned = False

    def _codec(self) -> Any:
        if self._decoder is None:
            module = nvimgcodec()
            with _stderr_quiet():
                if self.device.type == "cpu":
                    self._decoder = module.Decoder(device_id=module.NVIMGCODEC_DEVICE_CPU_ONLY,
                                                   backends=[module.Backend(module.BackendKind.CPU_ONLY)])
                else:
                    self._decoder = module.Decoder(device_id=self.device.index or 0)
            self._module = module
        return self._decoder

    def decode(self, batch: EncodedBatch, stream: Any = None) -> tuple[torch.Tensor, list[int]]:
        """The batch's crops, ``n x 3 x size x size``, and the positions kept (all but the
        JPEGs left out under ``skip``)."""
        codec = self._codec()
        module = self._module
        data = batch.data.numpy()
        streams: list[Any] = []
        for k, (left, top, right, bottom) in enumerate(batch.boxes):
            view = data[batch.offsets[k] : batch.offsets[k + 1]]
            try:
                whole = module.CodeStream(view)
            except RuntimeError:
                streams.append(None)
                continue
            streams.append(whole.get_sub_code_stream(region=module.Region(top, left, bottom, right)))
        todo = [k for k, s in enumerate(streams) if s is not None]
        cuda_stream = stream.cuda_stream if stream is not None else 0
        images = codec.decode([streams[k] for k in todo], cuda_stream=cuda_stream) if todo else []
        pixels: dict[int, Any] = dict(zip(todo, images, strict=True))
        failed = [k for k in range(len(streams)) if pixels.get(k) is None]
        if failed and not self.skip:
            key, shard = batch.names[failed[0]]
            raise DecodeError(f"sample {key!r} of {shard} is not a decodable JPEG ({len(failed)} of the batch's"
                              f" {len(streams)} are not)", key=key)
        if failed:
            self.metrics.add(skipped=len(failed))
        good = [k for k in range(len(streams)) if k not in set(failed)]
        crops = self._resize([self._tensor(pixels[k]) for k in good], [batch.flips[k] for k in good])
        out: list[tuple[int, torch.Tensor]] = [(batch.positions[k], crops[i]) for i, k in enumerate(good)]
        out += [(i, self._finish(t.to(self.device, non_blocking=True)[None])[0]) for i, t in batch.decoded.items()]
        out.sort(key=lambda pair: pair[0])
        kept = [i for i, _ in out]
        return (torch.stack([t for _, t in out]) if out else self._empty()), kept

    def _tensor(self, image: Any) -> torch.Tensor:
        """An nvImageCodec image as an ``h x w x 3`` uint8 tensor on the device (no copy
        where it was decoded there; the tensor keeps the image alive)."""
        if image.buffer_kind == self._module.ImageBufferKind.STRIDED_DEVICE:
            return torch.as_tensor(image, device=self.device)
        if self.device.type == "cuda" and not self._warned:  # decoded on the CPU: nvJPEG was not found
            self._warned = True
            log.warning("nvImageCodec decodes on the CPU here: it found no nvJPEG (the CUDA toolkit's, or pip install"
                        " nvidia-nvjpeg-cu13), so the GPU only resizes")
        return torch.from_numpy(np.asarray(image.cpu())).to(self.device, non_blocking=True)

    def _resize(self, images: list[torch.Tensor], flips: list[bool]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for first in range(0, len(images), _CHUNK):
            chunk = images[first : first + _CHUNK]
            heights = torch.tensor([t.shape[0] for t in chunk], device=self.device)
            widths = torch.tensor([t.shape[1] for t in chunk], device=self.device)
            padded = torch.zeros(len(chunk), 3, int(heights.max()), int(widths.max()), device=self.device)
            for k, image in enumerate(chunk):  # one copy each into the padded batch
                padded[k, :, : image.shape[0], : image.shape[1]] = image.permute(2, 0, 1)
            zero = torch.zeros(len(chunk), device=self.device)
            rows = _weights(zero, heights, padded.shape[2], self.crop.size, None, self.device)
            columns = _weights(zero, widths, padded.shape[3], self.crop.size,
                               torch.tensor(flips[first : first + _CHUNK], device=self.device), self.device)
            resized = rows[:, None] @ padded @ columns[:, None].transpose(-1, -2)
            out.extend(self._finish(resized))
        return out

    def _finish(self, batch: torch.Tensor) -> torch.Tensor:
        """Rounded to uint8, or normalised floats where the crop says."""
        if batch.dtype == torch.uint8:
            batch = batch.float()
        batch = batch.round().clamp(0, 255)
        if self.crop.mean is None:
            return batch.to(torch.uint8)
        mean = torch.tensor(self.crop.mean, device=self.device).view(1, 3, 1, 1) * 255
        std = torch.tensor(self.crop.std, device=self.device).view(1, 3, 1, 1) * 255
        return (batch - mean) / std

    def _empty(self) -> torch.Tensor:
        dtype = torch.uint8 if self.crop.mean is None else torch.float32
        return torch.empty(0, 3, self.crop.size, self.crop.size, dtype=dtype, device=self.device)


# --------------------------------------------------------------------------- in the main process


def finish(item: Any, decoder: DeviceDecoder, stream: Any = None) -> Any:
    """``item`` with its ``EncodedBatch``es decoded; a sample left out by the decoder is left
    out of the item's other fields too (tensors and lists as long as the batch)."""
    found: list[tuple[Any, EncodedBatch]] = []
    _find(item, (), found)
    if not found:
        return item
    decoded = {path: decoder.decode(batch, stream) for path, batch in found}
    size = len(found[0][1])
    kept = sorted(set.intersection(*(set(k) for _, k in decoded.values())))
    return _rebuild(item, (), decoded, kept if len(kept) < size else None, size)


def _find(item: Any, path: tuple[Any, ...], found: list[tuple[Any, EncodedBatch]]) -> None:
    if isinstance(item, EncodedBatch):
        found.append((path, item))
    elif isinstance(item, tuple | list):
        for i, x in enumerate(item):
            _find(x, (*path, i), found)
    elif isinstance(item, dict):
        for k, x in item.items():
            _find(x, (*path, k), found)


def _rebuild(item: Any, path: tuple[Any, ...], decoded: dict[Any, tuple[torch.Tensor, list[int]]],
             kept: list[int] | None, size: int) -> Any:
    if path in decoded:
        images, positions = decoded[path]
        if kept is not None and positions != kept:
            index = torch.tensor([positions.index(p) for p in kept], device=images.device)
            images = images.index_select(0, index)
        return images
    if any(found[: len(path)] == path for found in decoded):  # a container on the way to a batch's images
        if isinstance(item, dict):
            return {k: _rebuild(x, (*path, k), decoded, kept, size) for k, x in item.items()}
        rebuilt = [_rebuild(x, (*path, i), decoded, kept, size) for i, x in enumerate(item)]
        return type(item)(rebuilt) if isinstance(item, tuple) else rebuilt
    if kept is not None and isinstance(item, torch.Tensor) and item.dim() and len(item) == size:
        return item.index_select(0, torch.tensor(kept, device=item.device))
    if kept is not None and isinstance(item, list | tuple) and len(item) == size:
        return type(item)(item[i] for i in kept)
    return item


class _End:
    pass


def device_batches(batches: Iterable[Any], decoder: DeviceDecoder) -> Iterator[Any]:
    """``batches`` with their images decoded, on a thread of their own with a CUDA stream
    of its own, ``_DEPTH`` batches ahead: each batch handed out is ready (the caller's stream
    waits for it), and the loader never holds up a step it is faster than."""
    for item, _ in decoded_with_states(batches, decoder, None):
        yield item


def decoded_with_states(batches: Iterable[Any], decoder: DeviceDecoder,
                        snapshot: Callable[[], Any] | None) -> Iterator[tuple[Any, Any]]:
    """``device_batches``, each batch with ``snapshot()`` taken just after it was drawn from
    ``batches``: the decoding thread draws ahead, so a stateful loader's own state is ahead
    of what the caller has; this is the state that matches each batch handed out."""
    cuda = decoder.device.type == "cuda"
    stream = torch.cuda.Stream(device=decoder.device) if cuda else None
    ready: queue.Queue[Any] = queue.Queue(maxsize=_DEPTH)
    stop = threading.Event()

    def hand(entry: tuple[Any, Any, Any]) -> bool:
        while not stop.is_set():
            try:
                ready.put(entry, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            if cuda:
                torch.cuda.set_device(decoder.device)
            for item in batches:
                state = snapshot() if snapshot is not None else None
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                    out = finish(item, decoder, stream)
                    event = torch.cuda.Event() if cuda else None
                    if event is not None:
                        event.record(stream)
                if not hand((out, event, state)):
                    return
            hand((_End, None, None))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            hand((error, None, None))

    thread = threading.Thread(target=work, name="remote-loader-device", daemon=True)
    thread.start()
    try:
        while True:
            out, event, state = wait_result_from(ready, thread)
            if out is _End:
                return
            if isinstance(out, BaseException):
                raise out
            if event is not None:
                torch.cuda.current_stream(decoder.device).wait_event(event)
                _record(out, torch.cuda.current_stream(decoder.device))
            yield out, state
    finally:
        stop.set()
        thread.join(_JOIN_SECONDS)  # its last batch put, it ends at once: before the interpreter does


def wait_result_from(ready: queue.Queue[Any], thread: threading.Thread) -> Any:
    """The next thing the decoding thread put, waiting in bounded steps."""
    while True:
        try:
            return ready.get(timeout=0.5)
        except queue.Empty:
            if not thread.is_alive() and ready.empty():
                raise RuntimeError("the decoding thread ended without a word") from None


def _record(item: Any, stream: Any) -> None:
    """Tell the caching allocator that ``stream`` uses the item's tensors (made on another)."""
    if isinstance(item, torch.Tensor):
        if item.is_cuda:
            item.record_stream(stream)
    elif isinstance(item, tuple | list):
        for x in item:
            _record(x, stream)
    elif isinstance(item, dict):
        for x in item.values():
            _record(x, stream)

