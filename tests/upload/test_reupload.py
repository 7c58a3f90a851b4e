"""Running an upload again over changed items: every item the run would keep is read again
and compared with the digest its shard recorded, so a changed item is caught wherever it is,
never kept under words that say the dataset is the same."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from PIL import Image, ImageOps

from remote_loader import DatasetReader, LocalStore, UploadError, restore
from remote_loader.upload import fingerprint, tasks
from tests.helpers import upload

N = 300


class Labelled:
    """``N`` small RGB images labelled ``i % 7``; item ``changed`` (if any) inverted and labelled 99,
    as a fixed label and image would be; item ``bad`` (if any) unreadable."""

    def __init__(self, changed: int | None = None, bad: int | None = None) -> None:
        self.changed, self.bad = changed, bad

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int):
        if index == self.bad:
            raise OSError("the disk is away")
        pixels = np.random.default_rng(index).integers(0, 256, (12, 16, 3), dtype=np.uint8)
        image = Image.fromarray(pixels)
        if index == self.changed:
            return ImageOps.invert(image), 99
        return image, index % 7


UNSAMPLED = 3
assert UNSAMPLED not in fingerprint.indices(N)  # only reading every item finds it
STOP = 258  # in the last task of 64, and unsampled: the run stops there, not at its fingerprint
assert STOP not in fingerprint.indices(N)


def _labels(client, bucket, folder):
    return {int(s["__key__"]): restore(s)[1] for s in DatasetReader(client, bucket, folder)}


def _objects(client, bucket, folder):
    return {o.key: client.get(bucket, o.key) for o in client.list(bucket, f"{folder}/")}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_changed_item_anywhere_is_caught_and_the_dataset_left_as_it_is(s3, workers):
    client, bucket = s3
    upload(client, bucket, "labels", Labelled(), maxcount=64, workers=workers)
    before = _objects(client, bucket, "labels")
    with pytest.raises(UploadError, match=rf"holds a dataset uploaded with these parameters, but ds\[{UNSAMPLED}\] is"
                                          r" not the item uploaded from it .* pass overwrite=True \(--overwrite\) to"
                                          r" replace the dataset") as error:
        upload(client, bucket, "labels", Labelled(changed=UNSAMPLED), maxcount=64, workers=workers)
    assert error.value.index == UNSAMPLED and "\n" not in str(error.value)
    assert _objects(client, bucket, "labels") == before  # nothing written, nothing removed
    assert _labels(client, bucket, "labels")[UNSAMPLED] == UNSAMPLED % 7
    replaced = upload(client, bucket, "labels", Labelled(changed=UNSAMPLED), maxcount=64, workers=workers,
                      overwrite=True)
    assert replaced.uploaded_samples == N and _labels(client, bucket, "labels")[UNSAMPLED] == 99


def test_an_unchanged_rerun_reads_every_item_and_uploads_nothing(s3):
    client, bucket = s3
    upload(client, bucket, "same", Labelled(), maxcount=64, workers=2)
    again = upload(client, bucket, "same", Labelled(), maxcount=64, workers=2)
    assert (again.uploaded_samples, again.compared, again.kept_samples) == (0, N, N)
    assert str(again).startswith(f"s3://{bucket}/same already holds this dataset, {N} samples in 5 shards (")
    assert f": all {N} items read and compared, nothing to upload (" in str(again)


def test_without_verify_only_the_sampled_items_are_compared_and_said_so(s3):
    client, bucket = s3
    upload(client, bucket, "fast", Labelled(), maxcount=64)
    trusted = upload(client, bucket, "fast", Labelled(changed=UNSAMPLED), maxcount=64, verify=False)
    sampled = len(fingerprint.indices(N))
    assert trusted.uploaded_samples == 0 and trusted.compared == 0 and trusted.sampled == sampled == 128
    words = str(trusted)
    assert "this dataset" not in words and words.startswith(f"s3://{bucket}/fast holds a dataset uploaded with these"
                                                            " parameters, 300 samples in 5 shards (")
    assert (f": nothing uploaded, only the {sampled} sampled items compared (verify=False; verify=True reads and"
            " compares every item)") in words


def test_a_resumed_upload_writes_again_a_kept_task_whose_item_changed(s3, caplog):
    """Tasks 0-3 of an upload finish, task 4 stops at an unreadable item; item 3 (task 0)
    is changed before the run that finishes it: task 0 is written again, the others kept."""
    client, bucket = s3
    args = dict(maxcount=64, shuffle=False)
    with pytest.raises(UploadError, match="sample 290"):
        upload(client, bucket, "resumed", Labelled(bad=290), **args)
    with caplog.at_level(logging.WARNING, logger="remote_loader"):
        summary = upload(client, bucket, "resumed", Labelled(changed=UNSAMPLED), **args)
    assert summary.rewritten == (UNSAMPLED,) and (summary.kept_samples, summary.compared) == (192, 192)
    assert summary.uploaded_samples == 108 and summary.samples == N
    assert "kept 3 shards (192 samples) from an earlier run, all 192 items read and compared" in str(summary)
    assert f"wrote again 1 task of the earlier run whose items changed since (ds[{UNSAMPLED}] first)" in str(summary)
    assert any(f"ds[{UNSAMPLED}] is not the item an earlier run of this upload wrote; its task 0 is written again"
               in r.getMessage() for r in caplog.records)
    labels = _labels(client, bucket, "resumed")
    assert sorted(labels) == list(range(N)) and labels[UNSAMPLED] == 99
    assert all(labels[i] == i % 7 for i in range(N) if i != UNSAMPLED)


def test_a_resumed_upload_without_verify_keeps_its_tasks_as_sampled(s3):
    client, bucket = s3
    args = dict(maxcount=64, shuffle=False)
    with pytest.raises(UploadError, match="sample 290"):
        upload(client, bucket, "fast", Labelled(bad=290), **args)
    summary = upload(client, bucket, "fast", Labelled(), verify=False, **args)
    assert summary.rewritten == () and summary.kept_samples == 256 and summary.compared == 0
    assert "from an earlier run, only the 128 sampled items compared (verify=False; " in str(summary)


def test_a_dataset_uploaded_before_digests_were_recorded_is_compared_as_sampled_and_said_so(s3, monkeypatch):
    client, bucket = s3
    monkeypatch.setattr(tasks, "item_digest", lambda item, files, index: None)  # as uploads wrote shards before
    upload(client, bucket, "old", Labelled(), maxcount=64)
    monkeypatch.undo()
    again = upload(client, bucket, "old", Labelled(changed=UNSAMPLED), maxcount=64)
    assert again.uploaded_samples == 0 and again.compared == 0
    words = str(again)
    assert "this dataset" not in words and "holds a dataset uploaded with these parameters" in words
    assert ("nothing uploaded, only the 128 sampled items compared (it was uploaded before uploads recorded a digest"
            " of each item: overwrite=True uploads it again)") in words


def test_an_item_skipped_then_that_reads_now_is_caught(s3):
    """An item skipped at upload (on_error="skip") is in no shard: the check reads it again
    too, and one that reads now is named, not kept out under 'all items compared'."""
    client, bucket = s3
    args = dict(maxcount=64, on_error="skip")
    upload(client, bucket, "skips", Labelled(bad=UNSAMPLED), **args)
    again = upload(client, bucket, "skips", Labelled(bad=UNSAMPLED), **args)  # still unreadable: the same dataset
    assert again.uploaded_samples == 0 and again.compared == N - 1
    with pytest.raises(UploadError, match=rf"but ds\[{UNSAMPLED}\], skipped then \(it could not be read or encoded\),"
                                          r" reads now; pass overwrite=True"):
        upload(client, bucket, "skips", Labelled(), **args)
    assert UNSAMPLED not in _labels(client, bucket, "skips")


def test_a_resumed_upload_writes_again_a_kept_task_whose_skipped_item_reads_now(s3):
    client, bucket = s3
    args = dict(maxcount=64, shuffle=False, on_error="skip")

    class Stopping(Labelled):
        def __getitem__(self, index: int):
            if index == STOP:
                raise KeyboardInterrupt  # the run is stopped (Ctrl-C) while task 4 is written
            return super().__getitem__(index)

    stopping = Stopping(bad=UNSAMPLED)
    with pytest.raises(KeyboardInterrupt):
        upload(client, bucket, "resumed-skips", stopping, **args)
    summary = upload(client, bucket, "resumed-skips", Labelled(), **args)
    assert summary.kept_samples == 192, str(summary)  # tasks 1-3; task 0 held the skipped item
    assert summary.rewritten == (UNSAMPLED,) and summary.skipped == 0
    labels = _labels(client, bucket, "resumed-skips")
    assert sorted(labels) == list(range(N)) and labels[UNSAMPLED] == UNSAMPLED % 7


class Boxed:
    """Palette masks and boxes whose palette, box format and canvas are given: the same pixels
    and values with other metadata."""

    def __init__(self, palette: list[int], fmt: str, canvas: tuple[int, int]) -> None:
        self.palette, self.fmt, self.canvas = palette, fmt, canvas

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        import torch
        from torchvision import tv_tensors

        mask = Image.fromarray(np.full((8, 8), index % 2, np.uint8))
        mask.putpalette(self.palette)
        boxes = tv_tensors.BoundingBoxes(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), format=self.fmt,
                                         canvas_size=self.canvas)
        return mask, {"boxes": boxes}


@pytest.mark.parametrize("changed", [{"palette": [0, 0, 0, 0, 255, 0]}, {"fmt": "XYWH"}, {"canvas": (100, 200)}])
def test_items_changed_only_in_what_the_round_trip_keeps_of_them_are_caught(tmp_path, changed):
    """A mask's palette, a box's format or canvas: restored by a read, so another dataset."""
    pytest.importorskip("torchvision")
    client = LocalStore(str(tmp_path))
    client.create_bucket("b")
    first = {"palette": [0, 0, 0, 255, 0, 0], "fmt": "XYXY", "canvas": (8, 8)}
    upload(client, "b", "meta", Boxed(**first), shuffle=False)  # type: ignore[arg-type]
    with pytest.raises(UploadError, match=r"but ds\[0\] is not the item uploaded from it"):
        upload(client, "b", "meta", Boxed(**{**first, **changed}), shuffle=False)  # type: ignore[arg-type]
