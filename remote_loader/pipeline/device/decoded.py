"""Batches decoded on a device as they come: the caller's thread draws them from the
DataLoader, the pipeline's thread engine (``threads.threaded_map``, one thread) decodes
each on the decoder's CUDA stream, two batches ahead. No thread but the caller's ever
waits in the DataLoader, so an epoch left early leaves nothing behind in it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

from remote_loader.pipeline.device.decoder import SKIPPED, Decoded, DeviceDecoder
from remote_loader.pipeline.stages.threads import threaded_map


def decoded_with_states(batches: Iterable[Any], decoder: DeviceDecoder,
                        snapshot: Callable[[], Any] | None) -> Generator[tuple[Any, Any], None, None]:
    """``batches`` with their images decoded, each ready when handed out (the caller's
    stream waits for it), each with ``snapshot()`` taken just after it was drawn from
    ``batches``: batches are drawn ahead of the one handed out, so a stateful loader's own
    state is ahead of what the caller has; this is the state that matches each batch."""

    def drawn() -> Iterator[tuple[Any, Any]]:
        for item in batches:
            yield item, snapshot() if snapshot is not None else None

    def decode(pair: tuple[Any, Any]) -> tuple[Decoded, Any]:
        return decoder.finish(pair[0]), pair[1]

    pending: deque[Decoded] = deque()
    try:
        for decoded, state in threaded_map(decode, drawn(), 1):
            item = decoder.hand_over(decoded, pending)
            if item is not SKIPPED:
                yield item, state
    finally:  # the inputs of batches still decoding go back to the pinned-memory cache only once read
        for left in pending:
            if left.event is not None:
                left.event.synchronize()
