"""``loader``: the DataLoader a pipeline is fast in, sized from the cores this rank may use;
and ``decode_batches``, for a pipeline that decodes on a GPU, with a DataLoader of your own."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from remote_loader.config import rank_cores, require_bool, require_int
from remote_loader.errors import ConfigError
from remote_loader.pipeline.device import DeviceDecoder, decoded_with_states
from remote_loader.pipeline.device import collate as device_collate


def loader(dataset: IterableDataset, *, num_workers: int | None = None, stateful: bool = False,
           **options: Any) -> Any:
    """A ``DataLoader`` over ``dataset`` set up to fill this rank's cores.

    One Python process runs its Python on one core at a time, so cores are filled by
    DataLoader worker processes: one per core this rank may use (``rank_cores()``: its CPU
    affinity, the container's CPU quota, and its share of the node under torchrun's
    ``LOCAL_WORLD_SIZE``); at most 4 for a pipeline that decodes on the GPU, whose batches
    are then decoded in this process as they come (docs/gpu.md). Items come as the
    pipeline makes them (``batch_size=None``: batch with ``.batched``), workers persist
    across epochs, and batches land in pinned memory when CUDA is available, so their copy
    to the GPU can overlap the step.

    Args:
        dataset: A ``RemoteDataset`` pipeline (any iterable dataset works).
        num_workers: Worker processes; default one per core of this rank.
        stateful: A torchdata ``StatefulDataLoader`` (its ``state_dict()`` gathers each
            worker's position: see docs/checkpointing.md); needs the ``torchdata`` extra.
        **options: Any other ``DataLoader`` argument, overriding these defaults
            (``pin_memory``, ``persistent_workers``, ``prefetch_factor``...).

    Examples:
        >>> for images, labels in loader(ds):
        ...     train_step(images.cuda(non_blocking=True), labels)
    """
    decoder = _decoder(dataset)
    if num_workers is not None:
        workers = require_int("num_workers", num_workers, 0)
    else:  # workers that only fetch bytes and draw crops need fewer cores than decoders
        workers = min(rank_cores(), _FETCHING_WORKERS) if decoder is not None else rank_cores()
    require_bool("stateful", stateful)
    settings: dict[str, Any] = {"batch_size": None, "num_workers": workers,
                                "pin_memory": torch.cuda.is_available()}
    if workers:
        settings.update(persistent_workers=True, prefetch_factor=2)
    if decoder is not None and options.get("batch_size") is not None and not _batches(dataset):
        settings["collate_fn"] = device_collate  # a DataLoader's batches of samples to decode
    settings.update(options)
    if not stateful:
        inner = DataLoader(dataset, **settings)
    else:
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader
        except ImportError:
            raise ConfigError("stateful=True needs torchdata's StatefulDataLoader: install the torchdata extra"
                              " (pip install '.[torchdata]' in remote_loader's checkout)") from None
        with warnings.catch_warnings():  # torchdata's own, on every StatefulDataLoader: nothing a user can act on
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            inner = StatefulDataLoader(dataset, **settings)
    return inner if decoder is None else DeviceLoader(inner, decoder)


_FETCHING_WORKERS = 4
"""Workers ``loader()`` starts for a pipeline that decodes on a device (at most): theirs is
fetching and drawing crops, a few cores' work for tens of thousands of images a second."""


def _batches(dataset: Any) -> bool:
    return any(stage.cardinality.batches for stage in getattr(dataset, "stages", ()))


def _decoder(dataset: Any) -> DeviceDecoder | None:
    batch_decoder = getattr(dataset, "batch_decoder", None)
    return batch_decoder() if callable(batch_decoder) else None


class DeviceLoader:
    """A DataLoader whose batches are decoded on a device as they come (``device/``):
    iterate it as the DataLoader it wraps, whose other attributes (``num_workers``...) it
    passes through. Its ``state_dict()`` is the wrapped loader's state as of the last batch
    handed out (batches are drawn two ahead of you, to decode); ``decoded_on`` says where
    JPEGs are decoded (``"hardware decoder"``, ``"CUDA"`` or ``"CPU"``)."""

    def __init__(self, inner: Any, decoder: DeviceDecoder) -> None:
        self.inner, self.decoder = inner, decoder
        self._state: Any = None  # the wrapped loader's state after the last batch handed out

    def __iter__(self) -> Iterator[Any]:
        snapshot = getattr(self.inner, "state_dict", None)
        for item, state in decoded_with_states(self.inner, self.decoder, snapshot):
            self._state = state
            yield item

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def decoded_on(self) -> str:
        return self.decoder.decoded_on

    def state_dict(self) -> Any:
        return self._state if self._state is not None else self.inner.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self._state = None
        self.inner.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "decoder", "_state"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def decode_batches(batches: Iterable[Any], dataset: Any) -> DeviceLoader:
    """The batches of a DataLoader of your own over ``dataset`` (a pipeline with
    ``decode(..., device=...)``), decoded on the device as they come, on a thread and CUDA
    stream of their own: each is ready when handed out. ``loader()`` does this by itself.

    Batches are drawn two ahead of the one handed out, so a ``StatefulDataLoader``'s own
    ``state_dict()`` counts batches you have not had: checkpoint the ``state_dict()`` of
    what this returns, which is the DataLoader's state as of the last batch handed out."""
    decoder = _decoder(dataset)
    if decoder is None:
        raise ConfigError("decode_batches is for a pipeline with decode(..., device='cuda'): this one decodes on"
                          " the CPU, in its workers, and its batches need nothing more")
    return DeviceLoader(batches, decoder)
