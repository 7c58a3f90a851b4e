"""Datasets the CLI tests name as the upload's source (``tests.cli.sources:twenty``).

Kept apart from the test modules: the CLI imports the source's module in its own process, and
a test module imports pytest and torch, which took about 3 s of each such command's 4."""

from __future__ import annotations

import os
from pathlib import Path

from remote_loader.testing.synthetic import SyntheticImages


class _InterruptedAt(SyntheticImages):
    """Ctrl-C arrives while sample 5 is read (an upload with ``--workers 0`` reads it in the CLI's process)."""

    def __getitem__(self, index: int):  # type: ignore[override]
        if index == 5:
            raise KeyboardInterrupt
        return super().__getitem__(index)


def interrupted() -> SyntheticImages:
    return _InterruptedAt(20, size=(16, 12))


def twenty() -> SyntheticImages:
    return SyntheticImages(20, size=(16, 12))


def marked() -> SyntheticImages:
    """``twenty()``, once it has written the file ``SOURCE_BUILT_MARKER`` names: a test sees
    whether the command built the dataset (which can take minutes)."""
    Path(os.environ["SOURCE_BUILT_MARKER"]).write_text("built")
    return twenty()


def source_that_fails():
    """A source whose function raises with a message of two lines."""
    raise ValueError("cannot build\nthe dataset")


class _ItemFails(SyntheticImages):
    def __getitem__(self, index):
        if index == 3:
            raise RuntimeError("line one\nline two")
        return super().__getitem__(index)


def source_whose_item_fails():
    """A source whose ds[3] raises with a message of two lines."""
    return _ItemFails(6, size=(16, 16))
