"""Decoding a batch's clips with NVIDIA DALI in the training process: each video's frames
(the numbers a worker drew, as the CPU path draws them) decoded by DALI's video decoder
(NVDEC on a GPU: H.264, HEVC, VP8, VP9, AV1, MPEG-4, MJPEG; on the CPU, its own decoder:
VP8, VP9 and MJPEG only), the clip's box cut from every frame, resized with antialiasing and
flipped where drawn, in one pipeline run a batch, in DALI's own threads: Python takes the
GIL a few times a batch, and the GPU work stays in the training process's CUDA context."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from remote_loader.config import rank_cores
from remote_loader.errors import DecodeError, OnError
from remote_loader.pipeline.device.dali import ON_CPU, ON_GPU, DaliCrops, DaliDecoder, cuts, scaled
from remote_loader.pipeline.device.decoder import Place
from remote_loader.pipeline.stages.augment import RandomResizedCrop
from remote_loader.pipeline.stages.prepared import EncodedClips
from remote_loader.read.metrics import Metrics


class DaliClips(DaliCrops):
    """A DALI pipeline that decodes given frames of each video, cuts each clip's box from
    them, resizes it to ``size x size`` and flips it where asked: ``n x T x 3 x size x
    size`` (``layout="TCHW"``) or ``n x T x size x size x 3`` (``"THWC"``), uint8, or
    float32 less ``mean`` over ``std`` (a 0-255 scale) where given. One run at a time."""

    def __init__(self, device: torch.device, size: int, frames: int, layout: str, batch: int = 8,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> None:
        self.frames, self.layout = frames, layout
        super().__init__(device, size, batch, mean, std)

    def _build(self, batch: int) -> Any:
        from nvidia.dali import fn as dali_fn
        from nvidia.dali import pipeline_def as dali_pipeline_def
        from nvidia.dali import types as dali_types

        fn: Any = dali_fn
        types: Any = dali_types
        pipeline_def: Any = dali_pipeline_def
        gpu = self.device.type == "cuda"
        layout = "FCHW" if self.layout == "TCHW" else "FHWC"
        normalised = self.mean is not None and self.std is not None

        @pipeline_def(batch_size=batch, num_threads=max(1, rank_cores()), device_id=self.device.index if gpu else None,
                      exec_async=False, exec_pipelined=False, prefetch_queue_depth=1)
        def clips() -> Any:
            videos = fn.external_source(name="videos", dtype=types.UINT8, no_copy=True)
            frames = fn.external_source(name="frames", dtype=types.INT32)
            anchor = fn.external_source(name="anchor", dtype=types.FLOAT)
            shape = fn.external_source(name="shape", dtype=types.FLOAT)
            flip = fn.external_source(name="flip", dtype=types.INT32)
            seq = fn.decoders.video(videos, frames=frames, device="mixed" if gpu else "cpu", pad_mode="edge")
            seq = fn.slice(seq, anchor, shape, axis_names="WH", normalized_anchor=False, normalized_shape=False)
            seq = fn.resize(seq, resize_x=self.size, resize_y=self.size, antialias=True,
                            interp_type=types.INTERP_LINEAR, dtype=types.FLOAT)
            if not normalised:
                return fn.crop_mirror_normalize(seq, mirror=flip, output_layout=layout, dtype=types.UINT8)
            return fn.crop_mirror_normalize(seq, mirror=flip, output_layout=layout, dtype=types.FLOAT,
                                            mean=list(self.mean or ()), std=list(self.std or ()))

        pipe = clips()
        pipe.build()
        return pipe

    def run_clips(self, videos: Sequence[np.ndarray], frames: np.ndarray, boxes: Sequence[Sequence[float]],
                  flips: Sequence[bool], cuda_stream: Any = None) -> torch.Tensor:
        """The clips of ``videos`` (arrays of bytes, read in place); RuntimeError where DALI
        cannot decode one of them (the pipeline is then made again)."""
        from nvidia.dali.tensors import TensorCPU

        samples = [TensorCPU(video, "") for video in videos]
        inputs = {"videos": samples, "frames": [np.ascontiguousarray(row) for row in frames], **cuts(boxes, flips)}
        return self._run(inputs, len(videos), cuda_stream)

    def _shape(self, count: int) -> tuple[int, ...]:
        if self.layout == "TCHW":
            return (count, self.frames, 3, self.size, self.size)
        return (count, self.frames, self.size, self.size, 3)


class DaliClipDecoder(DaliDecoder):
    """Decodes the ``EncodedClips`` of each batch with ``DaliClips``, in this process: a batch
    that DALI cannot decode whole is decoded again clip by clip, to name (or, under ``skip``,
    leave out) the videos that do not decode."""

    decodings = ("dali",)
    batch_type = EncodedClips

    def __init__(self, crop: RandomResizedCrop, place: Place | torch.device, frames: int, layout: str,
                 on_error: OnError = OnError.RAISE, metrics: Metrics | None = None) -> None:
        super().__init__(crop, place, on_error=on_error, metrics=metrics)
        self.frames, self.layout = frames, layout
        self._clips: DaliClips | None = None

    @property
    def clips(self) -> DaliClips:
        if self._clips is None:
            mean, std = scaled(self.crop)
            self._clips = DaliClips(self.device, self.crop.size, self.frames, self.layout, mean=mean, std=std)
        return self._clips

    @property
    def decoded_on(self) -> str:
        return ON_GPU if self.device.type == "cuda" else ON_CPU

    def open(self) -> None:
        """Build the pipeline now, in the calling thread."""
        _ = self.clips

    def decode(self, batch: Any, stream: Any = None) -> tuple[torch.Tensor, list[int]]:
        """The batch's clips, and the positions kept (all but the videos left out under ``skip``)."""
        cuda_stream = stream.cuda_stream if stream is not None else None
        videos = batch.videos()
        try:
            return self.clips.run_clips(videos, batch.frames, batch.boxes, batch.flips, cuda_stream), \
                list(range(len(batch)))
        except RuntimeError:  # one of them does not decode: which?
            pass
        kept, good, failed = [], [], []
        for k, video in enumerate(videos):
            try:
                kept.append(self.clips.run_clips([video], batch.frames[k : k + 1], [batch.boxes[k]], [batch.flips[k]],
                                                 cuda_stream))
                good.append(k)
            except RuntimeError:
                failed.append(k)
        if failed and not self.on_error.skips:
            key, shard = batch.names[failed[0]]
            raise DecodeError(f"sample {key!r} of {shard} is not a video DALI decodes on the {self.decoded_on} ("
                              f"{len(failed)} of the batch's {len(videos)} are not; DALI's CPU decoder takes VP8, VP9"
                              " and MJPEG only)", key=key)
        self.metrics.add(skipped=len(failed))
        if not kept:
            return self._empty_clips(), []
        return torch.cat(kept), good

    def _empty_clips(self) -> torch.Tensor:
        dtype = torch.uint8 if self.crop.mean is None else torch.float32
        return torch.empty(self.clips._shape(0), dtype=dtype, device=self.device)
