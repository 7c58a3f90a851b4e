"""``to_tuple``'s field names: checked against the manifest's fields when the pipeline is made,
and, where they cannot be checked then, named with the sample's fields when a sample lacks them."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import DataLoader

from remote_loader import ConfigError, DecodeError, LocalStore, RandomResizedCrop, RemoteDataset
from remote_loader.testing.synthetic import SyntheticImages
from tests.helpers import upload


class Detection:
    """Like a detection dataset: (image, {"boxes": array}); its fields are 0.jpg, 1.boxes.npy and 1.json."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        image = Image.new("RGB", (32, 24), (40 * i, 90, 160))
        return image, {"boxes": np.array([[2 + i, 3, 12, 10]], dtype=np.float32)}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = LocalStore(tmp_path_factory.mktemp("to-tuple"))
    store.create_bucket("b")
    upload(store, "b", "detection", Detection(), maxcount=4)
    upload(store, "b", "classes", SyntheticImages(6, size=(16, 12)), maxcount=4)
    return store


def test_a_name_no_sample_holds_is_refused_at_the_call_naming_the_fields_there_are(store):
    ds = RemoteDataset(store, "b", "detection")
    with pytest.raises(ConfigError) as caught:
        ds.to_tuple("jpg", "boxes")
    message = str(caught.value)
    assert "\n" not in message
    assert "'jpg'" in message and "'boxes'" in message
    assert "did you mean '0.jpg'" in message and "did you mean '1.boxes.npy'" in message
    assert "0.jpg, 1.boxes.npy, 1.json" in message


def test_a_misspelt_name_gets_the_closest_field(store):
    with pytest.raises(ConfigError, match=r"no field 'jgp'.*did you mean 'jpg'.*cls, jpg"):
        RemoteDataset(store, "b", "classes").to_tuple("jgp", "cls")
    with pytest.raises(ConfigError, match=r"none of 'png;webp'"):
        RemoteDataset(store, "b", "classes").to_tuple("png;webp", "cls")


def test_every_name_that_works_today_still_works(store):
    classes = RemoteDataset(store, "b", "classes", seed=1)
    assert len(list(classes.to_tuple("jpg;png", "cls"))) == 6  # one alternative present
    assert len(list(classes.to_tuple("png;jpg cls __key__"))) == 6  # the single-string form, special names
    assert len(list(classes.to_tuple("__shard__"))) == 6
    decoded = classes.decode("rgb8").select(lambda s: True).to_tuple("jpg", "cls")  # names kept by decode, select
    assert all(image.ndim == 3 and image.shape[2] == 3 for image, _ in decoded)
    detection = RemoteDataset(store, "b", "detection", seed=1)
    crop = RandomResizedCrop(16, boxes={"1.boxes.npy": "xyxy"})
    pairs = list(detection.decode(crop).to_tuple("0.jpg", "1.boxes.npy"))  # full member names
    assert len(pairs) == 6 and all(boxes.shape[1] == 4 for _, boxes in pairs)


def test_names_after_map_are_checked_at_the_sample_with_its_fields(store):
    renamed = RemoteDataset(store, "b", "classes").map(lambda s: {"image": s["jpg"], "label": s["cls"]})
    assert len(list(renamed.to_tuple("image", "label"))) == 6  # unknown when made: not refused
    wrong = renamed.to_tuple("img", "label")
    with pytest.raises(DecodeError, match=r"none of the fields img.*it holds image, label.*did you mean 'image'"):
        list(DataLoader(wrong, batch_size=None, num_workers=1))


def test_unindexed_tars_are_checked_at_the_sample(store):
    from remote_loader.pipeline.stages.chain import to_tuple_stage

    samples = [{"__key__": "a", "__shard__": "s.tar", "0.jpg": b"x", "1.boxes.npy": b"y"}]
    with pytest.raises(DecodeError) as caught:
        list(to_tuple_stage(samples, ["jpg", "boxes"]))
    assert "it holds 0.jpg, 1.boxes.npy" in str(caught.value) and "did you mean '0.jpg'" in str(caught.value)
