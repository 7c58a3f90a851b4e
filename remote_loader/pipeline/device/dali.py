"""Decoding a batch's crops with NVIDIA DALI, in the training process: one pipeline run a
batch, whose decoding, cropping and resizing run in DALI's own native threads and CUDA
streams, so Python takes the GIL a few times a batch (a Python thread of the training step
beside it costs the loader little), and the GPU work stays in the training process's CUDA
context, where it interleaves with the step's kernels instead of taking the GPU in turns
with a second process.

The crops are still ours: each sample's box and flip, drawn by the workers from (seed,
epoch, key), go to DALI as per-sample inputs of ``fn.decoders.image_slice`` (the box) and
``fn.crop_mirror_normalize`` (the flip); ``fn.resize`` resizes with antialiasing, as the CPU
path does. DALI decodes into memory of its own (nvJPEG's hardware decoder writes there, not
into memory torch's caching allocator may have just reused, which it does not order with
the stream: torchvision #9606), and each batch is then copied into a tensor of ours on the
decoder's stream. On the CPU (``device="cpu"``) the same pipeline runs on DALI's CPU
operators: how the tests cover it."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from remote_loader.config import rank_cores
from remote_loader.errors import ConfigError
from remote_loader.pipeline.device.decoder import DeviceDecoder, Place
from remote_loader.pipeline.stages.augment import RandomResizedCrop

EXTRA = "install the gpu extra (pip install '.[gpu]' in remote_loader's checkout: NVIDIA DALI)"
ON_GPU, ON_CPU = "GPU (DALI)", "CPU (DALI)"
BATCH = 256
"""Samples a pipeline is built for first; a larger batch builds it again, once, for its size."""
_ran_in: int | None = None  # the process whose DALI pipelines were built (a fork inherits it)


def _check_process() -> None:
    """ConfigError in a process forked from one that built a DALI pipeline: DALI's threads are
    not copied by a fork, and a pipeline, built or inherited, would wait for them forever."""
    global _ran_in
    if _ran_in is None:
        _ran_in = os.getpid()
    elif _ran_in != os.getpid():
        raise ConfigError(f"DALI ran in process {_ran_in}, from which this one ({os.getpid()}) was forked, and"
                          " cannot run here (a fork does not copy its threads): start this process with the"
                          " 'spawn' or 'forkserver' method, or decode with decoding='process'")


def installed() -> bool:
    """Whether DALI can be imported, found without loading it."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):
        return False


class DaliCrops:
    """A DALI pipeline that decodes JPEGs, cuts each one's box, resizes it to ``size x size``
    and flips it where asked: ``n x 3 x size x size``, uint8 (rounded), or float32 less
    ``mean`` over ``std`` (on a 0-255 scale) where given. One run at a time."""

    def __init__(self, device: torch.device, size: int, batch: int = BATCH,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> None:
        self.device, self.size, self.batch = device, size, batch
        self.mean, self.std = mean, std
        self._lock = threading.Lock()
        _check_process()
        self._pipe = self._build(batch)

    def _build(self, batch: int) -> Any:
        from nvidia.dali import fn as dali_fn
        from nvidia.dali import pipeline_def as dali_pipeline_def
        from nvidia.dali import types as dali_types

        fn: Any = dali_fn  # DALI's stubs type its operators more narrowly than they take inputs
        types: Any = dali_types
        pipeline_def: Any = dali_pipeline_def
        gpu = self.device.type == "cuda"

        @pipeline_def(batch_size=batch, num_threads=max(1, rank_cores()), device_id=self.device.index if gpu else None,
                      exec_async=False, exec_pipelined=False, prefetch_queue_depth=1)
        def crops() -> Any:
            jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, no_copy=True)  # the batch's own bytes
            anchor = fn.external_source(name="anchor", dtype=types.FLOAT)
            shape = fn.external_source(name="shape", dtype=types.FLOAT)
            flip = fn.external_source(name="flip", dtype=types.INT32)
            options = {"affine": False, "jpeg_fancy_upsampling": True} if gpu else {}
            images = fn.decoders.image_slice(jpegs, anchor, shape, device="mixed" if gpu else "cpu",
                                             output_type=types.RGB, axis_names="WH", normalized_anchor=False,
                                             normalized_shape=False, adjust_orientation=False, **options)
            images = fn.resize(images, resize_x=self.size, resize_y=self.size, antialias=True,
                               interp_type=types.INTERP_LINEAR, dtype=types.FLOAT)
            if self.mean is None or self.std is None:
                return fn.crop_mirror_normalize(images, mirror=flip, output_layout="CHW", dtype=types.UINT8)
            return fn.crop_mirror_normalize(images, mirror=flip, output_layout="CHW", dtype=types.FLOAT,
                                            mean=list(self.mean), std=list(self.std))

        pipe = crops()
        pipe.build()
        return pipe

    def run(self, jpegs: Sequence[np.ndarray], boxes: Sequence[Sequence[float]], flips: Sequence[bool],
            cuda_stream: Any = None) -> torch.Tensor:
        """The crops of ``jpegs`` (arrays of bytes, read in place: they must outlive the
        call); RuntimeError where DALI cannot decode one of them (the pipeline is then made
        again: DALI's is no longer usable)."""
        from nvidia.dali.tensors import TensorCPU

        samples = [TensorCPU(jpeg, "") for jpeg in jpegs]  # views of the bytes: a quarter of feed_input's own work
        return self._run({"jpegs": samples, **cuts(boxes, flips)}, len(jpegs), cuda_stream)

    def _run(self, inputs: dict[str, Any], count: int, cuda_stream: Any) -> torch.Tensor:
        """One run of the pipeline over ``count`` samples, fed ``inputs`` by name; the
        pipeline made again for a larger batch, and after an error (DALI's is no longer usable)."""
        _check_process()
        with self._lock:
            if count > self.batch:
                self.batch, self._pipe = count, self._build(count)
            try:
                for name, value in inputs.items():
                    self._pipe.feed_input(name, value)
                (out,) = self._pipe.run()
                return self._tensor(out, cuda_stream)
            except RuntimeError:
                self._pipe = self._build(self.batch)
                raise

    def _tensor(self, out: Any, cuda_stream: Any) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.from_numpy(np.array(out.as_tensor()))
        from nvidia.dali.plugin.pytorch import feed_ndarray

        dtype = torch.uint8 if self.mean is None else torch.float32
        tensor = torch.empty(self._shape(len(out)), dtype=dtype, device=self.device)
        return feed_ndarray(out, tensor, cuda_stream=cuda_stream)

    def _shape(self, count: int) -> tuple[int, ...]:
        """The shape of a run's output of ``count`` samples."""
        return (count, 3, self.size, self.size)


def cuts(boxes: Sequence[Sequence[float]], flips: Sequence[bool]) -> dict[str, np.ndarray]:
    """The pipeline's inputs for each sample's box (its corner and size) and flip."""
    box = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    return {"anchor": np.ascontiguousarray(box[:, :2]), "shape": np.ascontiguousarray(box[:, 2:] - box[:, :2]),
            "flip": np.asarray(flips, dtype=np.int32).reshape(-1, 1)}


_PRESTARTED: dict[tuple[Any, ...], concurrent.futures.Future[DaliCrops]] = {}
_PRESTART_LOCK = threading.Lock()


def scaled(crop: RandomResizedCrop) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    """The crop's ``mean`` and ``std`` on a 0-255 scale (None without them)."""
    if crop.mean is None or crop.std is None:
        return None, None
    return tuple(255 * m for m in crop.mean), tuple(255 * s for s in crop.std)


def _key(place: Place, crop: RandomResizedCrop) -> tuple[Any, ...]:
    return (os.getpid(), str(place.device), crop.size, *scaled(crop))


def prestart(place: Place, crop: RandomResizedCrop) -> None:
    """Import DALI and build the pipeline for ``place`` and ``crop`` on a thread, now, once
    per process: while the workers start and you make your model, not on the way to the
    first batch."""
    key = _key(place, crop)
    with _PRESTART_LOCK:
        if key in _PRESTARTED:
            return
        future: concurrent.futures.Future[DaliCrops] = concurrent.futures.Future()
        _PRESTARTED[key] = future

    def build() -> None:
        try:
            future.set_result(DaliCrops(place.device, crop.size, BATCH, *scaled(crop)))
        except BaseException as error:  # noqa: BLE001 - raised where the pipeline is taken
            future.set_exception(error)

    threading.Thread(target=build, name="remote_loader-dali-build", daemon=True).start()


def open_crops(place: Place, crop: RandomResizedCrop) -> DaliCrops:
    """The pipeline prestarted for ``place`` and ``crop`` (waiting for its build), else a new one."""
    with _PRESTART_LOCK:
        future = _PRESTARTED.pop(_key(place, crop), None)
    if future is not None:
        try:
            return future.result()
        except Exception:  # noqa: BLE001 - built again here, where its error is the caller's
            pass
    if not installed():
        raise ConfigError(f"decoding='dali' needs NVIDIA DALI: {EXTRA}")
    return DaliCrops(place.device, crop.size, BATCH, *scaled(crop))


class DaliDecoder(DeviceDecoder):
    """A ``DeviceDecoder`` whose JPEGs DALI decodes, crops and resizes (``DaliCrops``), in
    this process: a batch that DALI cannot decode whole is decoded again image by image, to
    name (or, under ``skip``, leave out) the ones that do not decode."""

    def __init__(self, crop: RandomResizedCrop, place: Place | torch.device, **options: Any) -> None:
        super().__init__(crop, place, **options)
        self._crops: DaliCrops | None = None

    @classmethod
    def like(cls, decoder: DeviceDecoder) -> DaliDecoder:
        """A DALI decoder for what ``decoder`` decodes, where and how it does."""
        return cls(decoder.crop, decoder.place, on_error=decoder.on_error, metrics=decoder.metrics)

    @property
    def pipeline(self) -> DaliCrops:
        if self._crops is None:
            self._crops = open_crops(self.place, self.crop)
        return self._crops

    @property
    def decoded_on(self) -> str:
        _ = self.pipeline
        return ON_GPU if self.device.type == "cuda" else ON_CPU

    def open(self) -> None:
        """Have the pipeline built on a thread (if it is not already): the workers start
        meanwhile, and the first batch waits for the later of the two, not their sum."""
        if self._crops is None:
            prestart(self.place, self.crop)

    def crops(self, jpegs: list[np.ndarray], boxes: list[Any], flips: list[bool],
              stream: Any) -> tuple[torch.Tensor | None, list[int]]:
        cuda_stream = stream.cuda_stream if stream is not None else None
        try:
            return self.pipeline.run(jpegs, boxes, flips, cuda_stream), []
        except RuntimeError:  # one of them does not decode: which?
            pass
        kept, failed = [], []
        for k, jpeg in enumerate(jpegs):
            try:
                kept.append(self.pipeline.run([jpeg], [boxes[k]], [flips[k]], cuda_stream))
            except RuntimeError:
                failed.append(k)
        return (torch.cat(kept) if kept else None), failed
