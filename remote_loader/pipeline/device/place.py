"""Where a decode stage decodes, checked in the user's process when the chain is made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from remote_loader.errors import ConfigError
from remote_loader.pipeline.device import dali
from remote_loader.pipeline.device.codec import installed, open_codec, require_installed
from remote_loader.pipeline.device.decoder import Place
from remote_loader.pipeline.device.process import prestart

_DEVICES = "decode device must be 'cpu', 'cuda', 'cuda:N' or 'auto'"


def check_device(device: Any, batched: bool, cpu_fallback: bool = False, crop: Any = None) -> Place | None:
    """None for the CPU path in the workers, else where the batched path decodes: ``"cuda"``
    resolved to this process's current GPU (the rank's, as torchrun and DDP set it).

    Only what is cheap to know is checked here (the device, CUDA, nvImageCodec installed):
    which of the GPU's decoders work is found where the batches are decoded, when the
    decoder opens, so CUDA and the decoders start while you go on: in a decoding process,
    which starts now (the first pipeline of this process and place). ``"auto"`` must
    choose between the two paths now, so it opens the GPU's decoder here: where none
    decodes, it takes the CPU path. On a GPU where DALI is installed (the default decoder
    there, in this process), its pipeline for ``crop`` is built on a thread now instead."""
    place = _resolved(device, batched, cpu_fallback)
    if place is not None and place.device.type == "cuda" and crop is not None and dali.installed():
        dali.prestart(place, crop)
    elif place is not None:
        prestart(place)
    return place


def _resolved(device: Any, batched: bool, cpu_fallback: bool = False) -> Place | None:
    if device == "auto":
        if not (torch.cuda.is_available() and installed()):
            return _resolved("cpu", batched)
        try:
            found = _resolved("cuda", batched, cpu_fallback)
            assert found is not None
            open_codec(found.device, cpu_fallback)
            return found
        except ConfigError:  # the GPU has no decoder: the CPU path, as where there is no GPU
            return _resolved("cpu", batched)
    try:
        place = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{_DEVICES}, got {device!r}") from None
    if place.type == "cpu":
        if not batched:
            return None
        require_installed()
        return Place(place)
    if place.type != "cuda":
        raise ConfigError(f"{_DEVICES}, got {device!r}")
    if not torch.cuda.is_available():
        raise ConfigError(f"decode(device={device!r}) needs CUDA, and torch.cuda.is_available() is False here"
                          " (no GPU, or a CPU build of torch): use device='auto' to decode on the CPU where there"
                          " is no GPU")
    place = indexed(place, _current_device)
    if place.index is not None and place.index >= torch.cuda.device_count():
        raise ConfigError(f"decode(device={device!r}): this process sees {torch.cuda.device_count()} GPU(s),"
                          f" numbered from 0")
    require_installed()
    return Place(place, cpu_fallback)


def clip_place(device: str) -> Place:
    """Where DALI decodes clips (``VideoClip(device=...)``): ``cuda`` resolved to this
    process's current GPU, or the CPU (DALI's CPU operators); ConfigError without CUDA there,
    or without DALI."""
    if not dali.installed():
        raise ConfigError(f"VideoClip(device={device!r}) decodes clips with NVIDIA DALI: {dali.EXTRA}")
    place = torch.device(device)
    if place.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"VideoClip(device={device!r}) needs CUDA, and torch.cuda.is_available() is False here")
        place = indexed(place, _current_device)
        if place.index is not None and place.index >= torch.cuda.device_count():
            raise ConfigError(f"VideoClip(device={device!r}): this process sees {torch.cuda.device_count()} GPU(s)")
    return Place(place)


def indexed(place: torch.device, current: Callable[[], int]) -> torch.device:
    """``cuda`` as ``cuda:N``, N the current device (``current()``); ``cuda:N`` as it is."""
    return place if place.index is not None else torch.device(place.type, current())


def _current_device() -> int:
    """This process's current GPU, without starting CUDA for it: where CUDA has not
    started, nothing chose another (``torch.cuda.set_device`` starts it), so it is 0."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0
