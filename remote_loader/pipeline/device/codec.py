"""The JPEG decoder behind the device stage: a small protocol (``Codec``), and NVIDIA's
nvImageCodec behind it. Which of its backends work is found once, in the user's thread,
when the pipeline is made: the GPU's hardware JPEG decoder, nvJPEG's CUDA decoders, or the
CPU; a GPU stage decodes on the CPU only when asked to (``cpu_fallback=True``)."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import simplejpeg
import torch

from remote_loader.config import rank_cores
from remote_loader.errors import ConfigError

log = logging.getLogger("remote_loader")

EXTRA = "install the gpu extra (pip install '.[gpu]' in remote_loader's checkout: NVIDIA's nvImageCodec)"
HARDWARE, CUDA, CPU = "hardware decoder", "CUDA", "CPU"


class Codec(Protocol):
    """Decodes whole JPEGs, not rotated by their EXIF orientation (as the CPU path), into
    ``3 x h x w`` uint8 tensors on its device; None for one it cannot decode."""

    decoded_on: str
    """Where it decodes, in words: ``"hardware decoder"``, ``"CUDA"`` or ``"CPU"``."""

    def decode(self, jpegs: Sequence[Any], cuda_stream: int) -> list[torch.Tensor | None]: ...


@contextlib.contextmanager
def _stderr_quiet() -> Iterator[None]:
    """File descriptor 2 into a file while nvImageCodec loads: it prints there, past Python,
    which libraries it could not load (JPEG 2000, TIFF, nvJPEG without CUDA). Only ever in
    the user's thread, while the pipeline is made, under ``_LOCK``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


_CLOSE_SECONDS = 2.0
_LOCK = threading.Lock()
_MODULE: list[Any] = []
_CODECS: dict[tuple[str, bool], NvImageCodec] = {}


def installed() -> bool:
    """Whether nvImageCodec can be imported, found without loading it (loading starts its
    libraries: the process that decodes loads it)."""
    if "nvidia.nvimgcodec" in sys.modules:
        return sys.modules["nvidia.nvimgcodec"] is not None
    try:
        return importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except (ImportError, ValueError):
        return False


def require_installed() -> None:
    """ConfigError naming the extra unless nvImageCodec can be imported."""
    if not installed():
        raise ConfigError(f"decoding batches needs nvImageCodec: {EXTRA}")


def nvimgcodec() -> Any:
    """The nvImageCodec module, loaded once without its messages on stderr; ConfigError
    naming the extra if it is not installed."""
    if _MODULE and sys.modules.get("nvidia.nvimgcodec") is _MODULE[0]:
        return _MODULE[0]
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")  # it names failed images, which our errors do
    with _LOCK, _stderr_quiet():
        try:
            module = importlib.import_module("nvidia.nvimgcodec")
        except ImportError:
            raise ConfigError(f"decoding batches needs nvImageCodec: {EXTRA}") from None
    _MODULE[:] = [module]
    return module


def open_codec(device: torch.device, cpu_fallback: bool = False) -> NvImageCodec:
    """The codec for ``device`` (``cuda:N`` or ``cpu``), made once per process: on a GPU,
    its backends probed with a small JPEG, and ConfigError where none decodes there unless
    ``cpu_fallback``."""
    module = nvimgcodec()
    key = (str(device), cpu_fallback)
    with _LOCK:
        found = _CODECS.get(key)
    if found is None:
        with _LOCK, _stderr_quiet():
            made = key not in _CODECS
            found = _CODECS.get(key) or NvImageCodec(module, device, cpu_fallback)
            _CODECS[key] = found
        if made:  # said once, past the silenced stderr
            if device.type == "cuda" and found.decoded_on == CPU:
                log.warning(
                    "decode(device=%r) decodes JPEGs on the CPU: nvImageCodec could not load nvJPEG", str(device)
                )
            log.info("remote_loader decodes JPEGs on %s: %s", device, found.decoded_on)
    return found


_PROBE = simplejpeg.encode_jpeg(np.full((16, 16, 3), 128, np.uint8), quality=90)


def _decodes(module: Any, device_id: int, backends: list[Any]) -> bool:
    """Whether a decoder of these backends can be made and decodes a JPEG into the GPU's
    memory here. The decoder is thrown away: on an H100, a decoder that has decoded one
    JPEG alone goes on to send its batches to the hybrid backend (the CPU's threads decoding,
    1,900 us of process CPU an image against 135, at half the rate)."""
    try:
        decoder = module.Decoder(device_id=device_id, max_num_cpu_threads=1, backends=backends)
        image = decoder.decode(module.CodeStream(_PROBE))
    except RuntimeError:  # "Could not create decoder": a backend's library is missing
        return False
    return image is not None and image.buffer_kind == module.ImageBufferKind.STRIDED_DEVICE


class NvImageCodec:
    """nvImageCodec's decoder for one device, with the backends that work there (the GPU's
    hardware decoder first, nvJPEG's CUDA decoders for what it does not take: progressive
    JPEGs, CMYK), its CPU threads capped at the rank's cores."""

    def __init__(self, module: Any, device: torch.device, cpu_fallback: bool) -> None:
        self.module, self.device = module, device
        if device.type == "cpu":
            self.decoded_on = CPU
            self._decoder: Any = module.Decoder(
                device_id=module.NVIMGCODEC_DEVICE_CPU_ONLY,
                max_num_cpu_threads=rank_cores(),
                backends=[module.Backend(module.BackendKind.CPU_ONLY)],
            )
        else:
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._decoder = self._on_gpu(module, index, cpu_fallback)
        self._params = module.DecodeParams(apply_exif_orientation=False, sample_format=module.SampleFormat.P_RGB)
        self._lock = threading.Lock()  # one decode at a time: a thread left from an epoch ended early may still run
        self._dlpack = device.type == "cuda"

    def _on_gpu(self, module: Any, index: int, cpu_fallback: bool) -> Any:
        """The GPU's decoder, its hardware decoder probed alone first (to say which decodes),
        then as many of the GPU's backends as can be made together: beside a hardware
        decoder that decoded its probe, made without a probe of their own (each costs a
        decoder's start, about 0.4 s on an H100, on the way to the first batch)."""
        kinds = module.BackendKind
        extra = [module.Backend(kinds.CPU_ONLY)] if cpu_fallback else []
        if _decodes(module, index, [module.Backend(kinds.HW_GPU_ONLY)]):
            for tried in ([kinds.HW_GPU_ONLY, kinds.HYBRID_CPU_GPU], [kinds.HW_GPU_ONLY]):
                try:
                    decoder = module.Decoder(device_id=index, max_num_cpu_threads=rank_cores(),
                                             backends=[module.Backend(k) for k in tried] + extra)
                except RuntimeError:  # "Could not create decoder": that backend's library is missing
                    continue
                self.decoded_on = HARDWARE
                return decoder
        for tried in ([kinds.GPU_ONLY, kinds.HYBRID_CPU_GPU], [kinds.HYBRID_CPU_GPU], [kinds.GPU_ONLY]):
            backends = [module.Backend(k) for k in tried] + extra
            if _decodes(module, index, backends):  # then a fresh decoder of the same backends
                self.decoded_on = CUDA
                return module.Decoder(device_id=index, max_num_cpu_threads=rank_cores(), backends=backends)
        if not cpu_fallback:
            raise ConfigError(
                f"decode(device={str(self.device)!r}) found no GPU JPEG decoder: nvImageCodec could not"
                " load nvJPEG (pip install 'nvidia-nvimgcodec-cu13[nvjpeg]', or the CUDA toolkit's);"
                " pass cpu_fallback=True to decode on the CPU instead"
            )
        self.decoded_on = CPU
        return module.Decoder(
            device_id=index, max_num_cpu_threads=rank_cores(), backends=[module.Backend(kinds.CPU_ONLY)]
        )

    def decode(self, jpegs: Sequence[Any], cuda_stream: int) -> list[torch.Tensor | None]:
        module = self.module
        streams: list[Any] = []
        for data in jpegs:
            try:
                streams.append(module.CodeStream(data))
            except RuntimeError:
                streams.append(None)
        todo = [s for s in streams if s is not None]
        with self._lock:
            if self._decoder is None:
                raise RuntimeError("the decoder was released: the interpreter is exiting")
            decoded = self._decoder.decode(todo, params=self._params, cuda_stream=cuda_stream) if todo else []
        images = iter(decoded)
        return [None if s is None else self._tensor(next(images)) for s in streams]

    def _tensor(self, image: Any) -> torch.Tensor | None:
        """An nvImageCodec image as a ``3 x h x w`` uint8 tensor on the device, sharing its
        memory where it is there (the tensor keeps the image alive)."""
        if image is None:
            return None
        if image.buffer_kind != self.module.ImageBufferKind.STRIDED_DEVICE:
            return torch.from_numpy(np.asarray(image.cpu())).to(self.device, non_blocking=True)
        if self._dlpack:
            try:
                return torch.from_dlpack(image)
            except (RuntimeError, TypeError, BufferError):
                self._dlpack = False
        return torch.as_tensor(image, device=self.device)

    def close(self) -> None:
        """Release nvImageCodec's decoder (and its threads) now, while the interpreter still
        runs: released during its teardown, it can abort the process."""
        if self._lock.acquire(timeout=_CLOSE_SECONDS):  # a decode under way ends first, if it ends soon
            self._decoder = None
            self._lock.release()


@atexit.register
def _release() -> None:
    with _LOCK:
        codecs = list(_CODECS.values())
        _CODECS.clear()
    for codec in codecs:
        codec.close()
