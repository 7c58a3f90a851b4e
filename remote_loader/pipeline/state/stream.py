"""One worker's stream of one epoch, and how it resumes: ``reset(entry)`` / ``get_state()``,
as torchdata's nodes.

**The order.** A worker reads its *plan* (intervals of positions of the epoch's virtual
sequence, ``split.py``) through its *source*: ``open_shards`` spans mixed, then the shuffle
buffer (``delivery.py``). Which position comes out at each output is fixed by the seed, the
epoch, the worker, the plan and that mixing, never by the bytes or by fetch timing. The
stages then turn samples into items; each states what one output holds of its inputs
(``Cardinality``).

**The ledger.** Nothing travels with a sample for checkpoints' sake. The items delivered
account for a number of the source's outputs, found by walking the stages back from the end:
a batch holds its size, a one-to-one stage passes the count through, and a filter noted, for
each sample it kept, how many it had taken in by then. Skipped samples count as outputs.

**A state** (``get_state()``, specified in docs/FORMAT.md; ``resume/states.py`` encodes and
parses it) is that count of outputs delivered, the positions of the plan not yet delivered
(merged intervals: their number follows the shuffle buffer and the open shards, never the
dataset), the repeats ``equalize`` adds, and the plan where it is not the epoch's own split.

**Resuming** (``reset(entry)``; ``resume/loaded.py`` makes the ``Entry``). A worker given its
own state regenerates its order on integers up to the count, fetches only what its shuffle
buffer held there, checks that the positions its state listed are the ones its order leaves,
and goes on exactly as it would have. Every worker's state gathered resumes the epoch on any
ranks and workers: what none delivered is divided as an epoch is, and each worker starts at
output 0 of its share of it. A count state (``state_dict(consumed=...)``) is turned at load
into each worker's own state, with its count and no listed positions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from remote_loader.errors import ResumeError
from remote_loader.format import Sample
from remote_loader.pipeline.stages.chain import Chain, Context
from remote_loader.pipeline.stages.threads import ITEM, note
from remote_loader.pipeline.state.resume import Entry, Layout, encode, share
from remote_loader.read.metrics import Metrics
from remote_loader.read.session import ReadSession

_FLUSH = 64  # items between updates of the timing metrics and trims of what the source keeps


class Source(Protocol):
    """A worker's samples in its delivery order, and what it says of them."""

    @property
    def outputs(self) -> int:
        """Outputs given so far this epoch (a skipped sample counts)."""

    @property
    def emitted(self) -> int:
        """Samples yielded in this iteration."""

    def output_of(self, emitted: int) -> int:
        """Outputs given up to the ``emitted``-th sample yielded (skipped ones before it count)."""

    def trim(self, delivered: int) -> None:
        """Forget what the first ``delivered`` outputs were: delivered for good."""

    def describe(self, emitted: int) -> str | None:
        """The ``emitted``-th sample yielded, for a message."""

    def undelivered(self, delivered: int) -> list[tuple[int, int]]:
        """Positions of the plan not among the first ``delivered`` outputs."""

    def __iter__(self) -> Iterator[Sample]: ...


class Data(Protocol):
    """What a pipeline streams, chosen once when it is made: an indexed dataset
    (``source.Indexed``) or plain tars without a manifest (``tars.Unindexed``)."""

    resumable: bool
    """Its iterations have states."""

    @property
    def classes(self) -> list[str]: ...

    def samples(self) -> int:
        """Samples in an epoch; TypeError where they are not known before they stream."""

    def prepare(self, seed: int, epoch: int, shuffle: bool) -> None:
        """Make ``epoch``'s order before DataLoader workers fork, so that they share it."""

    def source(self, layout: Layout, epoch: int, worker: int, num_workers: int, entry: Entry | None,
               session: ReadSession) -> Source:
        """Worker ``worker``'s source in ``epoch``, from ``entry`` (given where ``resumable``)."""


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


class WorkerStream:
    """One worker's items in one epoch: its source, the stages chained, and the ledger of what
    was delivered.

    Args:
        data: What the pipeline streams.
        layout: The dataset, its seed, this rank's place, the mixing and the stages.
        epoch: The epoch.
        worker: This DataLoader worker (0 without workers), of ``num_workers``.
        metrics: Where it counts samples and time.
        session: Its requests (retrying store, metrics, cancel).
    """

    def __init__(self, data: Data, layout: Layout, epoch: int, worker: int, num_workers: int, metrics: Metrics,
                 session: ReadSession) -> None:
        self.data, self.layout, self.epoch, self.metrics, self.session = data, layout, epoch, metrics, session
        self.worker, self.num_workers = worker, num_workers
        self.stages = list(layout.stages)
        self.chain = Chain.of(self.stages)
        self.context = Context(layout.seed, epoch, layout.rank, worker, metrics)
        self.entry: Entry | None = None
        self.source: Source | None = None
        self.items = 0
        self.finished = False
        self._kept: dict[int, _Kept] = {}
        self._counted = 0  # samples counted in metrics

    def reset(self, entry: Entry | None = None) -> WorkerStream:
        """Start over from ``entry`` (None: the beginning of the worker's share of the epoch)."""
        if entry is None and self.data.resumable:
            entry = Entry(share(self.layout, None, self.worker, self.num_workers))
        source = self.data.source(self.layout, self.epoch, self.worker, self.num_workers, entry, self.session)
        if entry is not None and entry.listed is not None and source.undelivered(entry.delivered) != entry.listed:
            raise ResumeError(f"the state of rank {self.layout.rank} worker {self.worker} lists positions its order"
                              " does not leave undelivered: it was altered, or the dataset's order differs from the"
                              " one it was taken in")
        self.entry, self.source = entry, source
        self.items, self.finished, self._counted = 0, False, 0
        self._kept = {i: _Kept() for i in self.chain.filters}
        return self

    def get_state(self) -> dict[str, Any]:
        """Where the stream stands: see the module's docstring and docs/FORMAT.md."""
        if not self.data.resumable or self.source is None or self.entry is None:
            raise ResumeError("checkpoints need an indexed dataset: run remote-loader index on it")
        delivered = self.delivered()
        plan = self.entry.plan
        header = {**self.layout.header(self.epoch, self.worker, self.num_workers), "run": plan.run}
        return encode(header, self.layout.mixing, delivered, self.source.undelivered(delivered), plan.extras,
                      plan.rows)

    # ------------------------------------------------------------------ iterating

    def __iter__(self) -> Iterator[Any]:
        if self.source is None:
            self.reset()
        assert self.source is not None
        data: Iterator[Any] = iter(self.source)
        for i, stage in enumerate(self.stages):
            out = self._filter(i, stage.run, data) if stage.cardinality.filters else stage.run(data, self.context)
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
        assert self.source is not None
        self.source.trim(self.delivered())
        for i, kept in self._kept.items():
            kept.forget(self._at(i + 1))
        return 0.0, now

    def _count(self) -> None:
        samples = self.samples()
        if samples != self._counted:
            self.metrics.count_samples(samples - self._counted)
            self._counted = samples

    # ------------------------------------------------------------------ the ledger

    def _at(self, stage: int) -> int:
        """Items at the output of stage ``stage - 1`` (the source's for 0) that the items
        delivered account for: walking back from the end, batches multiply, filters look up."""
        return self.chain.inputs(self.items, stage, self._taken_by)

    def _taken_by(self, stage: int, outputs: int) -> int:
        """What filter ``stage`` had taken in when it gave ``outputs`` out."""
        return self._kept[stage].taken_by(outputs)

    def samples(self) -> int:
        """Samples inside the items delivered (those a filter dropped are not)."""
        assert self.source is not None
        last = max(self._kept, default=-1)
        return min(self._at(0), self.source.emitted) if last < 0 else self._at(last + 1)

    def delivered(self) -> int:
        """Outputs of the source's order that the items delivered account for: the samples
        in them, and those skipped or dropped before the last of them."""
        assert self.source is not None
        if self.finished:
            return self.source.outputs
        return self.source.output_of(min(self._at(0), self.source.emitted))

    def _filter(self, i: int, run: Callable[[Iterator[Any], Context], Iterator[Any]],
                data: Iterator[Any]) -> Iterator[Any]:
        """A filter stage over ``data``, noting for each sample it keeps how many it had taken in."""
        taken = 0

        def counted() -> Iterator[Any]:
            nonlocal taken
            for sample in data:
                taken += 1
                yield sample

        note_taken = self._kept[i].taken.append
        for out in run(counted(), self.context):
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
                if self.chain.one_to_one(i) and self.source is not None:
                    where = self.source.describe(number + 1)
                    if where is not None:
                        note(error, f"while processing {where}")
            raise
