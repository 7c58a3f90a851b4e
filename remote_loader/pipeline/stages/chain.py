"""Pipeline stages: the stage objects a chain is made of, and the generators they run.

A stage is a plain generator over samples. Its object says what it is: what one of its
outputs holds of its inputs (its ``Cardinality``, stated once: one sample, a batch, or one
sample of those a filter kept), which is all a checkpoint needs to count what left the
pipeline; whether it draws randomness
(from the iteration's ``Context`` and the sample's key, never from a generator each worker
starts alike); and on how many threads it runs. Stages know nothing of checkpoints: a
worker's stream (``stream.py``) holds an iteration's state. Arguments are checked when the chain
method is called, in the user's process. Stage objects pickle into DataLoader workers.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any

import numpy as np

from remote_loader.checks import require_bool, require_int
from remote_loader.config import MOST_THREADS
from remote_loader.errors import ConfigError, DecodeError, OnError
from remote_loader.pipeline.stages.augment import RandomResizedCrop
from remote_loader.pipeline.stages.decode import IMAGE_FIELDS, MODES, decode_sample
from remote_loader.pipeline.stages.joint import crop_together, is_structured
from remote_loader.pipeline.stages.prepared import prepare
from remote_loader.pipeline.stages.threads import apply, threaded_map
from remote_loader.pipeline.stages.video import VideoClip

log = logging.getLogger("remote_loader")


@dataclass(frozen=True)
class Context:
    """Where an iteration stands: what seeded stages draw their randomness from."""

    seed: int
    epoch: int
    rank: int
    worker: int
    metrics: Any = None
    """The worker's ``Metrics``, where a stage counts what it skipped."""


def sample_rng(context: Context, key: str) -> np.random.Generator:
    """A generator fixed by (seed, epoch, sample key): the same draws for a sample whatever
    the number of threads, workers or ranks that process it, and after a resume."""
    digest = hashlib.blake2b(str(key).encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return np.random.default_rng(
        [context.seed & (2**64 - 1), context.epoch, *np.frombuffer(digest, dtype=np.uint32).tolist()]
    )


def _check_threads(threads: int) -> int:
    return require_int("threads (0: run in the calling thread)", threads, 0, MOST_THREADS)


def _check_callable(fn: Any, what: str) -> None:
    if not callable(fn):
        raise ConfigError(f"{what} must be callable, got {type(fn).__name__}")


@dataclass(frozen=True)
class Cardinality:
    """What one output of a stage holds of its input samples: the one fact the pipeline
    counts by (``len()``, the workers' shares, what a checkpoint's items account for).

    Attributes:
        size: Input samples per output; None where a filter decides.
        batches: Outputs are batches of ``size`` (the last shorter where ``keep_short``).
        keep_short: A last batch shorter than ``size`` is kept.
        filters: It leaves some samples out, in order, in the calling thread (a kept
            sample's output is noted against how many it had taken in).
    """

    size: int | None = 1
    batches: bool = False
    keep_short: bool = True
    filters: bool = False

    @property
    def one_to_one(self) -> bool:
        """One sample in gives one out, in order (a filter of failures only counts as one)."""
        return self.size == 1 and not self.batches

    def outputs(self, inputs: int) -> int | None:
        """Outputs for ``inputs`` samples; None where that depends on the samples."""
        if self.size is None:
            return None
        if self.batches and not self.keep_short:
            return inputs // self.size
        return -(-inputs // self.size)


ONE = Cardinality()
"""One sample in, one out."""


@dataclass(frozen=True)
class Chain:
    """What a pipeline's items hold of its samples, from its stages' cardinalities in order:
    the one place that arithmetic lives (``len()``, the workers' shares, what a checkpoint's
    items account for, where a failure is named)."""

    parts: tuple[Cardinality, ...]

    @classmethod
    def of(cls, stages: Iterable[Stage]) -> Chain:
        return cls(tuple(stage.cardinality for stage in stages))

    def one_to_one(self, stop: int | None = None) -> bool:
        """Every stage (before stage ``stop``) gives one output per sample, in order."""
        return all(part.one_to_one for part in self.parts[:stop])

    @property
    def batches(self) -> bool:
        """Some stage makes batches."""
        return any(part.batches for part in self.parts)

    @property
    def filters(self) -> list[int]:
        """The stages that leave samples out."""
        return [i for i, part in enumerate(self.parts) if part.filters]

    def outputs(self, samples: int) -> int | None:
        """Items for ``samples`` samples in; None where that depends on the samples (``select``)."""
        count: int | None = samples
        for part in self.parts:
            count = None if count is None else part.outputs(count)
        return count

    def align(self) -> int:
        """Samples each item holds, where that is fixed (1 where a filter decides): workers'
        shares are cut in multiples of it, so batches come out whole and as many as ``len()``
        says."""
        align = 1
        for part in self.parts:
            if part.size is None:
                return 1
            align *= part.size
        return align

    def per_item(self) -> int | None:
        """Samples per item where an item count says how many samples were delivered: every
        stage maps one sample to one, the last may batch them; None otherwise."""
        last = self.parts[-1] if self.parts else None
        batched = last is not None and last.batches
        if not self.one_to_one(-1 if batched else None):
            return None
        return (last.size or 1) if batched and last is not None else 1

    def inputs(self, items: int, stage: int, taken_by: Callable[[int, int], int]) -> int:
        """Items at the output of stage ``stage - 1`` (the source's for 0) that ``items``
        delivered account for, walking back from the end: batches multiply, and a filter
        ``i`` says how many it had taken in for ``n`` out (``taken_by(i, n)``)."""
        n = items
        for i in range(len(self.parts) - 1, stage - 1, -1):
            part = self.parts[i]
            if part.batches:
                n *= part.size or 1
            elif part.filters:
                n = taken_by(i, n)
        return n


Form = str | int | None
"""What a pipeline's samples are at a stage: ``"dict"`` (fields by name, as they stream),
a tuple's length, ``"batch"``, or None where that is not known (what a function made)."""


class Stage(ABC):
    """One step of a pipeline."""

    cardinality: Cardinality = ONE
    """What one of its outputs holds of its inputs."""
    seeded: bool = False
    """It draws randomness from the iteration's context."""
    threads: int = 0
    """Threads it runs on (0: the calling thread)."""

    @abstractmethod
    def run(self, samples: Iterable[Any], context: Context) -> Iterator[Any]:
        """The stage's output for ``samples``."""

    def on_device(self) -> tuple[Any, Any] | None:
        """``(crop, place)`` for a stage whose images are decoded later, in batches, on a
        device (``device/``), else None."""
        return None

    def fields(self, names: frozenset[str] | None) -> frozenset[str] | None:
        """The field names of this stage's samples, given those of the samples it takes in:
        None where they are unknown (what a function makes of a sample, a tuple, a batch)."""
        return None

    def form(self, before: Form) -> Form:
        """What this stage's samples are (``Form``), given what it takes in."""
        return None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not callable(v) and k != "cardinality")
        return f"{type(self).__name__}({fields})"


def check_shuffle(bufsize: Any, initial: Any) -> tuple[int, int]:
    """A shuffle buffer's arguments, checked (any integer type: numpy's too); ``initial``
    None: ``min(bufsize, 100)``."""
    bufsize = require_int("shuffle's bufsize", bufsize, 1)
    if initial is None:
        return bufsize, min(bufsize, 100)
    return bufsize, require_int("shuffle's initial", initial, 0, bufsize)


class Map(Stage):
    """``fn`` applied to every sample, on ``threads`` threads (order kept) or in this one."""

    def __init__(self, fn: Callable[[Any], Any], threads: int = 0) -> None:
        _check_callable(fn, "map's function")
        self.fn, self.threads = fn, _check_threads(threads)

    def run(self, samples: Iterable[Any], context: Context) -> Iterator[Any]:
        return threaded_map(self.fn, samples, self.threads) if self.threads else apply(self.fn, samples)


class Decode(Stage):
    """Decode images by ``mode`` and labels. A seeded decoder (``RandomResizedCrop``) gets a
    generator fixed by (seed, epoch, sample key) for every sample. With ``device``, a
    ``RandomResizedCrop``'s images are only prepared here (their crops drawn) and decoded
    in batches on that device, in the main process (``device/``)."""

    def __init__(self, mode: str | Callable[..., Any], min_size: int | None = None, threads: int = 0,
                 device: Any = None, on_error: OnError = OnError.RAISE, video: VideoClip | None = None) -> None:
        if not callable(mode) and mode not in MODES:
            raise ConfigError(f"decode mode must be one of {', '.join(MODES)} or a callable, got {mode!r}")
        if min_size is not None:
            min_size = require_int("min_size", min_size, 1)
        if video is not None and not isinstance(video, VideoClip):
            raise ConfigError(f"decode's video must be a VideoClip, got {type(video).__name__}")
        if device is not None:
            require_crop(mode, getattr(device, "device", device))
        if device is not None and video is not None and video.device is not None:
            raise ConfigError("decode(device=...) with VideoClip(device=...): one of them decodes on the device (decode"
                              " the images on the device, or the clips)")
        self.mode, self.min_size, self.threads, self.device = mode, min_size, _check_threads(threads), device
        self.video = video
        self.seeded, self.on_error = bool(getattr(mode, "seeded", False)) or video is not None, on_error

    def run(self, samples: Iterable[Any], context: Context) -> Iterator[Any]:
        if self.device is not None:
            assert isinstance(self.mode, RandomResizedCrop)  # checked when the stage was made
            fn: Callable[[Any], Any] = partial(_prepare_seeded, self.mode, context, video=self.video)
        elif self.seeded:
            fn = partial(_decode_seeded, self.mode, self.min_size, context, video=self.video)
        else:
            fn = partial(decode_sample, mode=self.mode, min_size=self.min_size)
        if self.on_error.skips:  # left out by DropUndecodable, where it is counted (on a device: what fails here,
            # a header that does not parse, an image of another format that does not decode)
            fn = partial(_or_undecodable, fn)
        return threaded_map(fn, samples, self.threads) if self.threads else apply(fn, samples)

    def on_device(self) -> tuple[Any, Any] | None:
        if self.video is not None and self.video.device is not None:
            return self.video, self.video.device  # clips decoded in the training process
        return (self.mode, self.device) if self.device is not None else None

    def form(self, before: Form) -> Form:
        return before

    def fields(self, names: frozenset[str] | None) -> frozenset[str] | None:
        if names is None or self.video is None:
            return names  # each field decoded under its own name
        return names | self.video.added(names)  # and a video field's sound beside it, where asked


@dataclass(frozen=True)
class Undecodable:
    """What a ``Decode(on_error=OnError.SKIP)`` makes of a sample whose fields do not decode."""

    error: DecodeError


def _or_undecodable(fn: Callable[[Any], Any], sample: Any) -> Any:
    try:
        return fn(sample)
    except DecodeError as error:
        return Undecodable(error)


class DropUndecodable(Stage):
    """Leaves out the samples a ``Decode(on_error=OnError.SKIP)`` could not decode (``on_error="skip"``),
    counted in ``metrics.skipped`` and logged. One sample in, one out, but for those: a
    count state is off by the samples left out before it, as for damaged bytes."""

    cardinality = Cardinality(filters=True)

    def fields(self, names: frozenset[str] | None) -> frozenset[str] | None:
        return names

    def form(self, before: Form) -> Form:
        return before

    def run(self, samples: Iterable[Any], context: Context) -> Iterator[Any]:
        for sample in samples:
            if isinstance(sample, Undecodable):
                log.warning("skipped an undecodable sample (on_error='skip'): %s", sample.error)
                if context.metrics is not None:
                    context.metrics.add(skipped=1)
                continue
            yield sample


def require_crop(mode: Any, device: Any) -> None:
    """A stage decoding on a device takes a ``RandomResizedCrop`` (its boxes are what the
    workers draw); ConfigError naming ``device`` for anything else."""
    if not isinstance(mode, RandomResizedCrop):
        raise ConfigError(f"decoding on a device ({device}) is for RandomResizedCrop(size); decode {mode!r}"
                          " on the CPU")


def _decode_seeded(mode: Any, min_size: int | None, context: Context, sample: dict[str, Any],
                   video: VideoClip | None = None) -> dict[str, Any]:
    rng = sample_rng(context, sample.get("__key__", ""))
    if isinstance(mode, RandomResizedCrop) and is_structured(sample):  # its targets cropped with its images
        return crop_together(mode, sample, rng, partial(decode_sample, mode="raw", rng=rng, video=video))
    return decode_sample(sample, mode, min_size, rng=rng, video=video)


def _prepare_seeded(crop: RandomResizedCrop, context: Context, sample: dict[str, Any],
                    video: VideoClip | None = None) -> dict[str, Any]:
    """The sample with its images prepared for the device (``device.prepare``), labels decoded."""
    key, shard = sample.get("__key__", ""), sample.get("__shard__", "")

    if is_structured(sample):
        raise ConfigError(f"decode(device=...) crops classification samples (an image and its label); sample"
                          f" {key!r} of {shard} has the fields {sorted(n for n in sample if not n.startswith('__'))}:"
                          " decode it with RandomResizedCrop on the CPU, which crops its targets with its images")

    def prepared(field: str, data: Any, rng: Any = None) -> Any:
        return prepare(crop, data, rng, key, shard) if field.rsplit(".", 1)[-1] in IMAGE_FIELDS else data

    return decode_sample(sample, prepared, None, rng=sample_rng(context, key), video=video)


class ToTuple(Stage):
    """Dict samples become tuples of these fields (``"jpg;png"``: the first present). A name
    is a sample's key as it is (``jpg``, ``0.jpg``, ``1.boxes.npy``, ``__key__``)."""

    def __init__(self, fields: Sequence[str]) -> None:
        if not fields or not all(isinstance(f, str) and f.strip() for f in fields):
            raise ConfigError(f"to_tuple needs one or more field names, got {tuple(fields)!r}")
        if len(fields) == 1:  # WebDataset's single-string form: to_tuple("jpg;png cls")
            fields = fields[0].split()
        elif any(f != f.strip() or " " in f for f in fields):
            raise ConfigError(
                f"to_tuple's field names hold spaces: {tuple(fields)!r}; give one string"
                ' ("jpg;png cls") or one argument per field'
            )
        self.names = tuple(fields)

    def check(self, names: frozenset[str] | None, where: object) -> None:
        """ConfigError where a name (or every alternative of ``"jpg;png"``) is none of the
        field names ``names`` the samples of ``where`` hold (None: not known before they come)."""
        if not names:
            return
        missing = [spec for spec in self.names if not any(name in names for name in spec.split(";"))]
        if missing:
            raise ConfigError(f"to_tuple: {where} has {' and '.join(_absent(spec, names) for spec in missing)};"
                              f" its samples hold {listed(names)}")

    def form(self, before: Form) -> Form:
        return len(self.names)

    def run(self, samples: Iterable[Any], context: Context) -> Iterator[Any]:
        return to_tuple_stage(samples, self.names)


class MapTuple(Stage):
    """``fns[i]`` applied to element ``i`` of each tuple (None keeps it)."""

    def __init__(self, fns: Sequence[Callable[[Any], Any] | None]) -> None:
        for fn in fns:
            if fn is not None:
                _check_callable(fn, "each of map_tuple's functions")
        self.fns = tuple(fns)

    def form(self, before: Form) -> Form:
        return before

    def run(self, samples: Iterable[Any], context: Context) -> Iterator[Any]:
        return map_tuple_stage(samples, self.fns)


class Select(Stage):
    """Keep the samples for which ``predicate`` is true."""

    cardinality = Cardinality(size=None, filters=True)

    def __init__(self, predicate: Callable[[Any], bool]) -> None:
        _check_callable(predicate, "select's predicate")
        self.predicate = predicate

    def fields(self, names: frozenset[str] | None) -> frozenset[str] | None:
        return names

    def form(self, before: Form) -> Form:
        return before

    def run(self, samples: Iterable[Any], context: Context) -> Iterator[Any]:
        return select_stage(samples, self.predicate)


class Batched(Stage):
    """Groups of ``batchsize`` samples, collated by ``collation_fn``."""

    def __init__(self, batchsize: int, collation_fn: Callable[[list[Any]], Any] | None, keep_short: bool) -> None:
        batchsize = require_int("batch size", batchsize, 1)
        if collation_fn is not None:
            _check_callable(collation_fn, "collation_fn")
        require_bool("partial", keep_short)  # "no" was taken for True
        self.batchsize, self.collation_fn, self.keep_short = batchsize, collation_fn, keep_short
        self.cardinality = Cardinality(batchsize, batches=True, keep_short=self.keep_short)

    def form(self, before: Form) -> Form:
        return "batch"

    def run(self, samples: Iterable[Any], context: Context) -> Iterator[Any]:
        return batched_stage(samples, self.batchsize, self.collation_fn, self.keep_short)


def streams_bytes(stages: Iterable[Stage]) -> bool:
    """Whether ``stages`` only pick fields and batch: nothing runs for each sample that
    decodes or is the user's (a ``collation_fn`` runs once a batch). Such a pipeline's
    workers only fetch and copy bytes."""
    return all(isinstance(stage, ToTuple | Batched) for stage in stages)


# --------------------------------------------------------------------------- the generators stages run


def select_stage(samples: Iterable[Any], predicate: Callable[[Any], bool]) -> Iterator[Any]:
    """Keep the samples for which ``predicate`` is true."""
    for sample in samples:
        if predicate(sample):
            yield sample


def map_tuple_stage(samples: Iterable[Sequence[Any]], fns: Sequence[Callable[[Any], Any] | None]) -> Iterator[Any]:
    """Apply ``fns[i]`` to element ``i`` of each tuple (None leaves an element as it is)."""
    for sample in samples:
        if len(sample) != len(fns):
            raise ConfigError(f"map_tuple got {len(fns)} functions for a sample of {len(sample)} elements")
        yield tuple(x if fn is None else fn(x) for fn, x in zip(fns, sample, strict=True))


def to_tuple_stage(samples: Iterable[dict[str, Any]], fields: Sequence[str]) -> Iterator[Any]:
    """Turn dict samples into tuples; ``"jpg;png"`` takes the first of those fields present."""
    choices = [spec.split(";") for spec in fields]
    if any(len(options) > 1 for options in choices):
        for sample in samples:
            yield _pick(sample, choices)
        return
    get = itemgetter(*fields)
    for sample in samples:
        try:
            row = get(sample)
        except KeyError:
            row = _pick(sample, choices)  # raises, naming the field
        yield (row,) if len(fields) == 1 else row


def _pick(sample: dict[str, Any], choices: list[list[str]]) -> tuple[Any, ...]:
    row = []
    for options in choices:
        for name in options:
            if name in sample:
                row.append(sample[name])
                break
        else:
            key, names = sample.get("__key__"), [str(name) for name in sample]
            where = f"sample {key!r} of {sample.get('__shard__')}" if key is not None else "a sample"
            closest = _closest(options, names)
            raise DecodeError(f"{where} has none of the fields {';'.join(options)}: it holds {listed(names)}"
                              + (f" (did you mean {closest}?)" if closest else ""), key=key)
    return tuple(row)


_LISTED = 20  # field names a message lists at most


def listed(names: Iterable[str]) -> str:
    """Field names for a message, the sample's own before ``__key__`` and the like."""
    ordered = sorted(names, key=lambda name: (name.startswith("__"), name))
    more = f", ... ({len(ordered)} in all)" if len(ordered) > _LISTED else ""
    return ", ".join(ordered[:_LISTED]) + more


def _closest(options: Sequence[str], names: Iterable[str]) -> str:
    """The field names nearest to any of ``options``, quoted: those with an option as a
    dotted part (``jpg`` in ``0.jpg``, ``boxes`` in ``1.boxes.npy``), else difflib's closest."""
    names = sorted(names)
    near = [n for n in names if any(o in n.split(".") for o in options)]
    near = near or [n for o in options for n in difflib.get_close_matches(o, names, n=2)]
    return " or ".join(repr(n) for n in dict.fromkeys(near[:3]))


def _absent(spec: str, names: frozenset[str]) -> str:
    """``no field 'jpg' (did you mean '0.jpg'?)``, or ``none of 'jpg;png'``..."""
    options = spec.split(";")
    closest = _closest(options, names)
    said = f"no field {spec!r}" if len(options) == 1 else f"none of {spec!r}"
    return said + (f" (did you mean {closest}?)" if closest else "")


def batched_stage(
    samples: Iterable[Any], batchsize: int, collation_fn: Callable[[list[Any]], Any] | None, keep_short: bool
) -> Iterator[Any]:
    """Group samples into lists of ``batchsize`` and collate them; keep a short last batch if ``keep_short``."""
    batch: list[Any] = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == batchsize:
            yield collation_fn(batch) if collation_fn else batch
            batch = []
    if batch and keep_short:
        yield collation_fn(batch) if collation_fn else batch
