"""Where a decode stage decodes, checked in the user's process when the chain is made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from remote_loader.errors import ConfigError
from remote_loader.pipeline.device.codec import nvimgcodec, open_codec
from remote_loader.pipeline.device.decoder import Place

_DEVICES = "decode device must be 'cpu', 'cuda', 'cuda:N' or 'auto'"


def check_device(device: Any, batched: bool, cpu_fallback: bool = False) -> Place | None:
    """None for the CPU path in the workers, else where the batched path decodes: ``"cuda"``
    resolved to this process's current GPU (the rank's, as torchrun and DDP set it), and the
    codec opened there now, in the user's thread, so a missing decoder is said here."""
    if device == "auto":
        if not (torch.cuda.is_available() and _importable()):
            return check_device("cpu", batched)
        try:  # the GPU where it has a decoder; else the CPU path, as there is no GPU
            return check_device("cuda", batched, cpu_fallback)
        except ConfigError:
            return check_device("cpu", batched)
    try:
        place = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{_DEVICES}, got {device!r}") from None
    if place.type == "cpu":
        if batched:
            open_codec(place)
        return Place(place) if batched else None
    if place.type != "cuda":
        raise ConfigError(f"{_DEVICES}, got {device!r}")
    if not torch.cuda.is_available():
        raise ConfigError(f"decode(device={device!r}) needs CUDA, and torch.cuda.is_available() is False here"
                          " (no GPU, or a CPU build of torch): use device='auto' to decode on the CPU where there"
                          " is no GPU")
    place = indexed(place, torch.cuda.current_device)
    if place.index is not None and place.index >= torch.cuda.device_count():
        raise ConfigError(f"decode(device={device!r}): this process sees {torch.cuda.device_count()} GPU(s),"
                          f" numbered from 0")
    open_codec(place, cpu_fallback)
    return Place(place, cpu_fallback)


def indexed(place: torch.device, current: Callable[[], int]) -> torch.device:
    """``cuda`` as ``cuda:N``, N the current device (``current()``); ``cuda:N`` as it is."""
    return place if place.index is not None else torch.device(place.type, current())


def _importable() -> bool:
    try:
        nvimgcodec()
    except ConfigError:
        return False
    return True
