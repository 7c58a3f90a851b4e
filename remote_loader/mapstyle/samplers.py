"""Samplers for ``RemoteMapDataset`` whose memory grows with the number of shards, never with
the number of samples: each rank's part of an epoch is produced block by block, from a
position, so a billion-sample epoch needs no table of indices, and a resume is a position.

- ``LocalitySampler`` shuffles the shards, then the samples within windows of a few shards,
  so a batch touches few shards and its samples merge into few GETs. The order inside a
  window is a seeded bijection too, so no window is ever built as a table: a manifest
  claiming a billion samples in one shard costs nothing until that shard's index says
  otherwise.
- ``UniformSampler`` is a uniform shuffle of all samples: a seeded bijection of
  ``[0, N)`` (a Feistel network, walked until it lands inside ``[0, N)``).

Both split an epoch's order into ``world_size`` contiguous parts of ``ceil(N / world_size)``
positions (the last wraps around to the start, repeating fewer than ``world_size``
samples), take ``set_epoch``, and resume mid-epoch from ``state_dict()``, theirs or their
iterator's (which torchdata's ``StatefulDataLoader`` saves and restores).
"""

from __future__ import annotations

import zlib
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from remote_loader.checks import require_int, shown
from remote_loader.config import MOST_EPOCH, current_world
from remote_loader.errors import ConfigError
from remote_loader.format.epoch_order import EpochOrder
from remote_loader.format.shard_counts import ArrayCounts, Counts
from remote_loader.mapstyle.dataset import RemoteMapDataset

_BLOCK = 1 << 16  # positions turned into indices at a time


class _Positions:
    """Indices of positions ``[position, stop)`` of one epoch's order, a block at a time.
    Its state is the next position. The epoch and the first position are taken from the
    sampler at the first ``__next__``: an iterator made and dropped unread (DataLoader with
    workers, and torchdata's ``BatchSampler``, make one before the one they read) changes nothing."""

    def __init__(self, sampler: _EpochSampler, start: int, stop: int) -> None:
        self.sampler, self.start, self.stop = sampler, start, stop
        self.epoch, self.position = sampler.epoch, start  # set again at the first __next__
        self._begun = False
        self.first = 0  # indices of the epoch delivered before this pass began (a resumed one's)
        self._loaded: tuple[int, int] | None = None  # (epoch, delivered) loaded before the first __next__
        self._block: list[int] = []  # the indices of positions [_first, _first + len(_block))
        self._first = 0

    def __iter__(self) -> _Positions:
        return self

    def __next__(self) -> int:
        if not self._begun:
            self.epoch, self.first = self.sampler._begin(self, self._loaded)
            self.position, self._begun = self.start + self.first, True
        if self.position >= self.stop:
            raise StopIteration
        offset = self.position - self._first
        if not 0 <= offset < len(self._block):
            upto = min(self.stop, self.position + _BLOCK)
            positions = np.arange(self.position, upto, dtype=np.int64) % self.sampler.total
            self._block, self._first, offset = self.sampler.indices(self.epoch, positions).tolist(), self.position, 0
        self.position += 1
        return self._block[offset]

    @property
    def delivered(self) -> int:
        """Indices handed out so far in this rank's part."""
        return self.position - self.start

    def state_dict(self) -> dict[str, Any]:
        if self._begun:
            return self.sampler._state(self.epoch, self.delivered)
        return self.sampler._state(*(self._loaded or self.sampler._next_pass()))  # where it would begin

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        epoch, delivered = self.sampler._check_state(state)
        if self._begun:
            self.epoch, self.position, self._block = epoch, self.start + delivered, []
        else:
            self._loaded = epoch, delivered


class _EpochSampler(Sampler[int]):
    """An epoch's order of ``total`` samples, split into equal contiguous parts per rank."""

    total: int

    def __init__(self, total: int, seed: int, rank: int | None, world_size: int | None) -> None:
        self.total = total
        self.seed = require_int("seed", seed, 0, 2**63 - 1)
        self.rank, self.world_size = current_world(rank, world_size)
        self.epoch = 0
        self._auto = True  # set_epoch never called: each iteration takes the next epoch
        self._iterated = False  # an iteration of ``epoch`` began (in auto mode the next takes epoch + 1)
        self._resume: int | None = None  # positions of this rank delivered, from load_state_dict
        self._done: int | None = None  # the epoch a loaded state had finished: a pass of it delivers nothing
        self._live: _Positions | None = None
        self._layout: int | None = None  # what the order depends on besides seed and size (``layout``)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows. Without it, each
        iteration takes the next epoch by itself (0, 1, 2...; after ``load_state_dict``,
        the state's epoch, then the ones after it); once called, iterations follow it exactly."""
        epoch = require_int("epoch", epoch, 0, MOST_EPOCH)
        if self._resume is not None and epoch != self.epoch:
            raise ConfigError(f"a state of epoch {self.epoch} is loaded and not yet iterated: set_epoch({self.epoch})"
                              " and finish it first")
        self.epoch, self._auto = epoch, False

    def __len__(self) -> int:
        return -(-self.total // self.world_size)

    def __iter__(self) -> Iterator[int]:
        start = self.rank * len(self)
        return _Positions(self, start, start + len(self))

    def _next_pass(self) -> tuple[int, int]:
        """The epoch and the indices already delivered of an iteration begun now."""
        advance = self._auto and self._iterated and self._resume is None
        epoch = self.epoch + int(advance)
        return epoch, len(self) if epoch == self._done else (self._resume or 0)

    def _begin(self, live: _Positions, loaded: tuple[int, int] | None) -> tuple[int, int]:
        """Begin ``live`` (at its first ``__next__``): it takes the next epoch, or the sampler's
        loaded state, once; or the state loaded into it (``loaded``), whose epoch the sampler
        then follows; a loaded state of a finished epoch other than the one ``set_epoch`` chose
        holds nothing of that one and is passed over (StatefulDataLoader loads it after the
        user's ``set_epoch``)."""
        if loaded is not None and loaded[1] >= len(self) and not self._auto and loaded[0] != self.epoch:
            loaded = None
        self.epoch, delivered = loaded or self._next_pass()
        self._iterated, self._resume, self._live = True, None, live
        # A finished epoch stays finished while set_epoch keeps it: torchdata makes a fresh
        # iterator after one whose loaded state was finished, which would begin it again.
        self._done = self.epoch if delivered >= len(self) > 0 and not self._auto else None
        return self.epoch, delivered

    @abstractmethod
    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The sample indices at ``positions`` (each in ``[0, total)``) of ``epoch``'s order."""

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this rank's iteration stands: its epoch and how many indices it handed out
        (none yet, before the first iteration). An iteration begins at its first index; after
        ``set_epoch`` to another epoch than its, none of the new epoch's.

        A DataLoader with workers takes indices ahead of what your loop has (``prefetch_factor``
        batches a worker): give ``consumed``, the indices of the batches your loop took this
        epoch, those before a resume included (more than the rank's part counts as all of it: a
        last batch that is short), or take the state from torchdata's ``StatefulDataLoader``,
        which knows."""
        live = self._live
        if live is not None and live.epoch == self.epoch:
            delivered, before = live.delivered, live.first
        else:
            delivered = len(self) if self.epoch == self._done else (self._resume or 0)
            before = delivered
        if consumed is not None:
            consumed = min(require_int("consumed", consumed, 0), len(self))
            if not before <= consumed <= delivered:
                raise ConfigError(f"consumed={consumed}, but this epoch's indices handed out are {before}"
                                  f" (where its pass resumed) to {delivered}: count every index of the epoch your"
                                  " loop took, those before the resume included")
            delivered = consumed
        return self._state(self.epoch, delivered)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next iteration of the state's epoch go on after the indices it had handed
        out. A state of a finished epoch holds no position: without ``set_epoch`` the next
        iteration takes the epoch after it; with it, the epoch set, before or after the load
        (that finished epoch's pass then delivers nothing)."""
        epoch, delivered = self._check_state(state)
        self._live, self._iterated = None, False
        if delivered < len(self):
            self.epoch, self._resume, self._done = epoch, delivered, None
            return
        self._resume, self._done = None, epoch
        if self._auto:
            self.epoch = epoch + 1

    order_version = 1
    """Which definition of the order a state was taken with: a state of another one would
    resume at a position naming other samples."""

    def layout(self) -> int | None:
        """A crc32 of what the order depends on besides the seed and the number of samples
        (the dataset's upload, the shard sizes, the window), or None where nothing else."""
        return None

    def _state(self, epoch: int, delivered: int) -> dict[str, Any]:
        state = {"sampler": type(self).__name__, "order": self.order_version, "epoch": epoch, "seed": self.seed,
                 "total": self.total, "world_size": self.world_size, "delivered": delivered}
        if self.layout() is not None:
            state["layout"] = self.layout()
        return state

    def _check_state(self, state: Mapping[str, Any]) -> tuple[int, int]:
        if not isinstance(state, Mapping):
            raise ConfigError(f"a {type(self).__name__} state is a dict, got {type(state).__name__}")
        expected = {"sampler": type(self).__name__, "seed": self.seed, "total": self.total,
                    "world_size": self.world_size}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ConfigError(f"the sampler state has {key}={state.get(key)!r}, this sampler has {value!r}")
        if state.get("order", 1) != self.order_version:
            raise ConfigError(
                f"the sampler state was taken with order {state.get('order', 1)!r} of"
                f" {type(self).__name__}, this version draws order {self.order_version}: its position"
                " would name other samples; start the epoch afresh"
            )
        if "layout" in state and state["layout"] != self.layout():
            raise ConfigError(f"the sampler state was taken over another dataset, shard sizes or window (layout"
                              f" {shown(state['layout'])}, this sampler's {self.layout()}): its position would name"
                              " other samples; start the epoch afresh")
        epoch = require_int("epoch", state.get("epoch"), 0, MOST_EPOCH)  # what set_epoch takes
        delivered = require_int("delivered", state.get("delivered"), 0, len(self))
        return epoch, delivered


MOST_SAMPLES = 2**62
"""The most samples a sampler's epoch may have: positions and their sums stay int64."""


def _counts(shard_sizes: Sequence[int] | RemoteMapDataset) -> tuple[Counts, int | None]:
    """Samples per shard, and the blocks of the epoch's shard order (None: one block)."""
    if isinstance(shard_sizes, RemoteMapDataset):
        return shard_sizes.reader.counts, shard_sizes.reader.manifest.shards.rows
    problem = "shard_sizes must be a list of sample counts >= 0, one per shard"
    try:
        raw = np.asarray(shard_sizes)
    except (TypeError, ValueError):
        raise ConfigError(f"{problem}, got {shown(shard_sizes)}") from None
    has_bool = raw.ndim == 1 and not isinstance(shard_sizes, np.ndarray) and \
        any(isinstance(size, (bool, np.bool_)) for size in shard_sizes)
    if raw.ndim != 1 or has_bool or (len(raw) and (raw.dtype.kind not in "iu" or raw.min() < 0)):
        raise ConfigError(f"{problem}, got {shown(shard_sizes)}")  # 2.7 was taken as 2, "3" as 3, True as 1
    if len(raw) and float(raw.sum(dtype=np.float64)) > MOST_SAMPLES:
        raise ConfigError(f"{problem}, 2**62 in all at most: got {shown(shard_sizes)}")
    return ArrayCounts(raw.astype(np.int64)), None


class LocalitySampler(_EpochSampler):
    """Each epoch: shuffle the shards, then shuffle samples within windows of ``window`` shards.

    A batch then draws from about ``window`` shards instead of from ``batch`` shards, so
    ``RemoteMapDataset.__getitems__`` merges its samples into fewer, larger GETs. Larger
    windows mix better and cost more GETs per batch. The shards come in the epoch's shard
    order of the streaming dataset: for a manifest read by pages (version 3), blocks of a
    page's shards, so the windows that follow one another read one page. Memory: the
    order of the blocks, one block's shards, and one window's samples.

    Args:
        shard_sizes: Samples per shard in manifest order, or a ``RemoteMapDataset``.
        window: Shards whose samples are mixed together.
        seed: Seed of every epoch's order.
        rank: This rank; default from torch.distributed or ``RANK``.
        world_size: Number of ranks; default from torch.distributed or ``WORLD_SIZE``.
    """

    order_version = 2  # 1 (0.1.0) permuted each window as a table of its samples

    def __init__(
        self,
        shard_sizes: Sequence[int] | RemoteMapDataset,
        *,
        window: int = 4,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.window = require_int("window", window, 1)
        self.counts, self.rows = _counts(shard_sizes)
        if self.rows is not None:
            self.order_version = 3  # windows inside blocks of a page's shards
        super().__init__(self.counts.total, seed, rank, world_size)
        self._epoch_order: EpochOrder | None = None
        self._identity = shard_sizes.reader.identity if isinstance(shard_sizes, RemoteMapDataset) else None

    def layout(self) -> int:
        """A crc32 of the window and the shards: the upload's identity, or the sizes given."""
        if self._layout is None:
            shards = (self._identity.to_bytes(4, "little") if self._identity is not None
                      else np.asarray(self.counts.values, dtype="<i8").tobytes())  # type: ignore[attr-defined]
            self._layout = zlib.crc32(shards, zlib.crc32(self.window.to_bytes(8, "little")))
        return self._layout

    def _order(self, epoch: int) -> EpochOrder:
        if self._epoch_order is None or self._epoch_order.epoch != epoch:
            self._epoch_order = EpochOrder(self.counts, self.rows, self.seed, epoch, True)
        return self._epoch_order

    def _in_window(self, epoch: int, window: int, shards: np.ndarray, ends: np.ndarray,
                   offsets: np.ndarray) -> np.ndarray:
        """The samples at ``offsets`` of a window's order: a seeded bijection of the window's
        samples (``shards``, one after another; ``ends``: the position past each), computed
        for these offsets only."""
        sizes = self.counts.take(shards)
        ends = ends - (ends[0] - sizes[0])  # samples past each shard, from the window's start
        keys = np.random.default_rng([self.seed, epoch, 1, window]).integers(
            0, 2**63, size=_Bijection.rounds, dtype=np.uint64
        )
        drawn = _Bijection(int(ends[-1]), keys)(offsets)
        k = np.searchsorted(ends, drawn, side="right")
        return self.counts.prefix(shards[k]) + drawn - (ends[k] - sizes[k])

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        order = self._order(epoch)
        out = np.empty(len(positions), dtype=np.int64)
        blocks = np.searchsorted(order.ends, positions, side="right")
        per_block = -(-order.rows // self.window)  # windows of a block: none spans two
        for k in np.unique(blocks).tolist():
            shards, ends = order.block(k)
            chosen = np.flatnonzero(blocks == k)
            windows = np.searchsorted(ends, positions[chosen], side="right") // self.window
            for w in np.unique(windows).tolist():
                inside = chosen[windows == w]
                first, last = w * self.window, min((w + 1) * self.window, len(shards))
                start = int(ends[first] - self.counts.take(shards[first : first + 1])[0])
                out[inside] = self._in_window(epoch, k * per_block + w, shards[first:last], ends[first:last],
                                              positions[inside] - start)
        return out

    def order(self) -> np.ndarray:
        """The whole epoch's order of sample indices, before the split across ranks (for
        small datasets and tests: it is as large as the dataset)."""
        return self.indices(self.epoch, np.arange(self.total, dtype=np.int64))


_MASK64 = np.uint64(2**64 - 1)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijective scramble of 64-bit words."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class _Bijection:
    """A seeded bijection of ``[0, n)``: a Feistel network of ``rounds`` rounds on the smallest
    even number of bits that holds ``n``, applied again while it lands outside ``[0, n)``
    (fewer than 4 times on average). Any element is computed alone, in constant memory."""

    rounds = 6

    def __init__(self, n: int, keys: np.ndarray) -> None:
        half = 1
        while 1 << (2 * half) < max(n, 2):
            half += 1
        self.n, self.keys = n, keys
        self._half, self._low = np.uint64(half), np.uint64((1 << half) - 1)

    def _permute(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._low
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self._low)
        return (left << self._half) | right

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = self._permute(x.astype(np.uint64))
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._permute(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


class UniformSampler(_EpochSampler):
    """A uniform random order of all samples each epoch, without a table of indices.

    The order is a bijection of ``[0, N)`` drawn from ``(seed, epoch)``: a 6-round Feistel
    network on the smallest even number of bits that holds ``N``, applied again while it
    lands outside ``[0, N)`` (fewer than 4 times on average). Every rank computes only its
    own positions, a block at a time.

    Args:
        dataset: A ``RemoteMapDataset``, or the number of samples.
        seed: Seed of every epoch's order.
        rank: This rank; default from torch.distributed or ``RANK``.
        world_size: Number of ranks; default from torch.distributed or ``WORLD_SIZE``.
    """

    def __init__(
        self, dataset: RemoteMapDataset | int, *, seed: int = 0, rank: int | None = None, world_size: int | None = None
    ) -> None:
        total = len(dataset) if isinstance(dataset, RemoteMapDataset) else require_int("dataset", dataset, 0,
                                                                                       MOST_SAMPLES)
        super().__init__(total, seed, rank, world_size)
        self._layout = dataset.reader.identity if isinstance(dataset, RemoteMapDataset) else None

    def layout(self) -> int | None:
        """The upload's identity, for a sampler over a ``RemoteMapDataset`` (its order is the
        same for any dataset of its size, but its indices name that upload's samples)."""
        return self._layout

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        keys = np.random.default_rng([self.seed, epoch, 2]).integers(0, 2**63, size=_Bijection.rounds, dtype=np.uint64)
        return _Bijection(self.total, keys)(positions)
