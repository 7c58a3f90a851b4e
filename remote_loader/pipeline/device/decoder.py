"""``DeviceDecoder``: a batch's JPEGs decoded by the codec, cropped, resized and flipped in
a few kernels, on the decoder's own CUDA stream; the batch's other fields kept in step."""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from remote_loader.errors import DecodeError, OnError
from remote_loader.pipeline.device.codec import CPU, CUDA, HARDWARE, Codec, open_codec
from remote_loader.pipeline.device.resize import resize
from remote_loader.pipeline.stages.augment import RandomResizedCrop
from remote_loader.pipeline.stages.containers import WALK_ON, leaves, rebuild
from remote_loader.pipeline.stages.prepared import GATHERED, EncodedBatch, EncodedClips, gather
from remote_loader.read.metrics import Metrics


@dataclass(frozen=True)
class Place:
    """Where a device stage decodes: ``cuda:N`` or ``cpu`` (nvImageCodec's CPU backend),
    and whether a GPU stage may decode on the CPU when no GPU decoder loads."""

    device: torch.device
    cpu_fallback: bool = False


SKIPPED = object()
"""What ``finish`` makes of a sample or batch whose every JPEG it left out (``skip``)."""
_DECODERS = {HARDWARE: "the GPU's hardware decoder", CUDA: "nvJPEG's CUDA decoder", CPU: "the CPU decoder",
             "GPU (DALI)": "DALI on the GPU", "CPU (DALI)": "DALI on the CPU"}


@dataclass
class Decoded:
    """A batch decoded on the decoder's stream: ready once ``event`` is (None on the CPU);
    ``inputs`` (the pinned bytes the decoder read) stay alive until then."""

    item: Any
    event: Any
    inputs: list[torch.Tensor]


class DeviceDecoder:
    """Decodes ``EncodedBatch``es on a device: every JPEG of a batch in one codec call, then
    the batch cropped and resized to ``size`` in a few kernels.

    Args:
        crop: The stage's ``RandomResizedCrop`` (its size, and its output: uint8 or normalised).
        place: Where (a ``Place``, or a ``torch.device``: ``cuda:N``, or ``cpu`` through
            nvImageCodec's CPU backend).
        on_error: ``OnError.SKIP`` leaves out a sample whose JPEG does not decode (counted in
            ``metrics.skipped``); ``RAISE`` raises ``DecodeError`` naming it.
        metrics: Where skipped samples are counted.
        codec: The JPEG decoder (default: nvImageCodec's for the place, opened once per
            process when first used).
    """

    decodings: tuple[str, ...] = ("dali", "process", "thread")
    """How a loader may decode with it (``loader(decoding=...)``); the first is the default
    where it is the only one."""

    def __init__(self, crop: RandomResizedCrop, place: Place | torch.device, on_error: OnError = OnError.RAISE,
                 metrics: Metrics | None = None, codec: Codec | None = None) -> None:
        place = place if isinstance(place, Place) else Place(place)
        if place.device.type == "cuda" and place.device.index is None:  # the decoding thread's is another
            place = Place(torch.device("cuda", torch.cuda.current_device()), place.cpu_fallback)
        self.crop, self.device, self.on_error, self.metrics = crop, place.device, on_error, metrics or Metrics()
        self.place = place
        self._codec = codec
        self._stream: Any = None
        self._scale: tuple[torch.Tensor, torch.Tensor] | None = None
        self._busy = threading.Lock()  # held through a whole batch's decode: close() waits for it
        self._closed = False
        _LIVE.add(self)

    def close(self) -> None:
        """Decode nothing more, once a batch under way is done (waiting at most about 2 s):
        at exit, so no decoding thread is inside torch or the codec while the interpreter
        tears down (that aborts the process: 'terminate called without an active exception')."""
        if self._busy.acquire(timeout=_CLOSE_SECONDS):
            self._closed = True
            self._busy.release()

    @property
    def codec(self) -> Codec:
        """The JPEG decoder, opened on first use (on a GPU: CUDA's start-up and the probe of
        its decoders), once per process."""
        if self._codec is None:
            self._codec = open_codec(self.place.device, self.place.cpu_fallback)
        return self._codec

    @property
    def decoded_on(self) -> str:
        """Where JPEGs are decoded, in words: ``"hardware decoder"``, ``"CUDA"`` or ``"CPU"``."""
        return self.codec.decoded_on

    def open(self) -> None:
        """Open the JPEG decoder now, in the calling thread (its probe and messages happen
        here, not mid-epoch)."""
        _ = self.codec

    def crops(self, jpegs: list[Any], boxes: list[Any], flips: list[bool],
              stream: Any) -> tuple[torch.Tensor | None, list[int]]:
        """The crops of the ``jpegs`` that decode (``n x 3 x size x size``, uint8 or
        normalised as the crop says, in order; None where none does), and the positions of
        those that do not."""
        decoded = self.codec.decode(jpegs, stream.cuda_stream if stream is not None else 0)
        good = [k for k, image in enumerate(decoded) if image is not None]
        failed = [k for k, image in enumerate(decoded) if image is None]
        if not good:
            return None, failed
        return self._finish(resize([decoded[k] for k in good], [boxes[k] for k in good],  # type: ignore[misc]
                                   [flips[k] for k in good], self.crop.size, self.device)), failed

    def decode(self, batch: EncodedBatch, stream: Any = None) -> tuple[torch.Tensor, list[int]]:
        """The batch's crops, ``n x 3 x size x size``, and the positions kept (all but the
        JPEGs left out under ``OnError.SKIP``)."""
        jpegs = batch.jpegs()
        whole = [k for k, problem in enumerate(batch.problems) if problem is None]  # the others never reach it
        crops, broken = (self.crops([jpegs[k] for k in whole], [batch.boxes[k] for k in whole],
                                    [batch.flips[k] for k in whole], stream) if whole else (None, []))
        left_out = set(broken)
        good = [k for i, k in enumerate(whole) if i not in left_out]
        failed = sorted(set(range(len(jpegs))) - set(good))
        if failed and not self.on_error.skips:
            key, shard = batch.names[failed[0]]
            why = batch.problems[failed[0]] or f"{_DECODERS.get(self.decoded_on, self.decoded_on)} could not decode it"
            raise DecodeError(f"sample {key!r} of {shard} is not a decodable JPEG: {why} ({len(failed)} of the"
                              f" batch's {len(jpegs)} JPEGs are not)", key=key)
        if failed:
            self.metrics.add(skipped=len(failed))
        parts, order = [], [batch.positions[k] for k in good]
        if crops is not None:
            parts.append(crops)
        for position, tensor in batch.decoded.items():  # decoded by a worker, final already
            parts.append(tensor.to(self.device, non_blocking=True)[None])
            order.append(position)
        if not parts:
            return self._empty(), []
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        kept = sorted(order)
        if order != kept:
            rank = {p: i for i, p in enumerate(order)}
            index = torch.tensor([rank[p] for p in kept])
            out = out.index_select(0, index.pin_memory().to(self.device, non_blocking=True)
                                   if self.device.type == "cuda" else index)
        return out, kept

    def _finish(self, batch: torch.Tensor) -> torch.Tensor:
        """Rounded to uint8, or normalised floats where the crop says."""
        batch = batch.round_().clamp_(0, 255)
        if self.crop.mean is None or self.crop.std is None:
            return batch.to(torch.uint8)
        if self._scale is None:  # made once: no copy from the host per batch
            mean = torch.tensor(self.crop.mean).view(1, 3, 1, 1) * 255
            std = torch.tensor(self.crop.std).view(1, 3, 1, 1) * 255
            self._scale = mean.to(self.device), std.to(self.device)
        return (batch - self._scale[0]) / self._scale[1]

    def _empty(self) -> torch.Tensor:
        dtype = torch.uint8 if self.crop.mean is None else torch.float32
        return torch.empty(0, 3, self.crop.size, self.crop.size, dtype=dtype, device=self.device)

    # ---------------------------------------------------------------- a whole item, on a stream

    def finish(self, item: Any) -> Decoded:
        """``item`` with its ``EncodedBatch``es decoded, on this decoder's stream; a sample
        left out by the decoder is left out of the item's other fields too (tensors and
        lists as long as the batch). A sample of a pipeline without ``batched`` is decoded
        as a batch of one (``SKIPPED`` where it is left out). Runs on the decoding thread."""
        with self._busy:
            if self._closed:
                raise RuntimeError("the device decoder is closed: the interpreter is exiting")
            return self._finish_item(item)

    def _finish_item(self, item: Any) -> Decoded:
        singles = {path for path, _ in leaves(item, GATHERED)}
        if singles:
            item = rebuild(item, lambda path, x: gather([x]) if path in singles else WALK_ON)
        with self._on_stream() as stream:
            found = list(leaves(item, (EncodedBatch, EncodedClips)))
            if not found:
                return Decoded(item, None, [])
            decoded = {path: self.decode(batch, stream) for path, batch in found}
            size = len(found[0][1])
            kept = sorted(set.intersection(*(set(k) for _, k in decoded.values())))
            out = rebuild(item, _Rebuild(decoded, kept if len(kept) < size else None, size))
            if not kept:  # every image left out (skip): nothing to hand out
                out = SKIPPED
            elif singles:
                out = rebuild(out, lambda path, x: x[0] if path in singles else WALK_ON)
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
            return Decoded(out, event, [batch.data for _, batch in found])

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            yield None
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            yield self._stream

    def hand_over(self, decoded: Decoded, pending: deque[Decoded]) -> Any:
        """The decoded item for the caller's thread: its current stream waits for the decode,
        and the allocator learns that stream uses the item's tensors. The inputs stay in
        ``pending`` until their decode is done."""
        if decoded.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(decoded.event)
            for _, tensor in leaves(decoded.item, torch.Tensor):
                if tensor.is_cuda:
                    tensor.record_stream(current)
            pending.append(decoded)
        while pending and (pending[0].event is None or pending[0].event.query()):
            pending.popleft()
        return decoded.item


_CLOSE_SECONDS = 2.0
_LIVE: weakref.WeakSet[DeviceDecoder] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for decoder in list(_LIVE):
        decoder.close()


class _Rebuild:
    """The ``rebuild`` function of ``finish``: batches' images in their place, and where
    samples were left out, the batch's other tensors and lists without them."""

    def __init__(self, decoded: dict[Any, tuple[torch.Tensor, list[int]]], kept: list[int] | None,
                 size: int) -> None:
        self.decoded, self.kept, self.size = decoded, kept, size

    def __call__(self, path: tuple[Any, ...], item: Any) -> Any:
        if path in self.decoded:
            images, positions = self.decoded[path]
            if self.kept is not None and positions != self.kept:
                index = torch.tensor([positions.index(p) for p in self.kept], dtype=torch.long)
                images = images.index_select(0, index.to(images.device))
            return images
        if any(found[: len(path)] == path for found in self.decoded):  # a container on the way to a batch
            return WALK_ON
        if self.kept is not None and isinstance(item, torch.Tensor) and item.dim() and len(item) == self.size:
            return item.index_select(0, torch.tensor(self.kept, dtype=torch.long, device=item.device))
        if self.kept is not None and isinstance(item, list | tuple) and len(item) == self.size:
            return type(item)(item[i] for i in self.kept)
        return item
