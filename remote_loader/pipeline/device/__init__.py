"""Decoding whole batches on a GPU: workers draw each sample's crop, the main process decodes.

``decode(RandomResizedCrop(224), device="cuda")`` keeps CUDA out of DataLoader workers (it
does not survive a fork). There the stage only checks each JPEG and draws the sample's crop
box and flip from (seed, epoch, key), exactly as the CPU path does (``prepared``), and
``batched`` gathers a batch's JPEGs into one tensor. In the main process each batch is
decoded by one codec call (``codec``: nvImageCodec, the GPU's hardware JPEG decoder where
it has one), then cropped and resized in a few kernels (``resize``), on a CUDA stream of
the decoder's own (``decoder``), two batches ahead of the caller (``stream``).

nvImageCodec's CPU backend runs the same code on the CPU (``batched=True`` with
``device="cpu"``): how the tests cover it, and a way to try a GPU script without a GPU.
Images that are not JPEG are decoded by the workers on the CPU, as the CPU path does.

Clips (``VideoClip(device=...)``) take the same way: workers draw each clip's frames, box
and flip, ``batched`` gathers the videos, and DALI decodes them in the main process
(``dali_clips``).
"""

from remote_loader.pipeline.device.channel import pipeline_bytes
from remote_loader.pipeline.device.codec import CPU, CUDA, EXTRA, HARDWARE, Codec, nvimgcodec, open_codec
from remote_loader.pipeline.device.dali_clips import DaliClipDecoder
from remote_loader.pipeline.device.decoded import decoded_with_states
from remote_loader.pipeline.device.decoder import DeviceDecoder, Place
from remote_loader.pipeline.device.place import check_device, clip_place
from remote_loader.pipeline.device.process import DecodingProcess, discard, give_back, take
from remote_loader.pipeline.stages.prepared import Encoded, EncodedBatch, collate, prepare

__all__ = ["CPU", "CUDA", "EXTRA", "HARDWARE", "Codec", "DaliClipDecoder", "DecodingProcess", "DeviceDecoder",
           "Encoded", "EncodedBatch", "Place", "check_device", "clip_place", "collate", "decoded_with_states",
           "discard", "give_back", "nvimgcodec", "open_codec", "pipeline_bytes", "prepare", "take"]
