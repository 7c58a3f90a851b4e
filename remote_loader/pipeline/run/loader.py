"""``loader``: the DataLoader a pipeline is fast in, sized from the cores this rank may use;
and ``decode_batches``, for a pipeline that decodes on a GPU, with a DataLoader of your own."""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from remote_loader.checks import require_bool, require_int
from remote_loader.config import MAX_WORKERS, rank_cores
from remote_loader.errors import ConfigError
from remote_loader.pipeline.device import (
    DecodingProcess,
    DeviceDecoder,
    dali,
    decoded_with_states,
    discard,
    give_back,
    pipeline_bytes,
    take,
)
from remote_loader.pipeline.device import collate as device_collate
from remote_loader.pipeline.device.dali import DaliDecoder
from remote_loader.pipeline.run.dataloader import Loader
from remote_loader.pipeline.stages.chain import Chain, streams_bytes

log = logging.getLogger("remote_loader")
DECODING = ("dali", "process", "thread")


def loader(dataset: IterableDataset, *, num_workers: int | None = None, stateful: bool = False,
           decoding: str | None = None, **options: Any) -> Any:
    """A ``DataLoader`` over ``dataset`` set up to fill this rank's cores.

    One Python process runs its Python on one core at a time, so cores are filled by
    DataLoader worker processes: one per core this rank may use (``rank_cores()``: its CPU
    affinity, the container's CPU quota, and its share of the node under torchrun's
    ``LOCAL_WORLD_SIZE``). At most 4 where the workers only fetch: for a pipeline that
    decodes on the GPU, whose batches are decoded as they come by a process of its own,
    which runs the DataLoader too (``DeviceLoader``, docs/gpu.md), and for one that streams
    bytes, whose stages only pick fields and batch (``to_tuple``, ``batched``: no decode on
    the CPU, no ``map``, ``map_tuple`` or ``select``). A worker streams tens of thousands of
    samples a second of bytes, and each holds its own shuffle buffer and shard ranges, so
    more would add memory and no speed. Items come as the
    pipeline makes them (``batch_size=None``: batch with ``.batched``), workers persist
    across epochs, and batches land in pinned memory when CUDA is available, so their copy
    to the GPU can overlap the step.

    Args:
        dataset: A ``RemoteDataset`` pipeline (any iterable dataset works).
        num_workers: Worker processes; default one per core of this rank (at most 4 where
            the workers only fetch, above).
        stateful: A torchdata ``StatefulDataLoader`` (its ``state_dict()`` gathers each
            worker's position: see docs/checkpointing.md); needs the ``torchdata`` extra.
        decoding: For a pipeline that decodes on a device: ``"dali"``, by NVIDIA DALI in
            this process (its own threads: Python a few times a batch); ``"process"``, by
            nvImageCodec in a process of its own; ``"thread"``, by nvImageCodec in a thread
            of this one. Default: ``"dali"`` on a GPU where DALI is installed (the ``gpu``
            extra), else ``"process"``.
        **options: Any other ``DataLoader`` argument, overriding these defaults
            (``pin_memory``, ``persistent_workers``, ``prefetch_factor``...).

    Examples:
        >>> for images, labels in loader(ds):
        ...     train_step(images.cuda(non_blocking=True), labels)
    """
    if decoding is not None and decoding not in DECODING:  # also where it goes unused: CPU, or decode(device="auto")'s
        raise ConfigError(f"decoding must be one of {', '.join(map(repr, DECODING))} or None, got {decoding!r}")
    decoder = _decoder(dataset)
    if num_workers is not None:  # more: every worker of a RemoteDataset refused to start, at the first pass
        workers = require_int("num_workers", num_workers, 0, MAX_WORKERS)
    else:  # workers that only fetch bytes and draw crops need fewer cores than decoders
        fetching = decoder is not None or _streams_bytes(dataset)
        workers = min(rank_cores(), _FETCHING_WORKERS) if fetching else rank_cores()
    require_bool("stateful", stateful)
    settings: dict[str, Any] = {"batch_size": None, "num_workers": workers,
                                "pin_memory": torch.cuda.is_available()}
    if workers:
        settings.update(persistent_workers=True, prefetch_factor=2)
    if decoder is not None and options.get("batch_size") is not None and not _batches(dataset):
        settings["collate_fn"] = device_collate  # a DataLoader's batches of samples to decode
    settings.update(options)
    if stateful and settings["num_workers"] and settings.get("in_order", True) is not True:
        raise ConfigError("stateful=True with in_order=False: a StatefulDataLoader's state needs its workers' items"
                          " in order (out of order, a resume repeats some and loses others); leave in_order on")
    in_process = decoder is not None and decoding_of(decoder, decoding) != "process"
    if in_process and settings["num_workers"] and settings.get("persistent_workers"):
        settings["worker_init_fn"] = ByName(settings.get("worker_init_fn"))
    if not stateful:
        inner: DataLoader = Loader(dataset, **settings)
    else:
        try:
            import torchdata.stateful_dataloader  # noqa: F401 - the extra, asked for each time: it may be gone
        except ImportError:
            raise ConfigError("stateful=True needs torchdata's StatefulDataLoader: install the torchdata extra"
                              " (pip install '.[torchdata]' in remote_loader's checkout)") from None
        from remote_loader.pipeline.run.stateful import StatefulLoader

        with warnings.catch_warnings():  # torchdata's own, on every StatefulDataLoader: nothing a user can act on
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            inner = StatefulLoader(dataset, **settings)
    return inner if decoder is None else DeviceLoader(inner, decoder, dataset, decoding)


class ByName:
    """A ``worker_init_fn`` that has the worker hand its batches' tensors over by the name of
    their shared memory (torch's ``file_system`` strategy), then calls ``then``.

    With torch's default strategy the receiving process asks the worker for each tensor's
    file descriptor over a socket, a few blocking calls a tensor, each of which gives up the
    GIL and waits for it again: beside a Python thread of that process, up to a switch
    interval (5 ms) each time (a batch of 2 tensors: 79 ms beside a spinning thread, 8.9 ms
    by name). ``loader()`` sets it where this process decodes the batches (``decoding="dali"``
    or ``"thread"``), for persistent workers only: a pass cut short leaves the batches its
    workers had made unread, and by name their memory then stays until this process ends
    (persistent workers hand them over at the next pass); spawned workers that are not
    persistent would each leave a ``torch_shm_manager`` running. A DataLoader of your own
    keeps torch's default."""

    def __init__(self, then: Any = None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        import torch.multiprocessing

        if torch.multiprocessing.get_sharing_strategy() != "file_system":
            torch.multiprocessing.set_sharing_strategy("file_system")
        if self.then is not None:
            self.then(worker_id)


_FETCHING_WORKERS = 4
"""Workers ``loader()`` starts for a pipeline that decodes on a device or streams bytes (at
most): theirs is fetching (and drawing crops), a few cores' work for tens of thousands of
images a second."""


def _streams_bytes(dataset: Any) -> bool:
    """Whether ``dataset`` is a pipeline that only streams bytes (``streams_bytes``); a
    dataset that is not a pipeline may do anything."""
    chain = getattr(dataset, "stages", None)
    return isinstance(chain, list) and streams_bytes(chain)


def _batches(dataset: Any) -> bool:
    return Chain.of(getattr(dataset, "stages", ())).batches


def _decoder(dataset: Any) -> DeviceDecoder | None:
    batch_decoder = getattr(dataset, "batch_decoder", None)
    return batch_decoder() if callable(batch_decoder) else None


class DeviceLoader:
    """A DataLoader whose batches are decoded on a device as they come (``device/``):
    iterate it as the DataLoader it wraps, whose other attributes (``num_workers``...) it
    passes through.

    With ``decoding="dali"`` (the default on a GPU where DALI is installed) a thread of this process
    hands each batch to a DALI pipeline, whose native threads decode it (on a GPU, in this
    process's CUDA context, beside the training step's kernels), taking the GIL a few times
    a batch. With ``"process"`` the DataLoader and nvImageCodec run in a process of their
    own, started with the loader, which sends each batch ready. ``"thread"``: nvImageCodec
    in a thread of this process, as for a pipeline that cannot be pickled.

    Its ``state_dict()`` is the wrapped loader's state as of the last batch handed out
    (batches are decoded ahead of you); ``decoded_on`` says where JPEGs are decoded
    (``"GPU (DALI)"``, ``"CPU (DALI)"``, ``"hardware decoder"``, ``"CUDA"`` or ``"CPU"``);
    ``close()`` ends a decoding process now (it ends by itself when the loader is
    collected, and at exit)."""

    def __init__(self, inner: Any, decoder: DeviceDecoder, dataset: Any, decoding: str | None = None) -> None:
        decoding = decoding_of(decoder, decoding)
        if decoding == "dali":
            if not dali.installed():
                raise ConfigError(f"decoding='dali' needs NVIDIA DALI: {dali.EXTRA}")
            decoder = decoder if isinstance(decoder, DaliDecoder) else DaliDecoder.like(decoder)
        self.inner, self.decoder, self.dataset = inner, decoder, dataset
        self._state: Any = None  # the wrapped loader's state after the last batch handed out
        self._to_load: Any = None  # a state loaded for the next pass (decoding process)
        self._process: DecodingProcess | None = None
        self._sent = False  # the decoding process holds the pipeline (persistent workers: it keeps them)
        if decoding == "process" and isinstance(inner, DataLoader):
            self._start()
        else:
            if decoding != "process":  # a process started for the place's first pipeline serves nothing
                discard(decoder.place)
            decoder.open()  # now, in your thread: its probe and messages happen here, not mid-epoch

    def _start(self) -> None:
        self._process = take(self.decoder.place)
        self._give_back = weakref.finalize(self, give_back, self._process)
        self._sent = False

    def __iter__(self) -> Iterator[Any]:
        if self._process is not None and not self._process.alive():  # it was killed: a new one
            self._give_back.detach()
            self._start()
        pipeline = self._pipeline() if self._process is not None else None
        if self._process is None:
            self.decoder.open()  # in your thread (closed, the loader decodes here)
            snapshot = getattr(self.inner, "state_dict", None)
            # Where this pass starts, before it draws: a pass that fails before its first batch
            # is handed out has drawn one (the next is drawn before it goes), which the inner
            # loader's own state counts.
            self._state = snapshot() if snapshot is not None else None
            for item, state in decoded_with_states(self.inner, self.decoder, snapshot):
                self._state = state
                yield item
            return
        try:  # a loaded state stays loaded until a batch of it is handed out: a pass that fails first resumes it
            for item, state in self._process.run(pipeline, self._to_load, _world()):
                self._to_load, self._state = None, state
                yield item
            self._to_load = None
        except BaseException:
            self._sent = False  # the pass failed, perhaps before the pipeline arrived whole: send it again
            raise

    def _pipeline(self) -> bytes | None:
        """The loader and its pipeline to send for this pass (None: the process has them and
        its persistent workers); where they do not pickle, decode in this process instead."""
        persistent = bool(getattr(self.inner, "persistent_workers", False)) and self.inner.num_workers > 0
        if self._sent and persistent:
            return None
        try:
            pipeline = pipeline_bytes((self.inner, self.dataset))
        except Exception as error:  # noqa: BLE001 - what pickling raises varies; the fallback is the same
            log.warning("this loader's pipeline cannot go to a decoding process (%s: %s): its batches are decoded in"
                        " this process instead, where Python threads of your own slow them; make its functions"
                        " picklable, or say decoding='thread'", type(error).__name__, str(error)[:200])
            self.close()
            self.decoder.open()
            return None
        self._sent = True
        return pipeline

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def pid(self) -> int | None:
        """The decoding process's id (None where this process decodes)."""
        return self._process.pid if self._process is not None else None

    @property
    def decoded_on(self) -> str:
        return self._process.opened() if self._process is not None else self.decoder.decoded_on

    def state_dict(self) -> Any:
        if self._state is not None:
            return self._state
        return self._to_load if self._to_load is not None else self.inner.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self._state = None
        if self._process is not None:
            self._to_load = state
        else:
            self.inner.load_state_dict(state)

    def close(self) -> None:
        """End the decoding process and its DataLoader workers now (nothing in ``"thread"``
        mode); the loader decodes in this process from then on."""
        if self._process is not None:
            self._give_back.detach()
            self._process.close()
            self._process = None
        if self._to_load is not None:  # loaded for the decoding process's next pass: this one's now
            self.inner.load_state_dict(self._to_load)
            self._to_load = None

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "decoder", "dataset", "_state", "_to_load", "_process", "_sent", "_give_back"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def decoding_of(decoder: DeviceDecoder, decoding: str | None) -> str:
    """How ``decoder``'s batches are decoded: ``decoding``, checked, or the default."""
    if decoding is None:
        return decoder.decodings[0] if len(decoder.decodings) == 1 else default_decoding(decoder.device)
    if decoding not in DECODING:
        raise ConfigError(f"decoding must be one of {', '.join(map(repr, DECODING))}, got {decoding!r}")
    if decoding not in decoder.decodings:
        raise ConfigError(f"clips decoded on a device are decoded by DALI in this process: decoding must be"
                          f" {' or '.join(map(repr, decoder.decodings))}, got {decoding!r}")
    return decoding


def default_decoding(device: torch.device) -> str:
    """``"dali"`` on a GPU where DALI can be imported (one CUDA context: the decoder's kernels
    run beside the step's, not in turns with them), else ``"process"`` (on the CPU, a Python
    thread of the step slows a decoder of its own process more than one of another)."""
    return "dali" if device.type == "cuda" and dali.installed() else "process"


def _world() -> tuple[int, int] | None:
    """This rank and the world's size where torch.distributed was set up in this process
    (the decoding process, which has none, reads them from its environment otherwise)."""
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else None


def decode_batches(batches: Iterable[Any], dataset: Any, *, decoding: str | None = None
                   ) -> DeviceLoader | Iterable[Any]:
    """The batches of a DataLoader of your own over ``dataset`` (a pipeline with
    ``decode(..., device=...)``), decoded on the device as they come: each is ready when
    handed out. ``loader()`` does this by itself. ``decoding`` is ``loader()``'s: DALI in
    this process by default on a GPU; with ``"process"``, a DataLoader runs in a decoding process
    with the decoder (``DeviceLoader``; pickled there, once for persistent workers, else at
    each epoch), and any other iterable of batches is decoded by a thread of this process.

    Batches are decoded ahead of the one handed out, so a ``StatefulDataLoader``'s own
    ``state_dict()`` would count batches you have not had: checkpoint the ``state_dict()``
    of what this returns, which is the DataLoader's state as of the last batch handed out.

    A pipeline whose ``decode(device="auto")`` found no GPU decodes in its workers: its
    batches come ready, and ``batches`` is returned as it is (as ``loader()`` returns its
    DataLoader), its ``decoded_on`` set to ``"CPU"`` (a DataLoader takes it)."""
    decoder = _decoder(dataset)
    if decoder is None and getattr(dataset, "fell_back", False):
        with contextlib.suppress(AttributeError, TypeError):  # an iterable that takes no attribute comes as it is
            batches.decoded_on = "CPU"  # type: ignore[attr-defined]
        return batches
    if decoder is None:
        raise ConfigError("decode_batches is for a pipeline with decode(..., device='cuda'): this one decodes on"
                          " the CPU, in its workers, and its batches need nothing more")
    return DeviceLoader(batches, decoder, dataset, decoding)
