"""One worker's iteration: its source, its stages chained, and what it has delivered.

Nothing travels with a sample for checkpoints' sake. The items delivered so far account for
a number of the source's samples, found by walking the stages back from the end: a batch of
``B`` holds ``B`` samples, a one-to-one stage passes the count through, and a filter
(``select``) has noted, for each sample it kept, how many it had taken in by then. That
number, turned into outputs of the source's order (skipped samples count), and the source's
positions make the iteration's state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from remote_loader.pipeline.order import Mixing
from remote_loader.pipeline.resume import encode
from remote_loader.pipeline.source import ShardSource
from remote_loader.pipeline.stages import Context, Stage
from remote_loader.pipeline.threads import ITEM, note
from remote_loader.read.metrics import Metrics

_FLUSH = 64  # items between updates of the timing metrics and trims of what the source keeps


class _Kept:
    """What a filter kept: for its ``n``-th kept sample, how many it had taken in by then."""

    def __init__(self) -> None:
        self.base = 0  # kept samples forgotten (delivered for good)
        self.taken: list[int] = []

    def taken_by(self, kept: int) -> int:
        if kept <= 0:
            return 0
        k = min(kept, self.base + len(self.taken)) - 1 - self.base
        return self.taken[k] if k >= 0 else 0

    def forget(self, kept: int) -> None:
        drop = min(kept - 1 - self.base, len(self.taken))
        if drop > 0:
            del self.taken[:drop]
            self.base += drop


class Run:
    """One iteration of one worker.

    Args:
        source: The worker's samples, in its delivery order.
        stages: The pipeline's stages, in order.
        context: What seeded stages draw from.
        header: What each of its states starts with.
        mixing: What its order depends on besides the plan.
        extras: Positions it reads as repeats.
        rows: Its plan, for states of a resumed rest.
        metrics: Where it counts samples and time.
    """

    def __init__(self, source: ShardSource, stages: Sequence[Stage], context: Context, header: dict[str, Any],
                 mixing: Mixing, extras: frozenset[int], rows: Sequence[tuple[int, int]], metrics: Metrics) -> None:
        self.source, self.stages, self.context, self.header = source, list(stages), context, header
        self.mixing, self.extras, self.rows, self.metrics = mixing, extras, rows, metrics
        self.items = 0
        self.finished = False
        self._kept: dict[int, _Kept] = {i: _Kept() for i, s in enumerate(self.stages) if s.cardinality.filters}
        self._counted = 0  # samples counted in metrics

    def __iter__(self) -> Iterator[Any]:
        data: Iterator[Any] = iter(self.source)
        for i, stage in enumerate(self.stages):
            out = self._filter(i, stage, data) if stage.cardinality.filters else stage.run(data, self.context)
            data = self._named(i, out)
        busy, waited = 0.0, self.metrics.wait_seconds
        try:
            while True:
                started = time.perf_counter()
                try:
                    item = next(data)
                except StopIteration:
                    break
                busy += time.perf_counter() - started
                self.items += 1
                self._count()
                if not self.items % _FLUSH:
                    busy, waited = self._flush(busy, waited)
                yield item
            self.finished = True
            self._count()
        finally:
            self._flush(busy, waited)

    def _flush(self, busy: float, waited: float) -> tuple[float, float]:
        """Time spent producing items, less the time waiting on storage, as user time; and
        forget what is delivered for good."""
        now = self.metrics.wait_seconds
        self.metrics.add(user_seconds=busy - (now - waited))
        delivered = self.delivered()
        self.source.trim(delivered)
        for i, kept in self._kept.items():
            kept.forget(self._at(i + 1))
        return 0.0, now

    def _count(self) -> None:
        samples = self.samples()
        if samples != self._counted:
            self.metrics.count_samples(samples - self._counted)
            self._counted = samples

    # ------------------------------------------------------------------ what was delivered

    def _at(self, stage: int) -> int:
        """Items at the output of stage ``stage - 1`` (the source's for 0) that the items
        delivered account for: walking back from the end, batches multiply, filters look up."""
        n = self.items
        for i in range(len(self.stages) - 1, stage - 1, -1):
            held = self.stages[i].cardinality
            if held.batches:
                n *= held.size or 1
            elif held.filters:
                n = self._kept[i].taken_by(n)
        return n

    def samples(self) -> int:
        """Samples inside the items delivered (those a filter dropped are not)."""
        last = max(self._kept, default=-1)
        return min(self._at(last + 1), self.source.emitted) if last < 0 else self._at(last + 1)

    def delivered(self) -> int:
        """Outputs of the source's order that the items delivered account for: the samples
        in them, and those skipped or dropped before the last of them."""
        if self.finished:
            return self.source.outputs
        return self.source.output_of(min(self._at(0), self.source.emitted))

    def state(self) -> dict[str, Any]:
        """The iteration's state (``resume/states.py``)."""
        delivered = self.delivered()
        return encode(self.header, self.mixing, delivered, self.source.undelivered(delivered), self.extras,
                      self.rows)

    # ------------------------------------------------------------------ stages

    def _filter(self, i: int, stage: Stage, data: Iterator[Any]) -> Iterator[Any]:
        """``stage`` over ``data``, noting for each sample it keeps how many it had taken in."""
        taken = 0

        def counted() -> Iterator[Any]:
            nonlocal taken
            for sample in data:
                taken += 1
                yield sample

        note_taken: Callable[[int], None] = self._kept[i].taken.append
        for out in stage.run(counted(), self.context):
            note_taken(taken)
            yield out

    def _named(self, i: int, data: Iterator[Any]) -> Iterator[Any]:
        """Stage ``i``'s output; a failure on an item without a key gets the name of the
        sample it came from, when every stage before maps one sample to one."""
        try:
            yield from data
        except Exception as error:
            number = getattr(error, ITEM, None)
            if number is not None:
                delattr(error, ITEM)
                if all(s.cardinality.one_to_one for s in self.stages[:i]):
                    where = self.source.describe(number + 1)
                    if where is not None:
                        note(error, f"while processing {where}")
            raise
