"""Pipeline stages as plain generator functions over samples: what the stage objects of a
chain (``stages.py``) run."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from remote_loader.errors import ConfigError, DecodeError
from remote_loader.read.shards import REPLAYED


def map_stage(samples: Iterable[Any], fn: Callable[[Any], Any]) -> Iterator[Any]:
    """Apply ``fn`` to every sample."""
    for sample in samples:
        yield fn(sample)


def select_stage(samples: Iterable[Any], predicate: Callable[[Any], bool]) -> Iterator[Any]:
    """Keep the samples for which ``predicate`` is true."""
    for sample in samples:
        if predicate(sample):
            yield sample


def map_tuple_stage(samples: Iterable[Sequence[Any]], fns: Sequence[Callable[[Any], Any] | None]) -> Iterator[Any]:
    """Apply ``fns[i]`` to element ``i`` of each tuple (None leaves an element as it is)."""
    for sample in samples:
        if sample is REPLAYED:  # a replay's placeholder passes every stage unchanged
            yield sample
            continue
        if len(sample) != len(fns):
            raise ConfigError(f"map_tuple got {len(fns)} functions for a sample of {len(sample)} elements")
        yield tuple(x if fn is None else fn(x) for fn, x in zip(fns, sample))


def to_tuple_stage(samples: Iterable[dict[str, Any]], fields: Sequence[str]) -> Iterator[Any]:
    """Turn dict samples into tuples; ``"jpg;png"`` takes the first of those fields present."""
    choices = [spec.split(";") for spec in fields]
    for sample in samples:
        if sample is REPLAYED:
            yield sample
            continue
        row = []
        for options in choices:
            for name in options:
                if name in sample:
                    row.append(sample[name])
                    break
            else:
                raise DecodeError(f"sample {sample.get('__key__')!r} of {sample.get('__shard__')} has none of the fields {';'.join(options)}")
        yield tuple(row)


_END = object()


def _pop_random(buffer: list[Any], rng: np.random.Generator) -> Any:
    pick = int(rng.integers(len(buffer)))
    buffer[pick], buffer[-1] = buffer[-1], buffer[pick]
    return buffer.pop()


def shuffle_stage(samples: Iterable[Any], bufsize: int, initial: int, seed: Sequence[int]) -> Iterator[Any]:
    """Mix samples in a buffer of up to ``bufsize``; each output is drawn uniformly from it.

    Output starts once ``initial`` samples are buffered; while below ``bufsize`` the buffer
    takes three samples per output, so it fills as output flows. It drains at the end:
    every input sample is yielded exactly once.
    """
    if bufsize < 1 or not 0 <= initial <= bufsize:
        raise ConfigError(f"shuffle needs bufsize >= 1 and 0 <= initial <= bufsize; got {bufsize}, {initial}")
    rng = np.random.default_rng(list(seed))
    source = iter(samples)
    buffer: list[Any] = []
    for sample in source:
        buffer.append(sample)
        for _ in range(2):
            if len(buffer) >= bufsize:
                break
            extra = next(source, _END)
            if extra is _END:
                break
            buffer.append(extra)
        if len(buffer) >= initial:
            yield _pop_random(buffer, rng)
    while buffer:
        yield _pop_random(buffer, rng)



def batched_stage(
    samples: Iterable[Any], batchsize: int, collation_fn: Callable[[list[Any]], Any] | None, partial: bool
) -> Iterator[Any]:
    """Group samples into lists of ``batchsize`` and collate them; keep a short last batch if ``partial``."""
    if batchsize < 1:
        raise ConfigError(f"batch size must be >= 1, got {batchsize}")
    batch: list[Any] = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == batchsize:
            yield collation_fn(batch) if collation_fn else batch
            batch = []
    if batch and partial:
        yield collation_fn(batch) if collation_fn else batch


# --------------------------------------------------------------------------- stage objects
